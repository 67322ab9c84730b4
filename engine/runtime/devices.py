"""Where the engine runs and how big its KV cache is: `auto` device and dtype, and the KV budget
(`kv_cache_memory`, else a share of free GPU memory, else a fixed CPU default)."""

from __future__ import annotations

import torch

from kvtop.protocol.config import EngineConfig

CPU_DEFAULT_KV_MEMORY = 256 * 1024**2
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return TORCH_DTYPES[dtype]


def kv_memory_bytes(config: EngineConfig, device: str, hidden_size: int) -> int:
    """Bytes for the KV cache: as configured, or what this process may still take on the GPU."""
    if config.kv_cache_memory is not None:
        return int(config.kv_cache_memory)
    if not device.startswith("cuda"):
        return CPU_DEFAULT_KV_MEMORY
    free, total = torch.cuda.mem_get_info()
    # what this process may take in all, less what is already taken (weights, other processes)
    budget = total * config.gpu_memory_utilization - (total - free)
    activation_reserve = config.max_num_batched_tokens * hidden_size * 4 * 16
    return max(0, int(budget - activation_reserve))
