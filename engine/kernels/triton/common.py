"""What the Triton kernels share: the quantization modes (named the same on the host and in the
kernels), the tile helpers every attention kernel calls, and the host-side checks and choices."""

from __future__ import annotations

import enum
import functools
from typing import NamedTuple

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
def _rows(page, within, kv_head, strides):
    """Element offsets of (page, slot within it, KV head) in a cache or scale tensor of these
    (block, token, head) strides."""
    return page * strides[0] + within * strides[1] + kv_head * strides[2]


@triton.jit
def _load_tile(ptr, rows, offs_d, valid, MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One K or V tile `[len(rows), BLOCK_D]`. MASK: rows not `valid` read 0; columns past
    head_dim read 0 (BLOCK_D is head_dim rounded up to a power of two)."""
    if MASK:
        mask = valid[:, None]
        if BLOCK_D != HEAD_DIM:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        tile = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        tile = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(ptr + rows[:, None] + offs_d[None, :])
    return tile


@triton.jit
def _load_scales(ptr, rows, valid, MASK: tl.constexpr):
    """An int8 cache's per-token scales for the tile's rows, as fp32 (0 where not `valid`)."""
    if MASK:
        scales = tl.load(ptr + rows, mask=valid, other=0.0)
    else:
        scales = tl.load(ptr + rows)
    return scales.to(tl.float32)


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, n0, kv_end, q_pos, bt_row_ptr, pages, strides, kv_head, qk_scale, offs_d,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, QUANT: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
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
    k = _load_tile(pages.k, _rows(page, within, kv_head, strides.k), offs_d, valid, MASK, HEAD_DIM, BLOCK_D)
    v = _load_tile(pages.v, _rows(page, within, kv_head, strides.v), offs_d, valid, MASK, HEAD_DIM, BLOCK_D)

    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    if QUANT == QUANT_INT8:
        k_sc = _load_scales(pages.k_scale, _rows(page, within, kv_head, strides.k_scale), valid, MASK)
        s = s * (k_sc * qk_scale)[None, :]
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
        p = p * _load_scales(pages.v_scale, _rows(page, within, kv_head, strides.v_scale), valid, MASK)[None, :]
    acc += tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend(
    q, q_pos, start, full_end, end, sm_scale, bt_row_ptr, pages, strides, kv_head, offs_d,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, QUANT: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax of the query rows `q` over one sequence's keys [start, end) for one KV head:
    whole tiles up to `full_end` unmasked, the rest masked (and causal by `q_pos` when CAUSAL).
    Returns the unnormalized output, the row sums and the row maxima (log2 domain)."""
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
    if QUANT == QUANT_FP8:
        qk_scale = qk_scale * tl.load(pages.k_scale).to(tl.float32)
    acc = tl.zeros([q.shape[0], BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([q.shape[0]], dtype=tl.float32)
    m_i = tl.full([q.shape[0]], float("-inf"), dtype=tl.float32)
    for n0 in range(start, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, n0, end, q_pos, bt_row_ptr, pages, strides, kv_head, qk_scale, offs_d,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, QUANT, False, False, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, n0, end, q_pos, bt_row_ptr, pages, strides, kv_head, qk_scale, offs_d,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, QUANT, True, CAUSAL, DOT_PRECISION,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _normalize(acc, l_i, v_scale_ptr, QUANT: tl.constexpr):
    """The attention output from `_attend`'s sums; rows that saw no key (l_i == 0) are zeros."""
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if QUANT == QUANT_FP8:
        out = out * tl.load(v_scale_ptr).to(tl.float32)
    return out


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


class KVPages(NamedTuple):
    """One layer's paged cache as the kernels take it: K and V `[num_blocks, block_size, kv_heads,
    head_dim]` and their scales (int8: `[num_blocks, block_size, kv_heads]`; fp8: one element
    each; unquantized: stand-ins the kernels never read)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor


class KVStrides(NamedTuple):
    """The (block, token, head) strides of each KVPages tensor; head_dim is contiguous."""

    k: tuple[int, int, int]
    v: tuple[int, int, int]
    k_scale: tuple[int, int, int]
    v_scale: tuple[int, int, int]


def paged_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    stand_in: torch.Tensor,
) -> tuple[Quant, KVPages, KVStrides]:
    """A checked cache as a kernel takes it: its quantization mode, its tensors (`stand_in` for
    the scales an unquantized cache has not), their strides."""
    mode = _quant_mode(k_cache, k_scale, v_scale)
    strides = KVStrides(
        k_cache.stride()[:3], v_cache.stride()[:3], _scale_strides(k_scale, mode), _scale_strides(v_scale, mode)
    )
    if mode == Quant.NONE:
        k_scale = v_scale = stand_in
    return mode, KVPages(k_cache, v_cache, k_scale, v_scale), strides


class AttentionCall(NamedTuple):
    """What a decode or prefill launch needs beyond its own arguments: the query (head_dim
    contiguous), the cache as the kernels take it, and how the tiles compute."""

    q: torch.Tensor
    mode: Quant
    pages: KVPages
    strides: KVStrides
    upcast: bool  # fp32 tiles
    precision: str  # tl.dot's input_precision
    block_d: int  # head_dim rounded up to a power of two (at least 16, the smallest MMA)


def _gqa_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """How many query heads of `q [tokens, num_heads, head_dim]` share each KV head of a checked
    cache; a ValueError when they cannot."""
    _check_cache(k_cache, v_cache)
    num_heads, kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of the cache's kv_heads {kv_heads}")
    return num_heads // kv_heads


def _attention_call(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> AttentionCall:
    if q.stride(2) != 1:
        q = q.contiguous()
    mode, pages, strides = paged_kv(k_cache, v_cache, k_scale, v_scale, q)
    upcast, precision = _compute(q.dtype)
    return AttentionCall(q, mode, pages, strides, upcast, precision, max(16, triton.next_power_of_2(q.shape[2])))


def _quant_mode(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> Quant:
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
