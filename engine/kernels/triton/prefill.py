"""Triton paged prefill attention: one program per (tile of new tokens x GQA group, KV head),
causal over each sequence's whole context in the cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.common import _attend, _attention_call, _gqa_group, _interpreting, _normalize


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence whose tiles hold global tile `q_block`: sequence s owns tiles from
    cu_seqlens_q[s] // BLOCK_Q + s on (at least the ceil(q_len / BLOCK_Q) it needs)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    q_ptr, pages, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr,
    sm_scale, num_seqs,
    stride_qt, stride_qh, strides, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, QUANT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_tok = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this chunk

    # rows are (token, head of the group) pairs: BLOCK_Q tokens x GROUP heads share each K/V tile
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = first_tok + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    row_mask = row_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask, other=0.0)
    if UPCAST:  # fp32 tiles: the interpreter, or fp32 queries
        q = q.to(tl.float32)

    last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
    kv_end = context + last_tok + 1
    # keys every row of the tile sees need no causal or length mask; the diagonal tiles do
    full_end = (context + first_tok + 1) // BLOCK_N * BLOCK_N
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, l_i, _ = _attend(
        q, context + tok, 0, full_end, kv_end, sm_scale, bt_row_ptr, pages, strides, kv_head, offs_d,
        HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, QUANT, True, DOT_PRECISION,
    )  # fmt: skip
    out = _normalize(acc, l_i, pages.v_scale, QUANT)
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)


def _prefill_config(fp32: bool, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel: compute-bound, so wgmma
    tiles of 128 rows over two warpgroups where registers allow (sm_90: ~190, no spills)."""
    if _interpreting():
        return 64, 32, 4, 1
    if fp32:
        return (32, 32, 4, 2) if block_d <= 128 else (32, 16, 4, 2)
    if block_d > 128:
        return 64, 32, 4, 2
    return 128, 64, 8, 3


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens `q [total_q, num_heads, head_dim]` over each sequence's
    whole context in the cache (its cached prefix plus the new tokens, already stored)."""
    group = _gqa_group(q, k_cache, v_cache)
    total_q, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    out = torch.empty(total_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or num_seqs == 0:
        return out
    call = _attention_call(q, k_cache, v_cache, k_scale, v_scale)
    block_m, block_n, num_warps, num_stages = _prefill_config(call.upcast, call.block_d)
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    # sequence s owns tiles cu_seqlens_q[s] // block_q + s onwards: an upper bound with no host sync
    grid = (total_q // block_q + num_seqs, kv_heads)
    _prefill_kernel[grid](
        call.q, call.pages, block_tables, cu_seqlens_q, seq_lens, out,
        float(scale), num_seqs,
        call.q.stride(0), call.q.stride(1), call.strides, block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, BLOCK_D=call.block_d, BLOCK_N=block_n, PAGE_SIZE=page_size, QUANT=int(call.mode),
        UPCAST=call.upcast, DOT_PRECISION=call.precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
