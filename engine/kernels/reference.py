"""Plain torch kernels: paged attention, and the decoder layer's element-wise ops (RMSNorm, RoPE,
SiLU-and-mul). The CPU fallback, the GPU's element-wise ops, and the oracle the Triton and C++
kernels are tested against.

Cache layout per layer (DESIGN §2): k_cache, v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`.
Quantized caches:
- int8: symmetric, one float32 scale per token per KV head; `k_scale`/`v_scale` are
  `[num_blocks, block_size, num_kv_heads]` tensors beside the cache that `store_kv` fills.
- fp8_e4m3: one per-tensor float32 scale each for K and V (`k_scale`/`v_scale`, one element), as vLLM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127.0
FP8_MAX = 448.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, heads, dim] -> int8 values and a per-(token, head) scale."""
    x = x.float()
    amax = x.abs().amax(dim=-1).clamp(min=1e-8)
    # divided by a tensor on x's device, not a Python number: CUDA torch turns division by a host
    # scalar into multiplication by its reciprocal, one ulp off the IEEE quotient the kernels compute
    scale = amax / amax.new_tensor(INT8_MAX)
    q = torch.round(x / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


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
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    k_flat = k_cache.view(num_blocks * block_size, kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, kv_heads, head_dim)
    if k_cache.dtype == torch.int8:
        kq, ks = quantize_int8(key)
        vq, vs = quantize_int8(value)
        k_flat[slot_mapping] = kq
        v_flat[slot_mapping] = vq
        k_scale.view(-1, kv_heads)[slot_mapping] = ks
        v_scale.view(-1, kv_heads)[slot_mapping] = vs
    elif k_cache.dtype == torch.float8_e4m3fn:
        k_flat[slot_mapping] = (key.float() / k_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        v_flat[slot_mapping] = (value.float() / v_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        k_flat[slot_mapping] = key.to(k_cache.dtype)
        v_flat[slot_mapping] = value.to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_blocks: int,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Contiguous `[num_seqs, num_blocks * block_size, kv_heads, head_dim]` view of each table's
    first `num_blocks` blocks, dequantized to `out_dtype`."""
    tables = block_tables[:, :num_blocks].reshape(-1).long()
    s, (_, bs, h, d) = block_tables.shape[0], cache.shape
    # index_select is several times faster than advanced indexing for this gather on CPU
    gathered = cache.index_select(0, tables).view(s, num_blocks * bs, h, d)
    if cache.dtype == torch.int8:
        sc = scale.index_select(0, tables).view(s, num_blocks * bs, h, 1)
        return (gathered.float() * sc).to(out_dtype)
    if cache.dtype == torch.float8_e4m3fn:
        return (gathered.float() * scale).to(out_dtype)
    return gathered.to(out_dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [S, Lq, H, D], k/v [S, Lk, KVH, D], mask [S, Lq, Lk] bool (True = attend) -> [S, Lq, H, D]."""
    heads, kv_heads = q.shape[2], k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask.unsqueeze(1),
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return out.transpose(1, 2)


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
    bs = k_cache.shape[1]
    max_len = int(seq_lens.max())
    nblocks = (max_len + bs - 1) // bs
    k = gather_kv(k_cache, block_tables, nblocks, q.dtype, k_scale)
    v = gather_kv(v_cache, block_tables, nblocks, q.dtype, v_scale)
    positions = torch.arange(nblocks * bs, device=q.device)
    mask = positions.unsqueeze(0) < seq_lens.unsqueeze(1).to(positions.dtype)
    # the query heads of a GQA group become that KV head's "query length": no K/V repeat
    num_seqs, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.view(num_seqs, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale
    )
    return out.reshape(num_seqs, heads, head_dim)


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
    device = q.device
    bs = k_cache.shape[1]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    num_seqs, total_q = q_lens.shape[0], q.shape[0]
    max_q = int(q_lens.max())
    max_len = int(seq_lens.max())
    nblocks = (max_len + bs - 1) // bs
    k = gather_kv(k_cache, block_tables, nblocks, q.dtype, k_scale)
    v = gather_kv(v_cache, block_tables, nblocks, q.dtype, v_scale)
    # place each packed query at (its sequence, its index among that sequence's new tokens)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
    local = torch.arange(total_q, device=device) - cu_seqlens_q[:-1].long()[seq_of_token]
    padded_q = q.new_zeros(num_seqs, max_q, *q.shape[1:])
    padded_q[seq_of_token, local] = q
    # query j of sequence s sits at absolute position seq_len - q_len + j
    lens = seq_lens.long()
    q_pos = (lens - q_lens).unsqueeze(1) + torch.arange(max_q, device=device).unsqueeze(0)
    k_pos = torch.arange(nblocks * bs, device=device)
    mask = (k_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)) & (k_pos.view(1, 1, -1) < lens.view(-1, 1, 1))
    # padded query rows must still see one key or SDPA yields NaN
    mask[:, :, 0] = True
    out = _attend(padded_q, k, v, mask, scale)
    return out[seq_of_token, local]


# The decoder layer's element-wise ops. Their rounding is the definition the C++ ops reproduce.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in the same order of operations as transformers' LlamaRMSNorm,
    so bf16 rounds the same way: normalized in fp32, rounded to x's dtype, times the weight."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`residual += x` in place (the residual stream), then `rms_norm(residual)`."""
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE, neox style (rotate_half), on q `[tokens, heads, dim]` and k `[tokens, kv_heads, dim]`
    with each token's cos/sin rows `[tokens, dim]`. Returns the rotated q and k: use those, since
    a backend may rotate in place (the C++ one does) or not (this one)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of the fused projection `[tokens, 2 * intermediate]` (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
