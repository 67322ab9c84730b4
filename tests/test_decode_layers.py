"""A decode-only step's layers as one C++ op (engine/model/fused_decode.py) give the Python loop's
results bit for bit — the same greedy tokens and the same log-probs — on every model family and
projection kind, and steps it does not cover (prefill chunks, int8 caches) keep the loop."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.fused_decode import ENV
from engine.model.packed_linear import ENV as PACKED_ENV
from tests.helpers import random_prompts

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def _run(llm: LLM, prompts: list[list[int]], fused: bool, monkeypatch) -> tuple[list, list, int]:
    """Greedy tokens and log-probs of `prompts`, and how many steps ran the fused op."""
    monkeypatch.setenv(ENV, "1" if fused else "0")
    model = llm.engine.model
    model.fused_kernels = None  # gathered again under this setting at the next step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outs = llm.generate(prompts, PARAMS)
    calls = sum(e.count for e in prof.key_averages() if e.key == "kvtop_cpu::decode_layers")
    return [o.token_ids for o in outs], [o.logprobs for o in outs], calls


def _engine(path, dtype: str, **kwargs) -> LLM:
    # no prefix cache: the second run of the same prompts would prefill over cached blocks (other
    # kernels, other rounding) and the comparison would not be of the decode steps alone
    return LLM(
        str(path), dtype=dtype, kv_cache_memory="16MiB", max_num_seqs=8, enable_prefix_caching=False, quiet=True,
        **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "smollm-tied", "qwen2", "qwen3"])  # qkv bias, q/k norms
def test_fused_decode_gives_the_python_loops_tokens_and_logprobs(tiny_models, family, dtype, monkeypatch):
    llm = _engine(tiny_models[family], dtype)
    prompts = random_prompts(6, (3, 40), seed=1)
    tokens, logprobs, calls = _run(llm, prompts, fused=True, monkeypatch=monkeypatch)
    ref_tokens, ref_logprobs, ref_calls = _run(llm, prompts, fused=False, monkeypatch=monkeypatch)
    assert ref_calls == 0
    assert calls >= PARAMS.max_tokens - 1  # every decode-only step; the prompts' steps keep the loop
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs  # bit for bit: the same kernels in the same order


@pytest.mark.parametrize(
    ("packing", "dtype"),
    [("0", "float32"), ("0", "bfloat16"), ("onednn", "bfloat16"), ("all", "float32")],
)
def test_fused_decode_with_every_linear_kind(tiny_models, packing, dtype, monkeypatch):
    """KVTOP_PACKED_LINEAR=0 keeps nn.Linear (at::linear from C++), `onednn` and `all` pack with
    oneDNN (its packed op, called boxed from C++) where this CPU runs it: the same answer each way."""
    monkeypatch.setenv(PACKED_ENV, packing)
    llm = _engine(tiny_models["llama"], dtype)
    prompts = random_prompts(4, (3, 30), seed=2)
    fused = _run(llm, prompts, fused=True, monkeypatch=monkeypatch)
    loop = _run(llm, prompts, fused=False, monkeypatch=monkeypatch)
    assert fused[2] > 0
    assert fused[:2] == loop[:2]


def test_steps_the_op_does_not_cover_keep_the_loop(tiny_models, monkeypatch):
    """An int8 cache (its store quantizes in torch) never takes the op, and its tokens do not move."""
    llm = _engine(tiny_models["llama"], "float32", kv_cache_dtype="int8")
    prompts = random_prompts(3, (3, 20), seed=3)
    tokens, logprobs, calls = _run(llm, prompts, fused=True, monkeypatch=monkeypatch)
    assert calls == 0
    assert (tokens, logprobs) == _run(llm, prompts, fused=False, monkeypatch=monkeypatch)[:2]


def test_a_batch_mixing_prefill_and_decode_keeps_the_loop(tiny_models, monkeypatch):
    """A second prompt arriving while the first decodes: its chunk and the decode share a step (the
    loop), the steps after are decode-only (the op); tokens match the loop's throughout."""
    llm = _engine(tiny_models["llama"], "float32")
    engine = llm.engine
    results = {}
    for fused in (True, False):
        monkeypatch.setenv(ENV, "1" if fused else "0")
        engine.model.fused_kernels = None
        engine.add_request(random_prompts(1, (10, 10), seed=4)[0], PARAMS)
        engine.step()
        engine.step()  # the first request decodes alone
        engine.add_request(random_prompts(1, (25, 25), seed=5)[0], PARAMS)
        finished = []
        while engine.has_unfinished():
            finished += [o for o in engine.step() if o.finished]
        results[fused] = sorted((o.prompt_token_ids[0], o.token_ids, o.logprobs) for o in finished)
    assert results[True] == results[False]
