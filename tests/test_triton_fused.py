"""The Triton element-wise kernels (`engine/kernels/triton/elementwise.py`) against the torch
reference (`engine.kernels.reference`, the oracle): RMSNorm, RMSNorm with the residual add,
RoPE in place, SiLU-and-mul.

Without a GPU they run under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is
imported); with one, compiled, against the reference on the same GPU (`benchmarks/gpu_check.sh`).
Shapes are drawn at random per case, hidden sizes odd and even; float32, bfloat16 and float16.

What must hold, stated once:
- The residual add and RoPE round where torch rounds: bit for bit the reference, every dtype.
- RMSNorm and SiLU-and-mul, float32: within 1e-5 relative (+1e-6 absolute) — the sum of squares
  runs in another order, and the GPU's exp is not torch's.
- RMSNorm and SiLU-and-mul, bfloat16/float16: every element within 2 ulps of the reference and
  at least 99 % of them bit-equal. Each rounds twice (the normalized value, or SiLU, then its
  product with the weight, or up): a near-tie rounded the other way is one ulp of the first
  value, which the product can make two of its own (torch's float16 SiLU on the CPU is such a
  case: 9 elements of 58,368 two ulps off).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from engine.kernels import ELEMENTWISE_ENV, get_backend
from engine.kernels import reference as ref
from engine.kernels.triton import elementwise as ew

# the row of extremes in the SiLU test: the interpreter's numpy exp says so when exp(100) overflows
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
HIDDEN = [7, 67, 576, 1000, 4099]  # odd sizes, SmolLM2's, one past a power of two


def randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def tokens_for(seed: int) -> int:
    return int(torch.randint(1, 41, (1,), generator=torch.Generator().manual_seed(seed)))


def assert_near(got: torch.Tensor, want: torch.Tensor, max_ulps: int) -> None:
    """float32 within FP32_TOL; 16-bit types within `max_ulps` of `want` and >= 99 % bit-equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL)
        return
    g, w = got.float(), want.float()
    tiny = torch.finfo(got.dtype).tiny
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp(min=tiny))) - MANTISSA_BITS[got.dtype])
    ulps = ((g - w).abs() / ulp).max().item()
    assert ulps <= max_ulps, f"{ulps} ulps off"
    assert (got == want).float().mean().item() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm_matches_reference(hidden, dtype):
    tokens = tokens_for(hidden)
    x = randn(tokens, hidden, seed=hidden, dtype=dtype, scale=3.0)
    weight = randn(hidden, seed=hidden + 1, dtype=dtype, scale=0.3) + 1
    assert_near(ew.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5), max_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fused_add_rms_norm_matches_reference(hidden, dtype):
    tokens = tokens_for(hidden + 2)
    x = randn(tokens, hidden, seed=hidden, dtype=dtype)
    residual = randn(tokens, hidden, seed=hidden + 2, dtype=dtype, scale=4.0)
    weight = randn(hidden, seed=hidden + 1, dtype=dtype, scale=0.3) + 1
    ours, theirs = residual.clone(), residual.clone()
    out = ew.fused_add_rms_norm(x, ours, weight, 1e-6)
    want = ref.fused_add_rms_norm(x, theirs, weight, 1e-6)
    assert torch.equal(ours, theirs)  # the residual stream, added in place: bit for bit
    assert_near(out, want, max_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(4, 32), (9, 64), (3, 30)])
def test_rms_norm_per_head_on_the_qkv_projection(heads, head_dim, dtype):
    """Qwen3's q/k norm: `[tokens, heads, head_dim]` views of the fused qkv output (not contiguous)."""
    tokens = tokens_for(heads)
    qkv = randn(tokens, (heads + 2) * head_dim, seed=heads, dtype=dtype, scale=2.0)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = randn(head_dim, seed=head_dim, dtype=dtype, scale=0.3) + 1
    out = ew.rms_norm(q, weight, 1e-6)
    assert out.is_contiguous()
    assert_near(out, ref.rms_norm(q, weight, 1e-6), max_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (9, 3, 64), (5, 1, 30), (32, 8, 128)])
