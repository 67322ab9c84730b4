"""Where the engine runs and how big its KV cache is: `auto` device and dtype, and the KV budget
(`kv_cache_memory`, else a share of free GPU memory, else on the CPU a fixed default plus what
quantized weights save)."""

from __future__ import annotations

import os

import torch

from kvtop.protocol.config import CPU_DEFAULT_KV_MEMORY, EngineConfig, format_bytes

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return TORCH_DTYPES[dtype]


def kv_memory_bytes(config: EngineConfig, device: str, hidden_size: int, weights_saved: int = 0) -> int:
    """Bytes for the KV cache: as configured; on the CPU the fixed default plus what the weights'
    blocks save against the same weights de-quantized (`weights_saved`, cpu_kv_growth); on a GPU
    what this process may still take."""
    if config.kv_cache_memory is not None:
        return int(config.kv_cache_memory)
    if not device.startswith("cuda"):
        return CPU_DEFAULT_KV_MEMORY + cpu_kv_growth(weights_saved)
    free, total = torch.cuda.mem_get_info()
    # what this process may take in all, less what is already taken (weights, other processes)
    budget = total * config.gpu_memory_utilization - (total - free)
    activation_reserve = config.max_num_batched_tokens * hidden_size * 4 * 16
    return max(0, int(budget - activation_reserve))


def kv_budget_note(config: EngineConfig, device: str, budget: int) -> str:
    """For the start line: " (auto: 256 MiB + 421 MiB the weights' blocks save)" where the CPU's
    `auto` size grew, else ""."""
    if config.kv_cache_memory is not None or device.startswith("cuda") or budget <= CPU_DEFAULT_KV_MEMORY:
        return ""
    grown = budget - CPU_DEFAULT_KV_MEMORY
    return f" (auto: {format_bytes(CPU_DEFAULT_KV_MEMORY)} + {format_bytes(grown)} the weights' blocks save)"


def cpu_kv_growth(weights_saved: int) -> int:
    """What the CPU's `auto` KV size gets beyond its default: the bytes quantized weights no longer
    take (the KV cache gets what the weights leave), up to half the host memory still available, so
    that a large saving never takes the machine's last memory."""
    if weights_saved <= 0:
        return 0
    return max(0, min(weights_saved, host_memory_available() // 2 - CPU_DEFAULT_KV_MEMORY))


def host_memory_available() -> int:
    """Bytes the host can still give without swapping: Linux's MemAvailable, else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
