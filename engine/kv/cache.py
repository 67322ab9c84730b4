"""KV cache sizing and allocation: one tensor for all layers' K and V, viewed per layer.

bytes/token = layers × 2 × kv_heads × head_dim × bytes_per_element (+ the int8 scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from engine.model.llama import KVLayer, ModelSpec

KV_STORAGE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return KV_STORAGE_DTYPES.get(kv_cache_dtype, model_dtype)


def bytes_per_token(spec: ModelSpec, kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """KV bytes one token costs across all layers, K and V, scales included."""
    elem = torch.empty((), dtype=kv_storage_dtype(kv_cache_dtype, model_dtype)).element_size()
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * elem
    if kv_cache_dtype == "int8":
        per_token += spec.num_layers * 2 * spec.num_kv_heads * 4  # one float32 scale per token per head
    return per_token


@dataclass
class KVCache:
    spec: ModelSpec
    num_blocks: int
    block_size: int
    kv_cache_dtype: str
    dtype: torch.dtype  # storage dtype
    bytes_per_token: int
    data: torch.Tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    scales: torch.Tensor | None  # int8: [layers, 2, num_blocks, block_size, kv_heads]; fp8: [layers, 2, 1]
    layers: list[KVLayer]

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        memory_bytes: int,
        block_size: int,
        kv_cache_dtype: str,
        model_dtype: torch.dtype,
        device: str,
    ) -> KVCache:
        per_token = bytes_per_token(spec, kv_cache_dtype, model_dtype)
        num_blocks = memory_bytes // (per_token * block_size)
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_memory={memory_bytes} B holds no block: one block of {block_size} tokens needs "
                f"{per_token * block_size} B"
            )
        dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        data = torch.zeros(shape, dtype=dtype, device=device)
        scales = None
        if kv_cache_dtype == "int8":
            scales = torch.ones(shape[:-1], dtype=torch.float32, device=device)
        elif kv_cache_dtype == "fp8_e4m3":
            scales = torch.ones((spec.num_layers, 2, 1), dtype=torch.float32, device=device)
        layers = [
            KVLayer(
                data[i, 0],
                data[i, 1],
                None if scales is None else scales[i, 0],
                None if scales is None else scales[i, 1],
            )
            for i in range(spec.num_layers)
        ]
        return cls(spec, num_blocks, block_size, kv_cache_dtype, dtype, per_token, data, scales, layers)
