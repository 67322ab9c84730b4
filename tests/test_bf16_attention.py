"""The bf16 prefill attention over the paged cache on AVX512-BF16 (`kvtop_cpu::bf16_paged_prefill`,
csrc/bf16_attention.cpp) against the reference run in fp32 over the same bf16 values (the oracle), its
refusals, and its place in the CPU backend (long bf16 chunks where there is no AMX: AMD Zen 4).

Tolerance: 1e-2 abs and rel. The scores are fp32 sums of exact bf16 products like the oracle's, the
probabilities are rounded to bf16 before P V (as torch's flash kernel does) and the output once:
measured worst ~8e-3 on values up to ~3, mean ~1e-3 (test_error_is_bf16_rounding pins the mean).
Where the build has no AVX512-BF16 (an AVX2 or plain AVX-512 machine) the op refuses with one clear
error and the backend keeps its other routes: test_placement checks that instead.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu, cpu_prefill
from engine.kernels import reference as ref
from tests.test_cpu_prefill import case as prefill_case
from tests.test_triton_kernels import cu_seqlens

BF16 = cpu.says("bf16_attention_supported")  # loads (and on a first run builds) the kernel extension
AMX = cpu.says("amx_supported")
TOL = {"atol": 1e-2, "rtol": 1e-2}
needs_bf16 = pytest.mark.skipif(not BF16, reason="no AVX512-BF16 in this build: test_placement checks the refusal")

# (cached prefix, new tokens) per sequence, one call each
LAYOUTS = {
    # every shape different: one-token chunks with and without a prefix, a prompt longer than a task
    # (64 queries), a prefix ending mid-block, odd key counts, hundreds of tokens
    "mixed": [(0, 1), (0, 45), (21, 30), (200, 90), (7, 1), (0, 300), (130, 1), (3, 17)],
    # the engine's long-prompt step: equal prompts with no cached prefix
    "packed": [(0, 256), (0, 256), (0, 256)],
    # a step of the mixed workload: chunks of prompts of many lengths, one continuing over its prefix
    "step": [(1500, 2), (0, 49), (0, 506), (0, 300), (0, 120), (0, 411), (0, 230), (0, 143), (250, 287)],
}


def case(seqs, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0):
    """tests/test_cpu_prefill.py's random paged case, in bf16: (args, cache)."""
    return prefill_case(seqs, "auto", heads, kv_heads, head_dim, block_size, torch.bfloat16, seed)


def oracle(args) -> torch.Tensor:
    """The reference over fp32 copies of the same bf16 queries and cache."""
    q, k, v, *rest = args
    return ref.paged_prefill_attention(q.float(), k.float(), v.float(), *rest)


def op(*args) -> torch.Tensor:
    return torch.ops.kvtop_cpu.bf16_paged_prefill(*args)


@needs_bf16
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])  # GQA 1, 3 (SmolLM2), 8
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_the_reference(layout, heads, kv_heads, head_dim):
    args, _ = case(LAYOUTS[layout], heads, kv_heads, head_dim, seed=heads + head_dim)
    out = op(*args)
    assert out.shape == args[0].shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    torch.testing.assert_close(out.float(), oracle(args), **TOL)


@needs_bf16
@pytest.mark.parametrize("head_dim,block_size", [(16, 16), (80, 16), (256, 16), (64, 8), (64, 32), (64, 5)])
def test_other_head_and_block_sizes(head_dim, block_size):
    """One vector of dims, a pass of 64 and a partial one, four passes; blocks smaller, larger and odd."""
    args, _ = case(LAYOUTS["mixed"], 6, 2, head_dim, block_size, seed=head_dim + block_size)
    torch.testing.assert_close(op(*args).float(), oracle(args), **TOL)


@needs_bf16
def test_error_is_bf16_rounding():
    """Mean error at the size of bf16 rounding (~4e-3 relative): a wrong mask, scale or pairing of
    keys moves it by far more (the check is shown to catch a scale off by 1 %)."""
    args, _ = case(LAYOUTS["step"], seed=4)
    want, got = oracle(args), op(*args).float()
    assert (got - want).abs().mean() < 2e-3 * want.abs().mean() + 1e-4
    off = oracle((*args[:6], args[6] * 1.01))
    assert (off - want).abs().mean() > 4 * (got - want).abs().mean()


