"""EngineConfig: the one place every engine knob and its default lives.

Field names follow vLLM's (`max_num_seqs`, `block_size`, `kv_cache_dtype`…) so operators' habits
carry over; the CLI exposes each field as a kebab-case flag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from engine.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


def parse_size(value: int | str | None) -> int | None:
    """Parse `256MiB`, `1GiB`, `500MB`, `4096` into bytes; None stays None."""
    if value is None or isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ConfigError(f"cannot read size {value!r}: use a number of bytes or e.g. 256MiB, 1GiB")
    number, unit = float(m.group(1)), (m.group(2) or "").lower().rstrip("b")
    if unit.endswith("i"):
        mult = 1024 ** ("kmgt".index(unit[0]) + 1)
    else:
        mult = _UNITS[unit]
    return int(number * mult)


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1.5 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
ATTENTION_BACKENDS = ("auto", "cpu", "triton", "reference")
SCHEDULE_POLICIES = ("fcfs", "lpm")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    kv_cache_memory: int | str | None = None  # bytes or "256MiB"; default 256MiB on CPU
    gpu_memory_utilization: float = 0.9  # GPU only, used when kv_cache_memory is unset
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    schedule_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    cpu_offload_memory: int | str | None = None
    seed: int = 0
    served_model_name: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        self.cpu_offload_memory = parse_size(self.cpu_offload_memory)
        for name, allowed in (
            ("dtype", DTYPES),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("attention_backend", ATTENTION_BACKENDS),
            ("schedule_policy", SCHEDULE_POLICIES),
            ("preemption_mode", PREEMPTION_MODES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a positive power of two (16 is usual)")
        if self.max_num_seqs <= 0:
            raise ConfigError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below block_size={self.block_size}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "extra"]


def context_limit_warning(max_model_len: int, kv_tokens: int) -> str | None:
    """One line for an operator when the KV cache cannot hold a single sequence of `max_model_len`
    tokens: then the real limit is the cache, and a long request would only fail later."""
    if kv_tokens >= max_model_len:
        return None
    return (
        f"max_model_len {max_model_len} but the KV cache holds {kv_tokens} tokens: requests are limited to "
        f"{kv_tokens} tokens (prompt + output; /v1/models says so) — raise --kv-cache-memory or lower --max-model-len"
    )
