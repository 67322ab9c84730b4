"""Triton `store_kv`: one program per token writes all its KV heads into their cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.common import (
    QUANT_FP8,
    QUANT_INT8,
    Quant,
    _check_cache,
    _fp8_e4m3_bits,
    _round_half_even,
    _rows,
    paged_kv,
)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    pages,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    strides,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    within = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + token64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    k_dst = pages.k + _rows(page, within, offs_h, strides.k)[:, None] + offs_d[None, :]
    v_dst = pages.v + _rows(page, within, offs_h, strides.v)[:, None] + offs_d[None, :]
    if QUANT == QUANT_INT8:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        k_amax = tl.maximum(tl.max(tl.abs(k), 1), 1e-8)
        v_amax = tl.maximum(tl.max(tl.abs(v), 1), 1e-8)
        int8_max = tl.full([BLOCK_H], 127.0, tl.float32)
        k_sc = tl.math.div_rn(k_amax, int8_max)
        v_sc = tl.math.div_rn(v_amax, int8_max)
        kq = _round_half_even(tl.math.div_rn(k, tl.broadcast_to(k_sc[:, None], [BLOCK_H, BLOCK_D])))
        vq = _round_half_even(tl.math.div_rn(v, tl.broadcast_to(v_sc[:, None], [BLOCK_H, BLOCK_D])))
        kq = tl.minimum(tl.maximum(kq, -127.0), 127.0)
        vq = tl.minimum(tl.maximum(vq, -127.0), 127.0)
        tl.store(k_dst, kq.to(tl.int8), mask=mask)
        tl.store(v_dst, vq.to(tl.int8), mask=mask)
        h_mask = offs_h < KV_HEADS
        tl.store(pages.k_scale + _rows(page, within, offs_h, strides.k_scale), k_sc, mask=h_mask)
        tl.store(pages.v_scale + _rows(page, within, offs_h, strides.v_scale), v_sc, mask=h_mask)
    elif QUANT == QUANT_FP8:
        k_sc = tl.load(pages.k_scale).to(tl.float32)
        v_sc = tl.load(pages.v_scale).to(tl.float32)
        ky = tl.math.div_rn(k.to(tl.float32), tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32) + k_sc)
        vy = tl.math.div_rn(v.to(tl.float32), tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32) + v_sc)
        ky = tl.minimum(tl.maximum(ky, -448.0), 448.0)
        vy = tl.minimum(tl.maximum(vy, -448.0), 448.0)
        # the fp8 caches are passed as uint8 views
        tl.store(k_dst, _fp8_e4m3_bits(ky), mask=mask)
        tl.store(v_dst, _fp8_e4m3_bits(vy), mask=mask)
    else:
        tl.store(k_dst, k.to(pages.k.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(pages.v.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write packed rows `[num_tokens, kv_heads, head_dim]` into their slots; slot -1 is skipped."""
    _check_cache(k_cache, v_cache)
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    mode, pages, strides = paged_kv(k_cache, v_cache, k_scale, v_scale, key)
    if mode == Quant.FP8:  # written as bytes: see _fp8_e4m3_bits
        pages = pages._replace(k=k_cache.view(torch.uint8), v=v_cache.view(torch.uint8))
    block_h = triton.next_power_of_2(kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key, value, pages, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), strides,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        PAGE_SIZE=k_cache.shape[1], QUANT=int(mode),
        num_warps=max(1, min(8, block_h * block_d // 256)),
    )  # fmt: skip
