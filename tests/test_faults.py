"""A step that raises fails the requests in it with reason `error`; the engine serves the rest."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.helpers import random_prompts


def test_injected_fault_fails_only_that_steps_requests(tiny_dir, monkeypatch):
    monkeypatch.setenv("KVTOP_FAULT_INJECT", "token=31337")
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="2MiB", quiet=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    good = engine.add_request([5, 6, 7, 8], params)
    for _ in range(2):
        engine.step()
    bad = engine.add_request([9, 31337, 10], params)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs[bad].finish_reason == "error" and "injected fault" in outs[bad].finish_detail
    # the good request shared the failing step: it failed too, with the same reason
    assert outs[good].finish_reason == "error"
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    # the engine keeps serving
    after = llm.generate(random_prompts(3, (5, 20), seed=1), params)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in after)
    frame = llm.stats()
    assert frame["counters"]["requests_failed"] == 2
    assert any(e["kind"] == "step_failed" for e in engine.metrics.events)


def test_fault_at_a_step_number(tiny_dir, monkeypatch):
    monkeypatch.setenv("KVTOP_FAULT_INJECT", "step=3")
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="2MiB", quiet=True)
    outs = llm.generate(random_prompts(4, (5, 20), seed=2), SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["error"] * 4  # all four were in step 3
    again = llm.generate(random_prompts(2, (5, 20), seed=3), SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.finish_reason for o in again] == ["length", "length"]
