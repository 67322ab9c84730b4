"""The prefix cache: exact hit accounting, identical outputs, LRU order, no writes into shared blocks."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.kv.block_manager import BlockManager
from engine.sampling import SamplingParams as SP
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from tests.helpers import random_prompts

SYSTEM = list(range(1000, 1050))  # 50 tokens: 3 full blocks of 16, then a mixed one
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def questions(n: int, seed: int = 0) -> list[list[int]]:
    return [SYSTEM + q for q in random_prompts(n, (5, 30), seed=seed)]


def test_shared_system_prompt_hits_exactly_the_full_blocks(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="4MiB", quiet=True)
    prompts = questions(5)
    warm = llm.generate(prompts[:1], GREEDY)[0]
    assert warm.cached_tokens == 0
    outs = llm.generate(prompts[1:], GREEDY)
    assert [o.cached_tokens for o in outs] == [48] * 4  # 3 full blocks of the 50-token system prompt
    prefix = llm.stats()["prefix"]
    assert prefix["hit_tokens"] == 4 * 48
    assert prefix["query_tokens"] == sum(len(p) for p in prompts)
    assert prefix["hit_requests"] == 4
    assert prefix["saved_prefill_s"] > 0


def test_outputs_identical_with_prefix_cache_on_and_off(tiny_dir):
    prompts = questions(6, seed=1)
    on = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="4MiB", quiet=True)
    off = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="4MiB", enable_prefix_caching=False, quiet=True)
    on.generate(prompts[:1], GREEDY)  # warm, so the rest really hit
    got_on = on.generate(prompts, GREEDY)
    got_off = off.generate(prompts, GREEDY)
    assert sum(o.cached_tokens for o in got_on) > 0
    assert all(o.cached_tokens == 0 for o in got_off)
    assert [o.token_ids for o in got_on] == [o.token_ids for o in got_off]


def _fill(bm: BlockManager, tokens: list[int], sid: str) -> Sequence:
    seq = Sequence(sid, tokens, SP(max_tokens=1))
    bm.allocate_prefix(seq, bm.lookup_prefix(seq))
    bm.append_slots(seq, len(tokens) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(tokens)
    bm.commit_full_blocks(seq)
    return seq


def test_lru_eviction_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = _fill(bm, list(range(0, 9)), "a")  # 2 full blocks + 1 partial
    b = _fill(bm, list(range(100, 109)), "b")
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)  # a's prefix is older than b's
    bm.free(b)
    assert bm.num_cached == 4 and bm.num_free == 6
    _fill(bm, list(range(200, 205)), "c")  # needs 2 blocks: the 2 unhashed partial blocks go first
    assert bm.num_cached == 4
    _fill(bm, list(range(300, 305)), "d")  # 2 more: a's, least recently used, tail block first
    assert bm.prefix.evictions == 2
    # a's prefix is gone, b's (more recently used) still hits both full blocks
    assert bm.lookup_prefix(Sequence("pa", list(range(0, 9)), SP(max_tokens=1))) == []
    probe = Sequence("pb", list(range(100, 109)), SP(max_tokens=1))
    assert [bid for _, bid in bm.lookup_prefix(probe)] == b_blocks[:2]
    assert set(a_blocks[:2]) <= set(range(6)) - set(b_blocks)


def test_hash_collision_does_not_share(monkeypatch):
    """A hit compares tokens, not only hashes."""
    bm = BlockManager(num_blocks=8, block_size=4)
    monkeypatch.setattr(BlockManager, "chain_hash", staticmethod(lambda parent, tokens: 42))
    a = _fill(bm, [1, 2, 3, 4, 5], "a")
    probe = Sequence("p", [9, 9, 9, 9, 5], SP(max_tokens=1))
    assert bm.lookup_prefix(probe) == []
    assert bm.lookup_prefix(Sequence("q", [1, 2, 3, 4, 7], SP(max_tokens=1))) == [(False, a.block_table[0])]


def test_no_write_into_a_shared_block(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=32, quiet=True)
    engine = llm.engine
    prompts = questions(6, seed=2)
    llm.generate(prompts[:1], GREEDY)
    for p in prompts[1:]:
        engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    saw_shared = False
    while engine.has_unfinished():
        shared = [b.block_id for b in engine.block_manager.blocks if b.ref_count > 1]
        before = engine.kv.data[:, :, shared].clone()
        engine.step()
        still = [i for i, b in enumerate(shared) if engine.block_manager.blocks[b].ref_count > 1]
        if still:
            saw_shared = True
            after = engine.kv.data[:, :, [shared[i] for i in still]]
            assert torch.equal(before[:, :, still], after)
    assert saw_shared


def test_lpm_policy_same_outputs_and_cached_prefixes_first(tiny_dir):
    prompts = questions(4, seed=3) + random_prompts(4, (20, 60), seed=4)
    fcfs = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="4MiB", max_num_seqs=2, quiet=True)
    lpm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="4MiB", max_num_seqs=2, schedule_policy="lpm", quiet=True)
    lpm.generate(prompts[:1], GREEDY)
    fcfs.generate(prompts[:1], GREEDY)
    a = lpm.generate(prompts, GREEDY)
    b = fcfs.generate(prompts, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(o.finish_reason == "length" for o in a)
    # lpm served the cached-prefix questions first
    first_tokens = sorted(a, key=lambda o: o.metrics.first_token_time)
    assert all(o.cached_tokens > 0 for o in first_tokens[:4])


def _lpm_steps_until_served(max_skips: int, steps: int = 60) -> int | None:
    """One slot; every step a new request sharing a cached 8-token prefix arrives beside a request
    with no cached prefix. lpm serves the cached ones first: the step the loner ran, or None."""
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, policy="lpm", lpm_max_skips=max_skips)
    shared = list(range(1000, 1008))
    loner = Sequence("loner", list(range(5000, 5010)), SP(max_tokens=1))
    sched.add(Sequence("warm", [*shared, 1], SP(max_tokens=1)))
    sched.add(loner)
    for step in range(steps):
        sched.add(Sequence(f"hit-{step}", [*shared, 2000 + step], SP(max_tokens=1)))
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            s.num_computed_tokens += n
            bm.commit_full_blocks(s)
            sched.finish(s)  # each request is one prefill here: done, its prefix blocks stay cached
        if loner in batch.seqs:
            return step
    return None


def test_lpm_skip_bound_serves_a_request_that_would_starve_without_it():
    assert _lpm_steps_until_served(max_skips=10**9) is None  # unbounded: 60 steps, never served
    served = _lpm_steps_until_served(max_skips=16)
    assert served is not None and served <= 17
