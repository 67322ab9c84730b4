"""What the Triton kernels share: the quantization modes (named the same on the host and in the
kernels), the tile helpers every attention kernel calls, and the host-side checks and choices."""

from __future__ import annotations

import enum
import functools

import torch
import triton
import triton.language as tl


class Quant(enum.IntEnum):
    """How a KV cache is quantized; the host passes it to the kernels as their `QUANT` constexpr."""

    NONE = 0
    INT8 = 1  # int8 values, one float32 scale per (token, KV head)
    FP8 = 2  # fp8_e4m3 values, one float32 scale per tensor


# the same modes as the kernels read them (a jit function may only read constexpr globals)
QUANT_NONE = tl.constexpr(Quant.NONE.value)
QUANT_INT8 = tl.constexpr(Quant.INT8.value)
QUANT_FP8 = tl.constexpr(Quant.FP8.value)

# the interpreter has no SMs; a small number keeps split counts (and test times) small
_INTERPRETER_SMS = 4


# --------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _round_half_even(x):
    """torch.round: nearest integer, ties to even (exact for any fp32)."""
    r = tl.floor(x)
    diff = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((diff > 0.5) | ((diff == 0.5) & odd), r + 1.0, r)


@triton.jit
def _fp8_e4m3_bits(y):
    """Bits of `y.to(float8_e4m3fn)` (round to nearest even) for fp32 `y` in [-448, 448].

    Computed by hand rather than by a cast so that the interpreter (whose fp8 cast does not round
    to nearest) and the GPU write the same bytes as torch."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    # binade of |y|; everything below the smallest normal (2^-6) shares the subnormal quantum 2^-9
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    inv_quantum = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e), exact
    m = _round_half_even(a * inv_quantum)  # 0..16; 16 carries into the next binade, as it should
    code = (e + 6) * 8 + m.to(tl.int32)
    return (code | sign).to(tl.uint8)


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    n0,
    kv_end,
    q_pos,
    bt_row_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    kv_head,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ksb,
    stride_kst,
    stride_ksh,
    stride_vsb,
    stride_vst,
    stride_vsh,
    qk_scale,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys [n0, n0 + BLOCK_N) of one sequence and KV head.

    MASK: keys at or past `kv_end` are not loaded and get no weight. CAUSAL: row i sees keys at
    positions <= q_pos[i]. Scores are in the log2 domain (`qk_scale` includes log2(e))."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    valid = offs_n < kv_end
    if MASK:
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=valid, other=0)
    else:
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE)
    page = page.to(tl.int64)
    within = offs_n % PAGE_SIZE
    k_rows = page * stride_kb + within * stride_kt + kv_head * stride_kh
    v_rows = page * stride_vb + within * stride_vt + kv_head * stride_vh
    if MASK:
        kv_mask = valid[:, None]
        if BLOCK_D != HEAD_DIM:
            kv_mask = kv_mask & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        d_mask = offs_d[None, :] < HEAD_DIM
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=d_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=d_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :])
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :])

    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    if QUANT == QUANT_INT8:
        scale_rows = page * stride_ksb + within * stride_kst + kv_head * stride_ksh
        if MASK:
            k_sc = tl.load(k_scale_ptr + scale_rows, mask=valid, other=0.0)
        else:
            k_sc = tl.load(k_scale_ptr + scale_rows)
        s = s * (k_sc.to(tl.float32) * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if MASK:
        s = tl.where(valid[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if QUANT == QUANT_INT8:
        scale_rows = page * stride_vsb + within * stride_vst + kv_head * stride_vsh
        if MASK:
            v_sc = tl.load(v_scale_ptr + scale_rows, mask=valid, other=0.0)
        else:
            v_sc = tl.load(v_scale_ptr + scale_rows)
        p = p * v_sc.to(tl.float32)[None, :]
    acc += tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# --------------------------------------------------------------------------------------------
# host side


def _interpreting() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_round_half_even, triton.runtime.JITFunction)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and not _interpreting():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


def _quant_mode(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> int:
    if k_cache.dtype == torch.int8:
        mode = Quant.INT8
    elif k_cache.dtype == torch.float8_e4m3fn:
        mode = Quant.FP8
    else:
        return Quant.NONE
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_cache.dtype} KV cache needs k_scale and v_scale tensors")
    return mode


def _scale_strides(scale: torch.Tensor | None, mode: int) -> tuple[int, int, int]:
    """Strides of an int8 cache's per-token scales `[num_blocks, block_size, kv_heads]`."""
    if mode != Quant.INT8:
        return 0, 0, 0
    return scale.stride(0), scale.stride(1), scale.stride(2)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim] of one shape and dtype, "
            f"got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")


def _compute(q_dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the tiles are multiplied in fp32, and the dot precision. The interpreter has no bf16
    arithmetic; fp32 queries keep fp32 accuracy: exact products in the interpreter, three-pass
    tf32 ("tf32x3", on the tensor cores, where plain fp32 FMA tiles spill registers) on the GPU.
    bf16/fp16 queries multiply in their own dtype, accumulating in fp32."""
    if _interpreting():
        return True, "ieee"
    if q_dtype == torch.float32:
        return True, "tf32x3"
    return False, "tf32"
