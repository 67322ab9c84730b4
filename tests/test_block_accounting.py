"""Random add / abort / step sequences keep the KV block accounting exact (hypothesis)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams

SHARED = list(range(100, 148))  # three full blocks every "shared" prompt starts with

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 100), st.integers(1, 64), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 8)),
    ),
    min_size=1,
    max_size=40,
)


def check_accounting(engine) -> None:
    bm = engine.block_manager
    sched = engine.scheduler
    tables = [s.block_table for s in [*sched.running, *sched.waiting, *sched.swapped]]
    refs = Counter(b for t in tables for b in t)
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id} ref count drifted"
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
        if block.ref_count > 1:
            assert block.hash is not None, "only full, hashed prefix blocks may be shared"
    for table in tables:
        assert len(table) == len(set(table)), "a block twice in one table"
    # every device block is exactly one of free, cached, used, shared
    states = bm.block_states()
    device, host = states[: bm.num_blocks], states[bm.num_blocks :]
    assert set(device) <= set(".cus")
    assert device.count(".") + device.count("c") == bm.num_free
    assert device.count("u") + device.count("s") + bm.num_free == bm.num_blocks
    for seq in sched.swapped:
        assert seq.block_table == [] and seq.host_table
    # every host block is exactly one of free, holding a swapped sequence, or a spilled prefix
    if bm.cpu is not None:
        held = [h for s in sched.swapped for h in s.host_table]
        assert len(held) == len(set(held))
        assert not set(held) & set(bm.cpu.free_queue)
        assert set(bm.cpu.prefix_of) <= set(bm.cpu.free_queue)
        assert host.count("o") == len(held) + len(bm.cpu.prefix_of)
        assert len(held) + len(bm.cpu.free_queue) == bm.cpu.num_blocks
    for seq in [*sched.running, *sched.waiting]:
        assert not seq.host_table
    frame = engine.stats()
    kv = frame["kv"]  # one count per block-map character: free excludes cached, used excludes shared
    assert kv["free"] + kv["cached"] + kv["used"] + kv["shared"] == kv["num_blocks"]
    assert kv["allocatable"] == kv["free"] + kv["cached"] == bm.num_free


MODES = {
    "prefix-cache": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    # a host tier of 12 blocks: swaps and spills, and sometimes too full to swap (recompute then)
    "swap-and-spill": {"preemption_mode": "swap", "cpu_offload_memory": 12 * 16 * 512},
}


@pytest.fixture(scope="module", params=list(MODES))
def small_llm(request, tiny_dir):
    # 20 blocks of 16 tokens: tight enough that random loads preempt
    return LLM(str(tiny_dir), dtype="float32", kv_cache_memory=20 * 16 * 512, max_num_seqs=6,
               max_num_batched_tokens=64, quiet=True, **MODES[request.param])  # fmt: skip


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
# a burst that must preempt, mixed with shared prefixes and aborts, always among the examples
@example(ops=[("add", 100, 64, False)] * 4 + [("add", 60, 40, True)] * 3 + [("step", 8), ("abort", 2), ("step", 8)])
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
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.scheduler.swapped


def test_the_random_runs_really_preempt_and_swap(small_llm):
    """Guard against a vacuous property test: over the examples above, the tight cache did force
    preemptions (and swaps and spills in the swap mode)."""
    frame = small_llm.stats()
    assert frame["scheduler"]["preemptions_total"] > 0
    if small_llm.engine.block_manager.cpu is not None:
        assert frame["kv"]["cpu"]["swap_outs"] > 0
        assert frame["kv"]["cpu"]["swap_ins"] > 0