@needs_bf16
def test_the_same_bits_alone_in_a_batch_and_on_any_number_of_threads():
    """A sequence's output does not depend on what else the step holds or how it is cut up."""
    seqs = LAYOUTS["step"]
    args, _ = case(seqs, seed=6)
    together = op(*args)
    q, k, v, tables, cu, lens, scale = args
    for s in (0, 2, 8):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        alone = op(q[rows], k, v, tables[s : s + 1], cu_seqlens([seqs[s][1]]), lens[s : s + 1], scale)
        assert torch.equal(alone, together[rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(op(*args), together)
    finally:
        torch.set_num_threads(threads)


@needs_bf16
def test_keys_past_the_context_are_never_read():
    """NaN in every slot no sequence owns (the blocks padding table entries point at included): a
    masked-out NaN would still poison a softmax or a P V product."""
    args, cache = case(LAYOUTS["mixed"], seed=31)
    rows = cache.k_cache.shape[0] * cache.block_size
    live = torch.zeros(rows, dtype=torch.bool)
    for s, n in enumerate(cache.seq_lens.tolist()):
        pos = torch.arange(n)
        live[cache.block_tables[s, pos // cache.block_size].long() * cache.block_size + pos % cache.block_size] = True
    want = oracle(args)
    for t in (cache.k_cache, cache.v_cache):
        t.view(rows, -1)[~live] = float("nan")
    out = op(*args)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), want, **TOL)


@needs_bf16
def test_large_scores_do_not_overflow_and_empty_chunks_are_fine():
    """Scores in the thousands (each row's maximum comes off first), and a sequence with no new
    tokens in the step (cu_seqlens repeats) between two that have some."""
    args, _ = case([(0, 40), (12, 0), (5, 20)], 2, 1, 64, seed=9)
    q, k, v, *rest = args
    big = (q * 30, k * 30, v, *rest[:3], 1.0)
    out = op(*big)
    assert out.shape == (60, 2, 64) and not out.isnan().any() and not out.isinf().any()
    torch.testing.assert_close(out.float(), oracle(big), **TOL)


@needs_bf16
def test_refuses_what_it_cannot_do():
    args, _ = case([(30, 8), (0, 8)], 4, 2, 64)
    q, k, v, tables, cu, lens, scale = args
    cases = {
        "bfloat16": (q.float(), k, v, tables, cu, lens, scale),
        "multiple of 16": case([(0, 8)], 4, 2, 40)[0],
        "multiple of KV heads": case([(0, 8)], 5, 2, 64)[0],
        "not a block of the cache": (q, k, v, tables.masked_fill(tables == tables[0, 0], k.shape[0]), cu, lens, scale),
        "past the block table": (q, k, v, tables[:, :1].contiguous(), cu, lens, scale),
        "more new tokens than keys": (q, k, v, tables, cu, lens - 4, scale),
        "must not decrease": (q, k, v, tables, torch.tensor([0, -1, 16], dtype=torch.int32), lens, scale),
        "number of query tokens": (q[:10], k, v, tables, cu, lens, scale),
        "scale must be positive": (q, k, v, tables, cu, lens, 0.0),
    }
    for message, bad in cases.items():
        with pytest.raises(RuntimeError, match=message):
            op(*bad)
    assert op(q[:0], k, v, tables[:1], torch.zeros(2, dtype=torch.int32), lens[:1] * 0, scale).shape == (0, 4, 64)


def test_placement():
    """The backend sends long bf16 chunks over a bf16 cache to the op where the build has AVX512-BF16
    and the CPU no AMX, and the result is then the op's, bit for bit; never fp32 or quantized caches.
    Elsewhere the op refuses in one line and the backend's other routes still match the reference."""
    args, _ = case(LAYOUTS["mixed"], seed=2)
    q, k = args[0], args[1]
    assert cpu_prefill.bf16_pairs_pay(q, k) == (BF16 and not AMX)
    assert not cpu_prefill.bf16_pairs_pay(q.float(), k.float())
    assert not cpu_prefill.bf16_pairs_pay(q, k.to(torch.int8))
    out = cpu.paged_prefill_attention(*args)
    torch.testing.assert_close(out.float(), oracle(args), atol=2e-2, rtol=2e-2)
    if BF16 and not AMX:
        assert torch.equal(out, op(*args))
    if not BF16:
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            op(*args)