def test_rotary_embedding_matches_reference_in_place(heads, kv_heads, head_dim, dtype):
    tokens = tokens_for(heads * head_dim)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided, as the model's
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cos = randn(tokens, head_dim, seed=1, dtype=dtype)
    sin = randn(tokens, head_dim, seed=2, dtype=dtype)
    want_q, want_k = ref.rotary_embedding(q.clone(), k.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    got_q, got_k = ew.rotary_embedding(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # V, beside them, untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [5, 67, 1536, 3001])
def test_silu_and_mul_matches_reference(intermediate, dtype):
    tokens = tokens_for(intermediate)
    gate_up = randn(tokens, 2 * intermediate, seed=intermediate, dtype=dtype, scale=3.0)
    # a row of extremes: exp overflowing, zeros, a NaN carried through
    extremes = torch.tensor([-100.0, 100.0, 0.0, -0.0, float("nan")], dtype=dtype, device=DEVICE)
    gate_up[0, : min(5, intermediate)] = extremes[: min(5, intermediate)]
    got, want = ew.silu_and_mul(gate_up), ref.silu_and_mul(gate_up)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    got, want = torch.where(finite, got, 0), torch.where(finite, want, 0)
    assert_near(got, want, max_ulps=2)


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64, device=DEVICE)
    assert ew.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert ew.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    q, k = torch.empty(0, 4, 64, device=DEVICE), torch.empty(0, 2, 64, device=DEVICE)
    assert (
        ew.rotary_embedding(q, k, torch.empty(0, 64, device=DEVICE), torch.empty(0, 64, device=DEVICE))[0].numel() == 0
    )


def test_the_triton_backend_serves_them_unless_turned_off(monkeypatch):
    ops = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")
    backend = get_backend("triton", str(DEVICE))
    assert all(getattr(backend, op) is getattr(ew, op) for op in ops)
    monkeypatch.setenv(ELEMENTWISE_ENV, "0")
    torch_ops = get_backend("triton", str(DEVICE))
    assert all(getattr(torch_ops, op) is getattr(ref, op) for op in ops)
    assert torch_ops.paged_decode_attention is backend.paged_decode_attention  # attention stays Triton
    assert get_backend("triton", str(DEVICE)) is torch_ops  # one per process: the model's state keys on it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpus_split_into_programs_gives_the_same_results(dtype, monkeypatch):
    """Under the interpreter a launch is one program over every row; a GPU takes one row (or token)
    per program. The GPU's split, run here too, against the reference."""
    monkeypatch.setattr(ew, "_interpreting", lambda: False)
    tokens, hidden, heads, kv_heads, head_dim = 13, 576, 9, 3, 64
    x, residual = randn(tokens, hidden, seed=1, dtype=dtype), randn(tokens, hidden, seed=2, dtype=dtype)
    weight = randn(hidden, seed=3, dtype=dtype, scale=0.3) + 1
    ours, theirs = residual.clone(), residual.clone()
    assert_near(ew.fused_add_rms_norm(x, ours, weight, 1e-5), ref.fused_add_rms_norm(x, theirs, weight, 1e-5), 2)
    assert torch.equal(ours, theirs)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=4, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    head_weight = randn(head_dim, seed=5, dtype=dtype, scale=0.3) + 1
    assert_near(ew.rms_norm(q, head_weight, 1e-6), ref.rms_norm(q, head_weight, 1e-6), 2)
    cos, sin = randn(tokens, head_dim, seed=6, dtype=dtype), randn(tokens, head_dim, seed=7, dtype=dtype)
    want_q, want_k = ref.rotary_embedding(q.clone(), k.clone(), cos, sin)
    got_q, got_k = ew.rotary_embedding(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    gate_up = randn(tokens, 2 * 3001, seed=8, dtype=dtype, scale=3.0)
    assert_near(ew.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), 2)
