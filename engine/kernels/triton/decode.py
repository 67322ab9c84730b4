"""Triton paged decode attention (flash-decoding): one program per (sequence, KV head, split),
the GQA group's query heads as the rows of one tile; a second kernel merges the splits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.common import (
    Quant,
    _attend,
    _attention_call,
    _gqa_group,
    _interpreting,
    _normalize,
    _num_sms,
)

# flash-decoding: never cut a sequence into pieces shorter than this, the merge would cost more
# than the parallelism gains; and never more pieces than this
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# decode programs wanted per SM: several resident blocks hide the latency of the KV loads
_DECODE_PROGRAMS_PER_SM = 4


@triton.jit
def _decode_kernel(
    q_ptr, pages, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    sm_scale, num_splits,
    stride_qs, stride_qh, strides, stride_bt, stride_os, stride_oh,
    stride_ps, stride_ph, stride_pk, stride_ls, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, QUANT: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # this sequence's own chunk, a whole number of tiles; trailing splits of short ones stay empty
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    row_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=row_mask, other=0.0)
    if UPCAST:  # fp32 tiles: the interpreter, or fp32 queries
        q = q.to(tl.float32)

    # one query token: no causal mask; only the ragged last tile, if any, is masked
    acc, l_i, m_i = _attend(
        q, offs_g, start, full_end, end, sm_scale, block_tables_ptr + seq64 * stride_bt, pages, strides, kv_head,
        offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, QUANT, False, DOT_PRECISION,
    )  # fmt: skip
    # an empty split (or an empty sequence) has l_i == 0: it yields zeros and lse = -inf
    out = _normalize(acc, l_i, pages.v_scale, QUANT)
    if SINGLE_SPLIT:
        dst = out_ptr + seq64 * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        part = seq64 * stride_ps + heads * stride_ph + split * stride_pk
        tl.store(part_out_ptr + part[:, None] + offs_d[None, :], out, mask=row_mask)
        lse_dst = part_lse_ptr + seq64 * stride_ls + heads * stride_lh + split
        tl.store(lse_dst, lse, mask=offs_g < GROUP)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_ls,
    stride_lh,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    seq64 = seq.to(tl.int64)
    base = seq64 * stride_ps + head * stride_ph + offs_s * stride_pk
    lse = tl.load(part_lse_ptr + seq64 * stride_ls + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    parts = tl.load(
        part_out_ptr + base[:, None] + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    dst = out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_num_splits(num_seqs: int, kv_heads: int, max_len: int, num_sms: int) -> int:
    """How many pieces flash-decoding cuts each sequence's context into.

    One program per (sequence, KV head) already fills the GPU for big batches: then 1. Otherwise
    split until there are about `_DECODE_PROGRAMS_PER_SM` programs per SM, but keep each piece at
    least MIN_TOKENS_PER_SPLIT long (the merge and the per-program setup must stay small against
    the KV each piece reads). A power of two, at most MAX_SPLITS."""
    programs = max(1, num_seqs * kv_heads)
    wanted = triton.cdiv(_DECODE_PROGRAMS_PER_SM * num_sms, programs)
    by_length = max(1, max_len // MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(wanted, by_length, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def _decode_config(fp32: bool, block_d: int, mode: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel. Its rows are one GQA group padded to
    16 (the smallest MMA), so it is bound by the K/V stream: tiles of 8-16 KiB, 3-4 in flight, and
    few enough registers (sm_90: 80-130) for several resident programs per SM."""
    if _interpreting():
        return 32, 4, 1
    if fp32:
        return (32, 4, 2) if block_d <= 128 else (16, 4, 2)
    if block_d > 128:
        return 32, 4, 2
    if mode != Quant.NONE:
        return 32, 4, 4  # the int8/fp8 -> bf16 conversion needs registers: smaller tiles, one more stage
    return 64, 4, 3


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence `[num_seqs, num_heads, head_dim]` over its cached context."""
    group = _gqa_group(q, k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    call = _attention_call(q, k_cache, v_cache, k_scale, v_scale)
    block_n, num_warps, num_stages = _decode_config(call.upcast, call.block_d, call.mode)
    # the table's width bounds every length without reading seq_lens back to the host
    max_len = block_tables.shape[1] * page_size
    num_splits = decode_num_splits(num_seqs, kv_heads, max_len, _num_sms(q.device))
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_seqs, kv_heads, num_splits)](
        call.q, call.pages, block_tables, seq_lens, out, part_out, part_lse,
        float(scale), num_splits,
        call.q.stride(0), call.q.stride(1), call.strides, block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads * num_splits * head_dim, num_splits * head_dim, head_dim, num_heads * num_splits, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=call.block_d, BLOCK_N=block_n, PAGE_SIZE=page_size, QUANT=int(call.mode),
        SINGLE_SPLIT=num_splits == 1, UPCAST=call.upcast, DOT_PRECISION=call.precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, num_splits,
            num_heads * num_splits * head_dim, num_splits * head_dim, head_dim, num_heads * num_splits, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4 if head_dim >= 128 else 2,
        )  # fmt: skip
    return out
