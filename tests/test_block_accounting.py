"""Random add / abort / step sequences keep the KV block accounting exact (hypothesis)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams

SHARED = list(range(100, 148))  # three full blocks every "shared" prompt starts with

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 70), st.integers(1, 24), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=40,
)


def check_accounting(engine) -> None:
    bm = engine.block_manager
    tables = [s.block_table for s in engine.scheduler.running] + [s.block_table for s in engine.scheduler.waiting]
    refs = Counter(b for t in tables for b in t)
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id} ref count drifted"
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
        if block.ref_count > 1:
            assert block.hash is not None, "only full, hashed prefix blocks may be shared"
    for table in tables:
        assert len(table) == len(set(table)), "a block twice in one table"
    states = bm.block_states()
    assert states.count(".") + states.count("c") == bm.num_free
    assert states.count("u") + states.count("s") + bm.num_free == bm.num_blocks
    frame = engine.stats()
    assert frame["kv"]["free"] + frame["kv"]["used"] == frame["kv"]["num_blocks"]


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-cache", "no-prefix-cache"])
def small_llm(request, tiny_dir):
    # 20 blocks of 16 tokens: tight enough that random loads preempt
    return LLM(str(tiny_dir), dtype="float32", kv_cache_memory=20 * 16 * 512, max_num_seqs=6,
               max_num_batched_tokens=64, enable_prefix_caching=request.param, quiet=True)  # fmt: skip


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_random_operations_keep_accounting_exact(small_llm, ops):
    engine = small_llm.engine
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, shared = op
            prompt = (SHARED + list(range(3, 3 + length))) if shared else list(range(200 + length, 200 + 2 * length))
            added.append(
                engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
            )
        elif op[0] == "abort" and added:
            engine.abort(added[op[1] % len(added)])
        else:
            for _ in range(op[1]):
                engine.step()
        check_accounting(engine)
    while engine.has_unfinished():
        engine.step()
        check_accounting(engine)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
