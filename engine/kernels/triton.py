"""Triton paged attention: `store_kv`, `paged_decode_attention`, `paged_prefill_attention`.

Same signatures, layouts and quantization conventions as `engine.kernels.reference` (the oracle);
see its docstring and DESIGN §2–§3. Cache per layer `[num_blocks, block_size, kv_heads, head_dim]`.

- `store_kv`: one program per token writes all its KV heads; int8 gets one symmetric scale per
  (token, KV head), fp8_e4m3 divides by the per-tensor scale. Rounding is round-half-even and the
  divisions are IEEE (`div_rn`), so the cache bytes equal the reference's bit for bit.
- Decode: one program per (sequence, KV head, split) runs every query head of the GQA group as
  the rows of one tile, so each K/V tile is loaded once per group; a sequence's context is cut into
  `num_splits` chunks (flash-decoding) whose partial results a second kernel merges by
  log-sum-exp. `decode_num_splits` picks the split count.
- Prefill: one program per (tile of new tokens × GQA group, KV head); causal over the whole context
  in the cache, fully visible key tiles without masks, the diagonal ones masked. Programs find
  their sequence by a binary search over `cu_seqlens_q`, so the launch needs no host sync.

Dequantization happens in the tiles: int8 K scales multiply the scores column-wise, int8 V scales
the probabilities; fp8 per-tensor scales fold into the softmax scale and the output.

Only positions below a sequence's length are read, from the cache and from its block table, so
stale blocks and unwritten slots never reach the result. Under `TRITON_INTERPRET=1` (tests on the
CPU) all arithmetic runs in fp32, since the interpreter has no bf16 arithmetic.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# quantization modes of the cache, passed to the kernels as a constexpr
_QUANT_NONE, _QUANT_INT8, _QUANT_FP8 = 0, 1, 2

# flash-decoding: never cut a sequence into pieces shorter than this, the merge would cost more
# than the parallelism gains; and never more pieces than this
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# decode programs wanted per SM: several resident blocks hide the latency of the KV loads
_DECODE_PROGRAMS_PER_SM = 4
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
    if QUANT == 1:
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
    if QUANT == 1:
        scale_rows = page * stride_vsb + within * stride_vst + kv_head * stride_vsh
        if MASK:
            v_sc = tl.load(v_scale_ptr + scale_rows, mask=valid, other=0.0)
        else:
            v_sc = tl.load(v_scale_ptr + scale_rows)
        p = p * v_sc.to(tl.float32)[None, :]
    acc += tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# --------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_ksb,
    stride_kst,
    stride_ksh,
    stride_vsb,
    stride_vst,
    stride_vsh,
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
    k_dst = k_cache_ptr + page * stride_kcb + within * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_cache_ptr + page * stride_vcb + within * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    if QUANT == 1:
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
        tl.store(k_scale_ptr + page * stride_ksb + within * stride_kst + offs_h * stride_ksh, k_sc, mask=h_mask)
        tl.store(v_scale_ptr + page * stride_vsb + within * stride_vst + offs_h * stride_vsh, v_sc, mask=h_mask)
    elif QUANT == 2:
        k_sc = tl.load(k_scale_ptr).to(tl.float32)
        v_sc = tl.load(v_scale_ptr).to(tl.float32)
        ky = tl.math.div_rn(k.to(tl.float32), tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32) + k_sc)
        vy = tl.math.div_rn(v.to(tl.float32), tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32) + v_sc)
        ky = tl.minimum(tl.maximum(ky, -448.0), 448.0)
        vy = tl.minimum(tl.maximum(vy, -448.0), 448.0)
        # the fp8 caches are passed as uint8 views
        tl.store(k_dst, _fp8_e4m3_bits(ky), mask=mask)
        tl.store(v_dst, _fp8_e4m3_bits(vy), mask=mask)
    else:
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sm_scale,
    num_splits,
    stride_qs,
    stride_qh,
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
    stride_bt,
    stride_os,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_ls,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
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

    qk_scale = sm_scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
    if QUANT == 2:
        qk_scale = qk_scale * tl.load(k_scale_ptr).to(tl.float32)
    bt_row_ptr = block_tables_ptr + seq64 * stride_bt
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    for n0 in range(start, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, n0, end, offs_g, bt_row_ptr,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
            qk_scale, offs_d,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, QUANT, False, False, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):  # the ragged last tile, if any
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, n0, end, offs_g, bt_row_ptr,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
            qk_scale, offs_d,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, QUANT, True, False, DOT_PRECISION,
        )  # fmt: skip

    # an empty split (or an empty sequence) has l_i == 0: it yields zeros and lse = -inf
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if QUANT == 2:
        out = out * tl.load(v_scale_ptr).to(tl.float32)
    if SINGLE_SPLIT:
        dst = out_ptr + seq64 * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
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
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    out_ptr,
    sm_scale,
    num_seqs,
    stride_qt,
    stride_qh,
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
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
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
    q_pos = context + tok

    qk_scale = sm_scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
    if QUANT == 2:
        qk_scale = qk_scale * tl.load(k_scale_ptr).to(tl.float32)
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
    kv_end = context + last_tok + 1
    # keys every row of the tile sees: no causal or length mask needed there
    full_end = (context + first_tok + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, n0, kv_end, q_pos, bt_row_ptr,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
            qk_scale, offs_d,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, QUANT, False, False, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, n0, kv_end, q_pos, bt_row_ptr,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
            qk_scale, offs_d,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, QUANT, True, True, DOT_PRECISION,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if QUANT == 2:
        out = out * tl.load(v_scale_ptr).to(tl.float32)
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)


# --------------------------------------------------------------------------------------------
# host side


def _interpreting() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_decode_kernel, triton.runtime.JITFunction)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and not _interpreting():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


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


def _quant_mode(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> int:
    if k_cache.dtype == torch.int8:
        mode = _QUANT_INT8
    elif k_cache.dtype == torch.float8_e4m3fn:
        mode = _QUANT_FP8
    else:
        return _QUANT_NONE
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_cache.dtype} KV cache needs k_scale and v_scale tensors")
    return mode


def _scale_strides(scale: torch.Tensor | None, mode: int) -> tuple[int, int, int]:
    """Strides of an int8 cache's per-token scales `[num_blocks, block_size, kv_heads]`."""
    if mode != _QUANT_INT8:
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
    if mode != _QUANT_NONE:
        return 32, 4, 4  # the int8/fp8 -> bf16 conversion needs registers: smaller tiles, one more stage
    return 64, 4, 3


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
    mode = _quant_mode(k_cache, k_scale, v_scale)
    k_dst, v_dst = k_cache, v_cache
    if mode == _QUANT_FP8:
        k_dst, v_dst = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_sc = k_scale if mode != _QUANT_NONE else key
    v_sc = v_scale if mode != _QUANT_NONE else value
    block_h = triton.next_power_of_2(kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_dst, v_dst, k_sc, v_sc, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *_scale_strides(k_scale, mode), *_scale_strides(v_scale, mode),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        PAGE_SIZE=k_cache.shape[1], QUANT=mode,
        num_warps=max(1, min(8, block_h * block_d // 256)),
    )  # fmt: skip


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
    _check_cache(k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of the cache's kv_heads {kv_heads}")
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    mode = _quant_mode(k_cache, k_scale, v_scale)
    group = num_heads // kv_heads
    upcast, precision = _compute(q.dtype)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n, num_warps, num_stages = _decode_config(upcast, block_d, mode)
    # the table's width bounds every length without reading seq_lens back to the host
    max_len = block_tables.shape[1] * page_size
    num_splits = decode_num_splits(num_seqs, kv_heads, max_len, _num_sms(q.device))
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    k_sc = k_scale if mode != _QUANT_NONE else q
    v_sc = v_scale if mode != _QUANT_NONE else q
    _decode_kernel[(num_seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, k_sc, v_sc, block_tables, seq_lens, out, part_out, part_lse,
        float(scale), num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *_scale_strides(k_scale, mode), *_scale_strides(v_scale, mode),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads * num_splits * head_dim, num_splits * head_dim, head_dim, num_heads * num_splits, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=page_size, QUANT=mode,
        SINGLE_SPLIT=num_splits == 1, UPCAST=upcast, DOT_PRECISION=precision,
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
    _check_cache(k_cache, v_cache)
    total_q, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of the cache's kv_heads {kv_heads}")
    out = torch.empty(total_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or num_seqs == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    mode = _quant_mode(k_cache, k_scale, v_scale)
    group = num_heads // kv_heads
    upcast, precision = _compute(q.dtype)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps, num_stages = _prefill_config(upcast, block_d)
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    k_sc = k_scale if mode != _QUANT_NONE else q
    v_sc = v_scale if mode != _QUANT_NONE else q
    # sequence s owns tiles cu_seqlens_q[s] // block_q + s onwards: an upper bound with no host sync
    grid = (total_q // block_q + num_seqs, kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_sc, v_sc, block_tables, cu_seqlens_q, seq_lens, out,
        float(scale), num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *_scale_strides(k_scale, mode), *_scale_strides(v_scale, mode),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=page_size, QUANT=mode,
        UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
