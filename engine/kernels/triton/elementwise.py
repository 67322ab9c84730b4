"""Triton element-wise ops of the decoder layer, one kernel each where torch launches several:
`rms_norm`, `fused_add_rms_norm` (the residual add and the norm after it), `rotary_embedding`
(q and k in place) and `silu_and_mul`. Signatures and rounding are the reference's
(`engine.kernels.reference`, the oracle): every value torch holds as a tensor of the model's dtype
is rounded to that dtype at the same point here, so RoPE and the residual add equal the reference
bit for bit in every dtype; RMSNorm (another order of the fp32 sum of squares) and SiLU (the GPU's
exp) differ by the last bits.

As torch ops on the GPU, an RMSNorm was six kernels (pow, mean, add, rsqrt, two multiplies; two
casts more in bf16), 61 times a SmolLM2 step, the residual add one more; RoPE ten and SiLU-and-mul
two, per layer. Here each is one launch, one pass over memory.

Rounding to bf16 is done by hand (`_round_to`): the interpreter's fp32 -> bf16 cast truncates,
the GPU's rounds to nearest even, and both must give the reference's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import reference
from engine.kernels.triton.common import _interpreting

# --------------------------------------------------------------------------------------------
# device helpers; no kernel specializes on its token count (a batch of 1, or of 16, would each be
# a compile of its own)


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded to `dtype` (nearest, ties to even) and kept as fp32, so that arithmetic
    after it starts from the value torch would hold, and the final cast to `dtype` is exact."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded)  # a NaN's payload must not carry into the exponent
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_xt, stride_xh, stride_rt, stride_rh, num_rows, heads, n, eps,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, RESIDUAL: tl.constexpr,
):  # fmt: skip
    """ROWS rows of `n` values; row = (token, head) of a `[tokens, heads, n]` view (heads 1 for
    `[tokens, n]`). RESIDUAL: residual += x first (rounded to the residual's dtype, stored back),
    and the norm runs over the new residual."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    token = (rows // heads).to(tl.int64)
    head = rows % heads
    offs = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (offs < n)[None, :]
    x_ptrs = x_ptr + (token * stride_xt + head * stride_xh)[:, None] + offs[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        dtype = residual_ptr.dtype.element_ty
        r_ptrs = residual_ptr + (token * stride_rt + head * stride_rh)[:, None] + offs[None, :]
        x = _round_to(x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(r_ptrs, x.to(dtype), mask=mask)
    else:
        dtype = x_ptr.dtype.element_ty
    mean_square = tl.sum(x * x, axis=1) / n
    rstd = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), tl.math.sqrt_rn(mean_square + eps))
    # reference: normalized in fp32, rounded to the input's dtype, times the weight
    y = _round_to(x * rstd[:, None], dtype)
    w = tl.load(weight_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * n + offs[None, :]
    tl.store(out_ptrs, _round_to(y * w[None, :], out_dtype).to(out_dtype), mask=mask)


@triton.jit
def _rotate_rows(
    ptr, first, tokens, stride_t, stride_h, heads, cos_ptr, sin_ptr, stride_ct, stride_st, half,
    TOKENS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Neox RoPE in place of every head of tokens [first, first + TOKENS), a row per (token, head):
    each product and the sum rounded to the dtype, as the reference's `q * cos + rotate_half(q) *
    sin` rounds them."""
    dtype = ptr.dtype.element_ty
    j = tl.arange(0, BLOCK_R)
    token = first + j // heads
    valid = (j < TOKENS * heads) & (token < tokens)
    token = token.to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask = valid[:, None] & (offs < half)[None, :]
    cos1_ptrs = cos_ptr + (token * stride_ct)[:, None] + offs[None, :]
    sin1_ptrs = sin_ptr + (token * stride_st)[:, None] + offs[None, :]
    cos1 = tl.load(cos1_ptrs, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos1_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin1_ptrs, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin1_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    first_half = ptr + (token * stride_t + (j % heads) * stride_h)[:, None] + offs[None, :]
    x1 = tl.load(first_half, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first_half + half, mask=mask, other=0.0).to(tl.float32)
    out1 = _round_to(x1 * cos1, dtype) - _round_to(x2 * sin1, dtype)
    out2 = _round_to(x2 * cos2, dtype) + _round_to(x1 * sin2, dtype)
    tl.store(first_half, _round_to(out1, dtype).to(dtype), mask=mask)
    tl.store(first_half + half, _round_to(out2, dtype).to(dtype), mask=mask)


@triton.jit(do_not_specialize=["tokens"])
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, tokens, q_heads, k_heads, half,
    TOKENS: tl.constexpr, BLOCK_QR: tl.constexpr, BLOCK_KR: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """TOKENS tokens: every q head, then every k head."""
    first = tl.program_id(0) * TOKENS
    _rotate_rows(q_ptr, first, tokens, stride_qt, stride_qh, q_heads, cos_ptr, sin_ptr, stride_ct, stride_st, half,
                 TOKENS, BLOCK_QR, BLOCK_HALF)  # fmt: skip
    _rotate_rows(k_ptr, first, tokens, stride_kt, stride_kh, k_heads, cos_ptr, sin_ptr, stride_ct, stride_st, half,
                 TOKENS, BLOCK_KR, BLOCK_HALF)  # fmt: skip


@triton.jit(do_not_specialize=["tokens"])
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_t, stride_ot, tokens, inter, TOKENS: tl.constexpr, BLOCK: tl.constexpr
):
    """`silu(gate) * up` for TOKENS tokens' columns [BLOCK * j, BLOCK * (j + 1)): SiLU as torch
    computes it (`g / (1 + exp(-g))` in fp32), rounded to the dtype, then the product rounded."""
    token = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (token < tokens)[:, None] & (offs < inter)[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = gate_up_ptr + (token * stride_t)[:, None] + offs[None, :]
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + inter, mask=mask, other=0.0).to(tl.float32)
    silu = _round_to(tl.math.div_rn(g, 1.0 + tl.exp(-g)), dtype)
    out = out_ptr + (token * stride_ot)[:, None] + offs[None, :]
    tl.store(out, _round_to(silu * u, dtype).to(dtype), mask=mask)


# --------------------------------------------------------------------------------------------
# host side


def _warps(elements: int) -> int:
    """One warp per 256 elements a program holds, 1 to 8."""
    return max(1, min(8, elements // 256))


def _rows_per_program(rows: int, row_elements: int, gpu_elements: int) -> int:
    """How many rows one program takes, a power of two. On a GPU, a fixed count for `gpu_elements`
    elements (each count is another compile; rows past the end are masked off). Under the
    interpreter, which runs the programs one by one in Python, as many rows as there are, up to
    64K elements: a launch is then one program, and an engine test's step costs what torch's did."""
    budget = 1 << 16 if _interpreting() else gpu_elements
    fits = 1 << (max(1, budget // row_elements).bit_length() - 1)
    return min(fits, triton.next_power_of_2(rows)) if _interpreting() else fits


def _token_head_strides(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(tokens, heads, token stride, head stride) of a `[n]`, `[tokens, n]` or `[tokens, heads, n]`
    tensor whose last dim is contiguous; None for anything else."""
    if t.stride(-1) != 1 or not 1 <= t.dim() <= 3:
        return None
    if t.dim() == 1:
        return 1, 1, 0, 0
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x if residual is None else residual
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, normed.dtype), device=x.device)
    if out.numel() == 0:
        if residual is not None:
            residual.add_(x)
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = _token_head_strides(x)
    res_rows = rows if residual is None else _token_head_strides(residual)
    if rows is None or res_rows is None or weight.stride(0) != 1:  # no shape the engine makes
        if residual is None:
            return reference.rms_norm(x, weight, eps)
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    tokens, heads, stride_xt, stride_xh = rows
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    # a GPU program: one row of a model's hidden size, or 16-32 heads of a per-head norm
    per_program = _rows_per_program(tokens * heads, block, gpu_elements=2048)
    _rms_norm_kernel[(triton.cdiv(tokens * heads, per_program),)](
        x, x if residual is None else residual, weight, out,
        stride_xt, stride_xh, res_rows[2], res_rows[3], tokens * heads, heads, n, float(eps),
        BLOCK=block, ROWS=per_program, RESIDUAL=residual is not None, num_warps=_warps(per_program * block),
    )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `[tokens, n]` or `[tokens, heads, n]` (Qwen3's per-head q/k
    norm, on the strided views of the qkv projection); a new contiguous tensor."""
    return _rms_norm(x, None, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`residual += x` in place (the residual stream), then `rms_norm(residual)`: one pass."""
    return _rms_norm(x, residual, weight, eps)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE, neox style, on q `[tokens, heads, dim]` and k `[tokens, kv_heads, dim]` with each
    token's cos/sin rows `[tokens, dim]`, in place (one launch for both); returns q and k."""
    tokens, q_heads, dim = q.shape
    if tokens == 0:
        return q, k
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    half, k_heads = dim // 2, k.shape[1]
    per_program = _rows_per_program(tokens, q_heads * dim, gpu_elements=0)  # a GPU program: one token
    block_qr, block_kr = triton.next_power_of_2(per_program * q_heads), triton.next_power_of_2(per_program * k_heads)
    block_half = triton.next_power_of_2(half)
    # no fma: each product rounds on its own, as torch's separate multiply and add kernels do
    _rotary_kernel[(triton.cdiv(tokens, per_program),)](
        q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), tokens, q_heads, k_heads, half,
        TOKENS=per_program, BLOCK_QR=block_qr, BLOCK_KR=block_kr, BLOCK_HALF=block_half,
        num_warps=_warps(block_qr * block_half), enable_fp_fusion=False,
    )  # fmt: skip
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of the fused projection `[tokens, 2 * intermediate]` (gate first)."""
    tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    block = min(triton.next_power_of_2(inter), 2048)
    per_program = _rows_per_program(tokens, block, gpu_elements=0)  # a GPU program: one token's block
    _silu_and_mul_kernel[(triton.cdiv(tokens, per_program), triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), tokens, inter,
        TOKENS=per_program, BLOCK=block, num_warps=_warps(per_program * block),
    )  # fmt: skip
    return out
