"""Greedy tokens from our paged, continuously batched engine equal transformers `generate`."""

from __future__ import annotations

import zlib

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import FAMILIES
from tests.helpers import hf_greedy, random_prompts

MAX_NEW = 24


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_family_matches_transformers_in_one_batch(family, tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models[family]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # zlib.crc32, not hash(): str hashes change from process to process, and so did the prompts
    prompts = random_prompts(6, (3, 90), seed=zlib.crc32(family.encode()) % 1000)
    expected = [hf_greedy(hf, p, MAX_NEW, eos=2) for p in prompts]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="4MiB", quiet=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.token_ids for o in outs] == expected


def test_preemption_keeps_tokens_identical(tiny_dir):
    """A KV budget too small for the batch forces preemptions; outputs must not change."""
    prompts = random_prompts(8, (20, 60), seed=7)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="4MiB", quiet=True)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    assert roomy.stats()["scheduler"]["preemptions_total"] == 0
    # 2 layers × 2 × 2 heads × 16 × 4 B = 512 B/token: 24 blocks of 16 = 384 tokens for 8 × ≤100
    tight = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=24 * 16 * 512, quiet=True)
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.stats()["scheduler"]["preemptions_total"] > 0
    assert got == expected


def test_chunked_prefill_matches_unchunked(tiny_dir):
    prompts = random_prompts(4, (150, 300), seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    whole = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=2048, quiet=True)
    chunked = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=64, quiet=True)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == [
        o.token_ids for o in whole.generate(prompts, params)
    ]


def test_a_prefill_step_computes_the_last_layer_only_for_the_rows_that_sample(tiny_dir):
    """Prompt rows before a sequence's last feed only the KV cache, so the runner asks the last
    layer for the sampling rows alone; their logits must be those of the whole forward, and a
    chunk that samples nothing still stores its KV (the tokens after it match: see above)."""
    from engine.scheduler import ScheduledBatch
    from engine.sequence import Sequence

    engine = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="1MiB", enable_prefix_caching=False, quiet=True).engine
    model, runner = engine.model, engine.runner
    lengths, seqs = [5, 40, 17], []
    for i, n in enumerate(lengths):
        seq = Sequence(f"rows-{i}", random_prompts(1, (n, n), seed=20 + i)[0], SamplingParams(max_tokens=1))
        seq.block_table = list(range(4 * i, 4 * i + 4))
        seqs.append(seq)
    full: list[torch.Tensor] = []
    returned: list[tuple[int, ...]] = []
    original = model.forward

    def every_row(*args):  # the same step with the last layer over every row, kept for the check
        full.append(original(*args[:5]))
        hidden = original(*args)
        returned.append(tuple(hidden.shape))
        return hidden

    model.forward = every_row
    try:
        logits, idx = runner.execute(ScheduledBatch(seqs=seqs, num_new_tokens=lengths))
    finally:
        del model.forward
    ends = torch.tensor(lengths).cumsum(0) - 1
    assert idx == [0, 1, 2]
    assert returned == [(3, model.spec.hidden_size)]  # not 62 rows
    # the same rows' logits (equal bits where a row's sums do not depend on the call's row count, as
    # in our panel kernels; other BLAS may block 3 rows and 62 differently)
    torch.testing.assert_close(logits, model.compute_logits(full[0][ends]), rtol=1e-6, atol=1e-6)
    for seq in seqs:
        seq.num_computed_tokens = 0
    logits, idx = runner.execute(ScheduledBatch(seqs=seqs[1:2], num_new_tokens=[30]))  # mid-prompt
    assert idx == [] and logits.shape[0] == 0


def test_a_one_token_prompt_chunk_among_decodes_samples_nothing(tiny_dir):
    """With one token of budget left, a prompt's chunk can be a single token mid-prompt: the step is
    all one-token rows (the fused decode op on the CPU), yet that row samples nothing. Its output
    must not reach the sampler: one logit row too many ended the engine's step."""
    short = random_prompts(15, (1, 1), seed=1)
    long = random_prompts(1, (20, 20), seed=2)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="4MiB", enable_prefix_caching=False, quiet=True)
    expected = [o.token_ids for o in roomy.generate([*short, long], params)]
    tight = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16,
                max_num_seqs=32, enable_prefix_caching=False, quiet=True)  # fmt: skip
    engine, done = tight.engine, {}
    for i, prompt in enumerate(short):
        engine.add_request(prompt, params, request_id=f"r{i}")
    for step in range(60):
        if step == 3:  # 15 decodes + 1 token of budget: the long prompt's first chunk is one token
            engine.add_request(long, params, request_id="long")
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished():
            break
    assert [done[f"r{i}"] for i in range(15)] + [done["long"]] == expected


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_llm, smollm2_hf):
    tok = smollm2_llm.tokenizer
    questions = [
        "What is the capital of France?",
        "Write a short poem about the ocean and the moon and the stars at night.",
        "Explain what a KV cache is.",
        "List three fruits.",
    ]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    eos = tok.eos_token_id
    expected = [hf_greedy(smollm2_hf, p, 32, eos=eos) for p in prompts]
    outs = smollm2_llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in outs[0].text
