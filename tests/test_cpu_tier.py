"""The CPU tier: swap-out/in is bit-exact, swap and recompute give the same tokens, spilled
prefixes come back on a hit instead of being recomputed, and the trade shows in the stats."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kvtop.protocol.errors import ConfigError
from tests.helpers import random_prompts

PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
TIGHT = 24 * 16 * 512  # 24 blocks of the tiny model: 8 prompts of 20–60 tokens + 40 outputs preempt


def test_swap_and_recompute_give_the_same_tokens(tiny_dir):
    prompts = random_prompts(8, (20, 60), seed=7)
    recompute = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=TIGHT, quiet=True)
    swap = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=TIGHT, preemption_mode="swap",
               cpu_offload_memory="1MiB", quiet=True)  # fmt: skip
    a = [o.token_ids for o in recompute.generate(prompts, PARAMS)]
    b = [o.token_ids for o in swap.generate(prompts, PARAMS)]
    assert a == b
    cpu = swap.stats()["kv"]["cpu"]
    assert cpu["swap_outs"] > 0 and cpu["swap_ins"] == cpu["swap_outs"]
    assert cpu["swap_out_bytes"] > 0 and cpu["to_host_s"] > 0
    # every swapped sequence came back; what the host still holds is spilled prefix blocks
    assert cpu["swapped_sequences"] == 0
    assert cpu["used"] == cpu["prefix_blocks"]
    assert any(e["kind"] == "swapped" for e in swap.engine.metrics.events)


def test_swap_round_trip_is_bit_exact(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="2MiB", preemption_mode="swap",
              cpu_offload_memory="1MiB", quiet=True)  # fmt: skip
    engine = llm.engine
    rid = engine.add_request(random_prompts(1, (40, 40), seed=1)[0], PARAMS)
    for _ in range(5):
        engine.step()
    seq = engine.seqs[rid]
    before = engine.kv.data[:, :, seq.block_table].clone()
    bm = engine.block_manager
    engine.scheduler.running.remove(seq)
    assert bm.swap_out(seq)
    assert seq.block_table == [] and len(seq.host_table) == before.shape[2]
    assert "o" in bm.block_states()[engine.kv.num_blocks :]
    # scribble over the freed device blocks so a bad restore could not pass by luck
    engine.kv.data.normal_()
    bm.swap_in(seq)
    engine.scheduler.running.append(seq)
    assert torch.equal(engine.kv.data[:, :, seq.block_table], before)


def test_spilled_prefix_is_restored_not_recomputed(tiny_dir):
    # a device cache of 8 blocks: the second system prompt pushes the first one's blocks out
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=8 * 16 * 512, cpu_offload_memory="1MiB", quiet=True)
    sys_a, sys_b = list(range(1000, 1064)), list(range(2000, 2112))  # 4 and 7 full blocks
    q = [5, 6, 7]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = llm.generate([sys_a + q], params)[0]
    llm.generate([sys_b + q], params)  # 8 blocks: all of sys_a's are reallocated
    frame = llm.stats()
    assert frame["kv"]["cpu"]["spilled_blocks"] >= 4
    again = llm.generate([sys_a + q], params)[0]
    assert again.cached_tokens == 64  # all four blocks, restored from the host
    assert again.token_ids == first.token_ids
    frame = llm.stats()
    assert frame["prefix"]["restored_blocks"] >= 4
    assert frame["kv"]["cpu"]["restored_blocks"] >= 4


def test_swap_needs_a_cpu_tier(tiny_dir):
    with pytest.raises(ConfigError, match="cpu_offload_memory"):
        LLM(str(tiny_dir), preemption_mode="swap", quiet=True)
