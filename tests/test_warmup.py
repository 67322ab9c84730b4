"""The warm-up `kvctl serve` runs before its first request (engine/runtime/warmup.py): a full-budget
prefill and a decode step that leave no trace an operator or a client could see."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runtime.warmup import PROMPT_TOKENS, warm_up
from engine.telemetry.metrics import Counters

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(tiny_dir) -> LLM:
    return LLM(str(tiny_dir), dtype="float32", kv_cache_memory="1MiB", max_num_batched_tokens=512, quiet=True)


@pytest.fixture(scope="module")
def warmed(tiny_dir):
    llm = _engine(tiny_dir)
    return llm, warm_up(llm.engine)


def test_warm_up_runs_a_full_budget_prefill_and_a_decode(warmed):
    tokens, rows, seconds = warmed[1]
    assert (tokens, rows) == (512, 512 // PROMPT_TOKENS)  # the token budget, in prompts of 256
    assert seconds > 0


def test_warm_up_leaves_no_request_block_or_cached_prefix(warmed):
    llm, _ = warmed
    engine = llm.engine
    assert engine.block_manager.num_free == engine.kv.num_blocks  # no block taken
    assert engine.block_manager.num_cached == 0  # nothing for the prefix cache to hit
    assert llm.stats()["sequences"] == [] and engine.step_count == 0
    assert engine.metrics.counters == Counters() and not engine.metrics.events  # no tokens, no requests
    assert engine.metrics.iteration.count == 0  # no step in the step-size histogram


def test_the_garbage_it_leaves_in_free_blocks_changes_no_token(warmed, tiny_dir):
    """Requests after the warm-up land in the very blocks it wrote, one of them with the warm-up's
    own first prompt: the same greedy tokens as an engine that never warmed up, and no prefix hit."""
    llm, _ = warmed
    vocab = llm.engine.spec.vocab_size
    warm_prompt = [(7 + 31 * j) % vocab for j in range(PROMPT_TOKENS)]
    prompts = [warm_prompt, [11, 12, 13, 14, 15] * 7, list(range(40, 340))]
    warmed_out = llm.generate(prompts, GREEDY)
    cold_out = _engine(tiny_dir).generate(prompts, GREEDY)
    assert [o.token_ids for o in warmed_out] == [o.token_ids for o in cold_out]
    assert warmed_out[0].cached_tokens == 0


def test_warm_up_stands_aside_once_the_engine_has_work(tiny_dir):
    llm = _engine(tiny_dir)
    engine = llm.engine
    engine.add_request([5] * 40, GREEDY)
    assert warm_up(engine) is None  # it would write over that request's blocks
    while engine.has_unfinished():
        engine.step()
    assert engine.metrics.counters.requests_finished == 1


def test_warm_up_fits_a_cache_smaller_than_one_of_its_prompts(tiny_dir):
    """A cache of a few blocks (a small --kv-cache-memory) gets one sequence that fits, not an error."""
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="24KiB", quiet=True)  # 3 blocks of 16
    engine = llm.engine
    tokens, rows, _ = warm_up(engine)
    assert rows == 1 and tokens == engine.kv.num_blocks * engine.kv.block_size - 1
    assert engine.block_manager.num_free == engine.kv.num_blocks
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids  # and it still serves


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_cache_after_the_warm_up_gives_the_cold_engines_tokens(tiny_dir, kv_dtype):
    """The warm-up also writes quantization scales (int8: per token) into free blocks; fp8's
    calibrated per-tensor scale must survive it."""

    def engine() -> LLM:
        return LLM(str(tiny_dir), dtype="float32", kv_cache_memory="1MiB", kv_cache_dtype=kv_dtype, quiet=True)

    warm = engine()
    scales = [(layer.k_scale, layer.v_scale) for layer in warm.engine.kv.layers]
    fp8_scales = [(k.clone(), v.clone()) for k, v in scales] if kv_dtype == "fp8_e4m3" else None
    assert warm_up(warm.engine) is not None
    if fp8_scales is not None:
        assert all(torch.equal(k, a) and torch.equal(v, b) for (k, v), (a, b) in zip(scales, fp8_scales, strict=True))
    prompts = [list(range(30, 330)), [9, 8, 7] * 20]
    assert [o.token_ids for o in warm.generate(prompts, GREEDY)] == [
        o.token_ids for o in engine().generate(prompts, GREEDY)
    ]
