"""The bf16 prefill attention on AMX tiles (`kvtop_cpu::amx_causal_attention`, csrc/amx_attention.cpp)
against SDPA in fp32 over the same bf16 inputs (the oracle), and its refusals.

Tolerance: 2e-2 abs and rel, as the bf16 prefill tests of tests/test_cpu_prefill.py (the output is
rounded to bf16 once, the probabilities to bf16 before the second product, as torch's flash kernel
does; measured worst about 1e-2 on values of order 1). On a CPU without AMX the op refuses with one
clear error and `cpu_prefill` keeps SDPA: the tests check that instead.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu
from engine.kernels.cpu_prefill import _amx
from engine.model.packed_linear import amx_available
from tests.helpers import CAUSAL_SHAPES, causal_inputs, causal_oracle

AMX = amx_available()  # loads (and on a first run builds) the kernel extension

TOL = {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu.load(), "the C++ CPU kernels did not build here"


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 SDPA over the bf16 inputs."""
    return causal_oracle(q, k, v, scale)


def inputs(seqs, n, length, heads, kv_heads, head_dim, seed=0):
    return causal_inputs(seqs, n, length, heads, kv_heads, head_dim, seed, torch.bfloat16)


needs_amx = pytest.mark.skipif(not AMX, reason="no AMX here: test_without_amx_prefill_keeps_sdpa checks that")

SHAPES = CAUSAL_SHAPES


@needs_amx
@pytest.mark.parametrize("seqs,n,length", SHAPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])  # GQA 1, 3 (SmolLM2), 8
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_fp32_sdpa(seqs, n, length, heads, kv_heads, head_dim):
    q, k, v = inputs(seqs, n, length, heads, kv_heads, head_dim, seed=n + heads + head_dim)
    scale = head_dim**-0.5
    out = torch.ops.kvtop_cpu.amx_causal_attention(q, k, v, scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), oracle(q, k, v, scale), **TOL)


@needs_amx
@pytest.mark.parametrize("head_dim", [32, 96, 256])  # one pass of the output's tiles, a partial one, four
def test_other_head_sizes(head_dim):
    q, k, v = inputs(2, 70, 90, 4, 2, head_dim, seed=head_dim)
    scale = 0.1
    torch.testing.assert_close(
        torch.ops.kvtop_cpu.amx_causal_attention(q, k, v, scale).float(), oracle(q, k, v, scale), **TOL
    )


@needs_amx
def test_long_prompt_and_strided_views():
    """A 2,048-token prompt (tasks of different weights on two threads), queries and keys that are
    views into packed qkv rows as the model hands them over (the heads' dim contiguous, nothing else)."""
    heads, kv_heads, d, length = 9, 3, 64, 2048
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(length, (heads + 2 * kv_heads) * d, generator=g).bfloat16()
    q = qkv[:, : heads * d].view(1, length, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(1, length, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(1, length, kv_heads, d)
    assert not q.is_contiguous()
    out = torch.ops.kvtop_cpu.amx_causal_attention(q, k, v, d**-0.5)
    torch.testing.assert_close(out.float(), oracle(q, k, v, d**-0.5), **TOL)


@needs_amx
def test_large_scores_do_not_overflow():
    """Scores in the thousands (a large scale): the softmax subtracts each row's maximum first."""
    q, k, v = inputs(1, 40, 40, 2, 1, 64, seed=9)
    out = torch.ops.kvtop_cpu.amx_causal_attention(q * 30, k * 30, v, 1.0)
    assert not out.isnan().any() and not out.isinf().any()
    torch.testing.assert_close(out.float(), oracle(q * 30, k * 30, v, 1.0), **TOL)


@needs_amx
def test_refuses_what_it_cannot_do():
    q, k, v = inputs(1, 8, 8, 4, 2, 64)
    op = torch.ops.kvtop_cpu.amx_causal_attention
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(q.float(), k.float(), v.float(), 0.1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(*inputs(1, 8, 8, 4, 2, 48), 0.1)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        op(*inputs(1, 8, 8, 5, 2, 64), 0.1)
    with pytest.raises(RuntimeError, match="more queries than keys"):
        op(q, k[:, :4], v[:, :4], 0.1)
    with pytest.raises(RuntimeError, match="scale must be positive"):
        op(q, k, v, 0.0)  # the softmax subtracts max(scores) * scale, the largest only for a positive scale
    assert op(q[:, :0], k, v, 0.1).shape == (1, 0, 4, 64)


def test_without_amx_prefill_keeps_sdpa():
    """Where the CPU has no AMX, `cpu_prefill` never calls the op (it would refuse) and bf16 prefill
    goes through SDPA; where it has, bf16 takes the op (fp32 has its own: test_fp32_attention.py)."""
    from engine.kernels import cpu_prefill

    q, k, _ = inputs(1, 4, 4, 2, 1, 64)
    assert _amx() == AMX and cpu_prefill._amx_attention(q, k) == AMX
    assert not cpu_prefill._amx_attention(q.float(), k.float())
    assert not cpu_prefill._amx_attention(*inputs(1, 4, 4, 2, 1, 48)[:2])  # a head size it does not take
    if not AMX:
        with pytest.raises(RuntimeError, match="AMX"):
            torch.ops.kvtop_cpu.amx_causal_attention(*inputs(1, 4, 4, 2, 1, 64), 0.1)
