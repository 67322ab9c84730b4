"""Paged attention for one layer: store this step's K/V in the cache, then attend over it.

The runner packs a step's tokens decodes first (one token per sequence), then prompt chunks; this
module owns that split, so `DecoderLayer.forward` calls one function and reads like the paper.
A backend is a module of three functions with the same signatures — `store_kv`,
`paged_decode_attention`, `paged_prefill_attention` — in torch (`reference`, the oracle), Triton
(`triton`, CUDA) or C++ (`cpu`); `engine.kernels.get_backend` picks one, and they plug in here
beside each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.kv.cache import KVLayer


@dataclass
class AttentionBatch:
    """Per-step attention inputs, built once by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decodes: int  # the first num_decodes tokens are one-token decodes, one per sequence
    decode_tables: torch.Tensor | None  # int32 [num_decodes, max_blocks]
    decode_lens: torch.Tensor  # int32 [num_decodes]: tokens in cache after this step
    prefill_tables: torch.Tensor | None  # int32 [num_prefills, max_blocks]
    prefill_lens: torch.Tensor  # int32 [num_prefills]
    prefill_cu_seqlens_q: torch.Tensor  # int32 [num_prefills + 1], over the tokens after the decodes


class Backend(Protocol):
    """What `reference`, `triton` and `cpu` each provide (as module-level functions): the three
    attention functions, and the element-wise ops the model calls around them."""

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None: ...

    def paged_decode_attention(
        self, q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None
    ) -> torch.Tensor: ...

    def paged_prefill_attention(
        self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale=None, v_scale=None
    ) -> torch.Tensor: ...

    # the decoder layer's element-wise ops (reference's rounding; see engine.kernels.reference)
    def rms_norm(self, x, weight, eps) -> torch.Tensor: ...

    def fused_add_rms_norm(self, x, residual, weight, eps) -> torch.Tensor: ...  # residual += x in place

    def rotary_embedding(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]: ...  # may rotate in place

    def silu_and_mul(self, gate_up) -> torch.Tensor: ...


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: KVLayer,
    batch: AttentionBatch,
    scale: float,
    kernels: Backend,
) -> torch.Tensor:
    """q `[tokens, heads, dim]`, k/v `[tokens, kv_heads, dim]` (RoPE applied) → `[tokens, heads, dim]`."""
    if kv.calibrating:
        kv.calibrate(k, v)
    kernels.store_kv(k, v, kv.k, kv.v, batch.slot_mapping, kv.k_scale, kv.v_scale)
    nd = batch.num_decodes
    parts = []
    if nd:
        parts.append(
            kernels.paged_decode_attention(
                q[:nd], kv.k, kv.v, batch.decode_tables, batch.decode_lens, scale, kv.k_scale, kv.v_scale
            )
        )
    if batch.prefill_tables is not None:
        parts.append(
            kernels.paged_prefill_attention(
                q[nd:],
                kv.k,
                kv.v,
                batch.prefill_tables,
                batch.prefill_cu_seqlens_q,
                batch.prefill_lens,
                scale,
                kv.k_scale,
                kv.v_scale,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)
