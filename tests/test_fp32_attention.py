"""The fp32 prefill attention on AVX-512 (`kvtop_cpu::fp32_causal_attention`, csrc/fp32_attention.cpp)
against SDPA in fp64 over the same inputs (the oracle), its refusals, and its place in `cpu_prefill`.

Tolerance: 2e-5 abs and rel: the same fp32 arithmetic as SDPA's in another order of sums (measured
worst ~5e-7 on values of order 1). On a build without AVX-512 the op refuses with one clear error and
`cpu_prefill` keeps SDPA: the tests check that instead.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu, cpu_prefill
from engine.kernels import reference as ref
from tests.helpers import CAUSAL_SHAPES, causal_inputs, causal_oracle
from tests.test_triton_kernels import Paged, cu_seqlens, strided_q

AVX512 = cpu.says("fp32_attention_supported")  # loads (and on a first run builds) the kernel extension

TOL = {"atol": 2e-5, "rtol": 2e-5}


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA in fp64."""
    return causal_oracle(q, k, v, scale, torch.float64)


inputs = causal_inputs


needs_avx512 = pytest.mark.skipif(not AVX512, reason="no AVX-512 in this build: test_placement checks SDPA serves")

SHAPES = CAUSAL_SHAPES


@needs_avx512
@pytest.mark.parametrize("seqs,n,length", SHAPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])  # GQA 1, 3 (SmolLM2), 8
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_sdpa(seqs, n, length, heads, kv_heads, head_dim):
    q, k, v = inputs(seqs, n, length, heads, kv_heads, head_dim, seed=n + heads + head_dim)
    scale = head_dim**-0.5
    out = torch.ops.kvtop_cpu.fp32_causal_attention(q, k, v, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, oracle(q, k, v, scale), **TOL)


@needs_avx512
@pytest.mark.parametrize("head_dim", [16, 80, 256])  # one vector, a pass of 64 dims and a partial one, four
def test_other_head_sizes(head_dim):
    q, k, v = inputs(2, 70, 90, 4, 2, head_dim, seed=head_dim)
    torch.testing.assert_close(torch.ops.kvtop_cpu.fp32_causal_attention(q, k, v, 0.1), oracle(q, k, v, 0.1), **TOL)


@needs_avx512
def test_long_prompt_strided_views_and_keys_past_the_context_never_read():
    """A 1,024-token prompt, queries and keys that are views into packed qkv rows as the model hands
    them over (the heads' dim contiguous, nothing else), and NaN in a cache past the keys passed."""
    heads, kv_heads, d, length = 9, 3, 64, 1024
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(length + 8, (heads + 2 * kv_heads) * d, generator=g)
    qkv[length:] = float("nan")
    q = qkv[:length, : heads * d].view(1, length, heads, d)
    k = qkv[:length, heads * d : (heads + kv_heads) * d].view(1, length, kv_heads, d)
    v = qkv[:length, (heads + kv_heads) * d :].view(1, length, kv_heads, d)
    assert not q.is_contiguous()
    out = torch.ops.kvtop_cpu.fp32_causal_attention(q, k, v, d**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, oracle(q, k, v, d**-0.5), **TOL)


@needs_avx512
def test_large_scores_do_not_overflow():
    """Scores in the thousands (a large scale): the softmax subtracts each row's maximum first."""
    q, k, v = inputs(1, 40, 40, 2, 1, 64, seed=9)
    out = torch.ops.kvtop_cpu.fp32_causal_attention(q * 30, k * 30, v, 1.0)
    assert not out.isnan().any() and not out.isinf().any()
    torch.testing.assert_close(out, oracle(q * 30, k * 30, v, 1.0), **TOL)


@needs_avx512
def test_refuses_what_it_cannot_do():
    q, k, v = inputs(1, 8, 8, 4, 2, 64)
    op = torch.ops.kvtop_cpu.fp32_causal_attention
    with pytest.raises(RuntimeError, match="float32"):
        op(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.1)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(*inputs(1, 8, 8, 4, 2, 40), 0.1)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        op(*inputs(1, 8, 8, 5, 2, 64), 0.1)
    with pytest.raises(RuntimeError, match="more queries than keys"):
        op(q, k[:, :4], v[:, :4], 0.1)
    with pytest.raises(RuntimeError, match="scale must be positive"):
        op(q, k, v, 0.0)
    assert op(q[:, :0], k, v, 0.1).shape == (1, 0, 4, 64)


def test_placement():
    """`cpu_prefill` sends fp32 groups to the op where the build has AVX-512 (head sizes it takes),
    never bf16 ones, and keeps SDPA elsewhere (where the op would refuse)."""
    assert cpu.load()
    q, k, _ = inputs(1, 4, 4, 2, 1, 64)
    assert cpu_prefill._fp32_attention(q, k) == AVX512
    assert not cpu_prefill._fp32_attention(q.bfloat16(), k.bfloat16())
    assert not cpu_prefill._fp32_attention(*inputs(1, 4, 4, 2, 1, 40)[:2])
    if not AVX512:
        with pytest.raises(RuntimeError, match="AVX-512"):
            torch.ops.kvtop_cpu.fp32_causal_attention(*inputs(1, 4, 4, 2, 1, 64), 0.1)


AMX = cpu.says("amx_supported")


def test_bf16_without_amx_runs_on_upcast_copies_and_matches_the_reference():
    """On AVX-512 without AMX (AMD Zen 4) the backend's bf16 prefill takes this kernel on fp32 copies
    of q, K and V (7.4 ms a layer against SDPA's 12.5 in bf16 there); with AMX the tile kernel keeps
    it, and without AVX-512 SDPA does. Whichever runs here, long chunks over a cached prefix give the
    reference's output within bf16 rounding."""
    q, _, _ = inputs(1, 4, 4, 2, 1, 64)
    assert cpu_prefill._upcast_attention(q.bfloat16()) == (AVX512 and not AMX)
    assert not cpu_prefill._upcast_attention(q)  # fp32 has its own route
    assert not cpu_prefill._upcast_attention(inputs(1, 4, 4, 2, 1, 40)[0].bfloat16())

    seqs = [(0, 300), (37, 100), (250, 64)]  # (cached prefix, new tokens): all past the short-chunk rule
    lens = [p + n for p, n in seqs]
    cache = Paged(lens, 16, 3, 64, dtype=torch.bfloat16, seed=8)
    q = strided_q(sum(n for _, n in seqs), 9, 64, seed=9, dtype=torch.bfloat16)
    args = (q, *cache.cache_args(), cache.block_tables, cu_seqlens([n for _, n in seqs]), cache.seq_lens, 0.125)
    out = cpu.paged_prefill_attention(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.paged_prefill_attention(*args).float(), atol=2e-2, rtol=2e-2)
