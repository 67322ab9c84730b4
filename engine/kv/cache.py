"""KV cache allocation: one tensor for all layers' K and V, viewed per layer, sized by
kvtop.protocol.sizing's rule (bytes/token = layers × 2 × kv_heads × head_dim × bytes_per_element,
+ the int8 scales) — the rule `kvctl plan` and `kvctl whatif` predict with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.spec import ModelSpec
from engine.runtime import huge_pages
from kvtop.protocol.errors import ConfigError
from kvtop.protocol.sizing import bytes_per_token, num_blocks_for

KV_STORAGE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


class KVLayer:
    """One layer's view into the KV allocation (and its scales when quantized)."""

    __slots__ = ("calibrating", "k", "k_scale", "v", "v_scale")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, k_scale=None, v_scale=None) -> None:
        self.k, self.v, self.k_scale, self.v_scale = k, v, k_scale, v_scale
        self.calibrating = False  # fp8: set the per-tensor scales from the K/V this forward sees

    def calibrate(self, k: torch.Tensor, v: torch.Tensor, fp8_max: float = 448.0, headroom: float = 2.0) -> None:
        self.k_scale.fill_(max(float(k.abs().max()) * headroom / fp8_max, 1e-8))
        self.v_scale.fill_(max(float(v.abs().max()) * headroom / fp8_max, 1e-8))


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the name the sizing rule and the configuration use."""
    return str(dtype).removeprefix("torch.")


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return KV_STORAGE_DTYPES.get(kv_cache_dtype, model_dtype)


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
    host_data: torch.Tensor | None = None  # the CPU tier: same layout, host memory
    host_scales: torch.Tensor | None = None

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def allocate_host(self, memory_bytes: int) -> int:
        """Host-memory blocks for the CPU tier (pinned when the device is a GPU); returns how many."""
        num = memory_bytes // self.block_bytes
        shape = list(self.data.shape)
        shape[2] = num
        pin = self.data.is_cuda
        self.host_data = torch.zeros(shape, dtype=self.dtype, pin_memory=pin)
        if self.scales is not None and self.kv_cache_dtype == "int8":
            sshape = list(self.scales.shape)
            sshape[2] = num
            self.host_scales = torch.ones(sshape, dtype=torch.float32, pin_memory=pin)
        return num

    def copy_to_host(self, device_ids: list[int], host_ids: list[int]) -> None:
        src = torch.tensor(device_ids, device=self.data.device)
        dst = torch.tensor(host_ids)
        self.host_data[:, :, dst] = self.data[:, :, src].to("cpu")
        if self.host_scales is not None:
            self.host_scales[:, :, dst] = self.scales[:, :, src].to("cpu")

    def copy_to_device(self, host_ids: list[int], device_ids: list[int]) -> None:
        src = torch.tensor(host_ids)
        dst = torch.tensor(device_ids, device=self.data.device)
        self.data[:, :, dst] = self.host_data[:, :, src].to(self.data.device, non_blocking=True)
        if self.host_scales is not None:
            self.scales[:, :, dst] = self.host_scales[:, :, src].to(self.data.device, non_blocking=True)

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
        per_token = bytes_per_token(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_cache_dtype, dtype_name(model_dtype)
        )
        num_blocks = num_blocks_for(memory_bytes, per_token, block_size)
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_memory={memory_bytes} B holds no block: one block of {block_size} tokens needs "
                f"{per_token * block_size} B"
            )
        dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        on_cpu = torch.device(device).type == "cpu"
        data = huge_pages.zeros(shape, dtype) if on_cpu else torch.zeros(shape, dtype=dtype, device=device)
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
