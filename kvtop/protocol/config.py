"""What an engine and its server are started with: `EngineConfig` (every engine knob and its
default) and `ServerConfig` (every other knob of `kvctl serve`), with the value lists shell
completion offers.

Part of the protocol because both sides read them: kvctl declares one flag per field (kebab case:
`--kv-cache-memory 128MiB`) and completes their values without loading the engine, and the engine
runs with them. Field names follow vLLM's (`max_num_seqs`, `block_size`, `kv_cache_dtype`…) so
operators' habits carry over.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from kvtop.protocol.errors import ConfigError
from kvtop.protocol.paths import cache_dir

# The KV cache's `auto` size on the CPU before what quantized weights save is added (the engine's
# engine/runtime/devices.py; `kvctl plan` says what it comes to)
CPU_DEFAULT_KV_MEMORY = 256 * 1024**2

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
QUANTIZATIONS = ("auto", "none", "int8")  # auto: a GGUF file's weights stay in their block formats on the CPU;
# int8: any checkpoint's made Q8_0 at load


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    kv_cache_memory: int | str | None = None  # bytes or "256MiB"; CPU default 256MiB + what quantized weights save
    gpu_memory_utilization: float = 0.9  # GPU only, used when kv_cache_memory is unset
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    # auto: a GGUF's weights stay in their blocks (CPU; a checkpoint's load as they are); none:
    # de-quantized to dtype; int8: any checkpoint's made Q8_0 at load
    quantization: str = "auto"
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
            ("quantization", QUANTIZATIONS),
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


TRIGGERS = ("preemption-storm", "slo-breach", "queue-full")
DEFAULT_MAX_REQUEST_BODY = 8 * 1024**2
DEFAULT_READ_TIMEOUT = 5.0
DEFAULT_REQUEST_TIMEOUT = 30.0
DAY_S, WEEK_S = 86400.0, 7 * 86400.0
# the control socket's longest drain deadline: it feeds Retry-After and the countdowns, so a sane number
MAX_DRAIN_TIMEOUT_S = DAY_S
# a sequence's eviction is applied at the engine's next step: the control socket waits this long for
# it by default (200 once applied, 202 while still queued), at most MAX_EVICT_WAIT_S when asked
EVICT_WAIT_S, MAX_EVICT_WAIT_S = 5.0, 60.0

# Every duration: (its lowest value, whether that value itself is allowed, its highest). A duration
# reaches deadlines, Retry-After and countdowns: nan, inf and 1e309 must stop here, in one line.
SECONDS_BOUNDS = {
    "stats_interval": (0.0, False, 3600.0),
    "history": (0.0, False, WEEK_S),
    "drain_timeout": (0.0, True, DAY_S),
    "storm_window": (0.0, False, DAY_S),
    "slo_ttft": (0.0, False, DAY_S),
    "slo_itl": (0.0, False, DAY_S),
    "snapshot_cooldown": (0.0, True, WEEK_S),
    "read_timeout": (0.0, False, DAY_S),
    "request_timeout": (0.0, False, DAY_S),
}


def default_snapshot_dir() -> Path:
    return cache_dir() / "snapshots"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (reported in the startup summary and /v1/healthz)
    socket: Path | None = None  # None: KVTOP_SOCKET, else the default path (kvtop.client)
    api_key: str | None = None
    max_queue: int = 256  # requests waiting beyond the max_num_seqs that can run
    stats_interval: float = 0.5  # seconds between flight-recorder frames
    history: float = 600.0  # seconds of frames the flight recorder keeps
    drain_timeout: float = 30.0  # SIGTERM: drain this long, then abort what is left and exit
    snapshot_dir: Path = field(default_factory=default_snapshot_dir)
    snapshot_on: tuple[str, ...] = ()
    storm_preemptions: int = 20  # preemption storm: this many preemptions ...
    storm_window: float = 10.0  # ... within this many seconds
    slo_ttft: float = 2.0  # SLO breach: TTFT P99 over the last minute above this (s) ...
    slo_itl: float = 0.5  # ... or ITL P99 above this (s)
    slo_min_requests: int = 5  # ... once the minute holds at least this many samples
    snapshot_cooldown: float = 300.0  # seconds before the same trigger fires again
    max_request_body: int | str = DEFAULT_MAX_REQUEST_BODY  # bytes or "8MiB"; a bigger body gets 413
    read_timeout: float = DEFAULT_READ_TIMEOUT  # headers must be whole, and a body may not go silent, this long
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT  # headers + body whole this long after their first byte
    max_connections: int = 1024  # open connections; beyond it new ones get 503 (app.py's ConnectionLimits)
    max_connections_per_ip: int | None = None  # from one client address, beyond it 503; None: connections_per_ip()
    warmup: bool = True  # one full-budget step before serving (engine/runtime/warmup.py)

    def __post_init__(self) -> None:
        self._check_durations()
        self.max_request_body = parse_size(self.max_request_body)
        if self.max_request_body is None or self.max_request_body < 1024:
            raise ConfigError("max_request_body must be at least 1KiB")
        if self.max_connections < 1 or (self.max_connections_per_ip or 1) < 1:
            raise ConfigError("max_connections and max_connections_per_ip must be >= 1")
        unknown = [t for t in self.snapshot_on if t not in TRIGGERS]
        if unknown:
            raise ConfigError(f"unknown snapshot trigger {', '.join(unknown)}: use {', '.join(TRIGGERS)}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is not in 0..65535")
        if self.max_queue < 0:
            raise ConfigError("max_queue must be >= 0")
        if self.history < self.stats_interval:
            raise ConfigError("history must be at least one stats interval (seconds)")
        if self.storm_preemptions < 1:
            raise ConfigError("storm_preemptions must be >= 1")

    def _check_durations(self) -> None:
        for name, (low, low_allowed, high) in SECONDS_BOUNDS.items():
            value = getattr(self, name)
            above_low = value >= low if low_allowed else value > low
            if not (math.isfinite(value) and above_low and value <= high):  # nan fails every comparison
                lowest = f"from {low:g}" if low_allowed else f"above {low:g}"
                raise ConfigError(f"{name} {value:g} is not a number of seconds {lowest} to {high:g}")

    def connections_per_ip(self, max_num_seqs: int) -> int:
        """The open connections one client address may hold. By default enough to fill the server
        (max_num_seqs + max_queue, and never under 64), so that one client, or a gateway in front,
        meets a full queue (429) before this limit; but at most half of max_connections, so that
        one address can never hold every connection."""
        if self.max_connections_per_ip is not None:
            return self.max_connections_per_ip
        return max(1, min(max(64, max_num_seqs + self.max_queue), self.max_connections // 2))

    @staticmethod
    def parse_triggers(value: str | None) -> tuple[str, ...]:
        if not value:
            return ()
        return tuple(t.strip() for t in value.split(",") if t.strip())
