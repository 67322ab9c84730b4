"""The CPU backend's long-chunk prefill (`engine.kernels.cpu_prefill`: SDPA per group of sequences
of one shape, causal without a mask when the chunk is the whole context) against the reference
(`engine.kernels.reference.paged_prefill_attention`, the oracle), on random paged layouts.

It is plain torch except where our causal kernels take the groups: in bfloat16 where the CPU has
AMX tiles our tile kernel (`csrc/amx_attention.cpp`, tested on its own in tests/test_amx_attention.py),
and where the build has AVX-512 the fp32 kernel (`csrc/fp32_attention.cpp`, tests/test_fp32_attention.py)
for fp32 groups, and for bfloat16 ones on upcast copies where there is no AMX (AMD Zen 4). The tests
below check whichever runs on this machine on paged layouts; without either, SDPA.

Tolerances, stated once:
- float32 queries over a float32, int8 or fp8 cache: 2e-5 abs and rel (both run SDPA in fp32 over
  the same dequantized K/V; only the tiling differs; measured worst about 1e-6).
- bfloat16 (float16) queries over a bfloat16 (float16) cache: 2e-2 abs and rel (both run SDPA in the
  16-bit dtype; the reference over padded rows and a mask, so its sums round differently).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import cpu
from engine.kernels import reference as ref
from engine.kernels.cpu_prefill import sdpa_pays, sdpa_prefill_attention
from tests.test_triton_kernels import Paged, cu_seqlens, strided_q

FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}
# (num_heads, num_kv_heads): GQA ratios 1, 3 (SmolLM2's 9:3) and 8
HEADS = [(4, 4), (9, 3), (8, 1)]
KINDS = ["auto", "int8", "fp8"]

# (cached prefix, new tokens) per sequence, one call each
LAYOUTS = {
    # every shape different: one-token rows with and without a prefix, a whole prompt longer than a
    # tile, a prefix ending mid-block, hundreds of tokens
    "mixed": [(0, 1), (0, 45), (21, 30), (200, 90), (7, 1), (0, 300), (130, 1), (3, 17)],
    # shapes repeated, the sequences of a shape not next to each other in the batch (gathered
    # queries, scattered outputs), and next to each other (views)
    "grouped": [(0, 64), (0, 64), (100, 20), (0, 64), (100, 20), (100, 20), (0, 1), (0, 1), (40, 1)],
    # the engine's long-prompt step: equal prompts with no cached prefix, packed one after another
    "packed": [(0, 256), (0, 256), (0, 256)],
}


def case(layout, kind="auto", heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32, seed=0):
    seqs = LAYOUTS[layout] if isinstance(layout, str) else layout
    q_lens = [n for _, n in seqs]
    cache = Paged([p + n for p, n in seqs], block_size, kv_heads, head_dim, kind=kind, dtype=dtype, seed=seed)
    q = strided_q(sum(q_lens), heads, head_dim, seed=seed + 1, dtype=dtype)
    args = (q, *cache.cache_args(), cache.block_tables, cu_seqlens(q_lens), cache.seq_lens, head_dim**-0.5)
    return args, cache


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference(layout, kind, heads, kv_heads, head_dim):
    args, cache = case(layout, kind, heads, kv_heads, head_dim, seed=head_dim + heads)
    out = sdpa_prefill_attention(*args, **cache.scales())
    assert out.shape == args[0].shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref.paged_prefill_attention(*args, **cache.scales()), **FP32_TOL)


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(block_size):
    args, _ = case("mixed", block_size=block_size, seed=block_size)
    torch.testing.assert_close(sdpa_prefill_attention(*args), ref.paged_prefill_attention(*args), **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_16_bit_matches_reference(layout, dtype, heads, kv_heads, head_dim):
    args, _ = case(layout, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, seed=5)
    out = sdpa_prefill_attention(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.paged_prefill_attention(*args).float(), **BF16_TOL)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_reference(seed):
    """Random batches: 1..12 sequences, prefixes 0..300, chunks 1..200, shapes repeated at random."""
    rng = random.Random(seed)
    shapes = [(rng.randrange(300) * (i % 2), rng.randrange(1, 200)) for i in range(6)]
    seqs = [rng.choice(shapes) for _ in range(rng.randrange(1, 13))]
    heads, kv_heads = HEADS[seed % 3]
    args, cache = case(seqs, KINDS[seed % 3], heads, kv_heads, 64, seed=seed)
    out = sdpa_prefill_attention(*args, **cache.scales())
    torch.testing.assert_close(out, ref.paged_prefill_attention(*args, **cache.scales()), **FP32_TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_never_reads_past_seq_len(kind):
    """Unwritten slots and the blocks that padding table entries point at hold NaN: a masked-out
    NaN still poisons a softmax or a P·V product, so the keys past a sequence's end must never
    reach SDPA."""
    args, cache = case("grouped", kind, 6, 2, 64, seed=31)
    clean_k, clean_v = cache.k_cache.clone(), cache.v_cache.clone()
    clean_scales = {n: None if s is None else s.clone() for n, s in cache.scales().items()}
    block_size, rows = cache.block_size, cache.k_cache.shape[0] * cache.block_size
    live = torch.zeros(rows, dtype=torch.bool)
    for s, n in enumerate(cache.seq_lens.tolist()):
        pos = torch.arange(n)
        live[cache.block_tables[s, pos // block_size].long() * block_size + pos % block_size] = True
    if kind == "auto":
        for t in (cache.k_cache, cache.v_cache):
            t.view(rows, -1)[~live] = float("nan")
    elif kind == "int8":
        for t in (cache.k_scale, cache.v_scale):
            t.view(rows, -1)[~live] = float("nan")
    else:
        for t in (cache.k_cache, cache.v_cache):
            t.view(torch.uint8).view(rows, -1)[~live] = 0x7F  # fp8 NaN
    q, _, _, tables, cu, lens, scale = args
    out = sdpa_prefill_attention(*args, **cache.scales())
    want = ref.paged_prefill_attention(q, clean_k, clean_v, tables, cu, lens, scale, **clean_scales)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, **FP32_TOL)


@pytest.mark.parametrize("new_tokens", [1, cpu.SHORT_CHUNK, cpu.SHORT_CHUNK + 1, 200])
def test_the_backend_routes_both_sides_of_short_chunk_to_a_correct_kernel(new_tokens):
    """`cpu.paged_prefill_attention` (the backend the engine calls) sends a call whose longest
    chunk is at most SHORT_CHUNK to the C++ in-place kernel and longer ones to SDPA: the
    reference's output either way, with a one-token row beside the long ones."""
    if not cpu.load():
        pytest.skip("the CPU attention kernel could not be built here")  # the short side needs it
    args, _ = case([(0, new_tokens), (37, new_tokens), (300, 1), (300, new_tokens)], seed=new_tokens)
    torch.testing.assert_close(cpu.paged_prefill_attention(*args), ref.paged_prefill_attention(*args), **FP32_TOL)


def test_sdpa_is_chosen_only_where_its_launches_carry_enough_work():
    """One SDPA launch per (new tokens, context) shape costs ~0.2 ms before any work: many short
    prompts of different lengths go to the in-place kernel, long or repeated shapes to SDPA."""

    def pays(seqs):
        return sdpa_pays(cu_seqlens([n for _, n in seqs]), torch.tensor([p + n for p, n in seqs]))

    assert pays([(0, 256)] * 8)  # the engine's long-prompt step
    assert pays([(128, 256)] * 4) and pays([(0, 2048)])
    assert pays([(0, 32)] * 64)  # one launch for all
    assert pays([(100 + 25 * i, 16) for i in range(16)])  # a cached prefix: enough keys per launch
    assert not pays([(0, 24 + i % 17) for i in range(32)])  # 17 launches of ~2 short prompts


def test_many_short_prompts_of_different_lengths_match_reference_through_the_backend():
    if not cpu.load():
        pytest.skip("the CPU attention kernel could not be built here")
    args, _ = case([(0, 24 + i % 17) for i in range(32)], seed=9)
    torch.testing.assert_close(cpu.paged_prefill_attention(*args), ref.paged_prefill_attention(*args), **FP32_TOL)
