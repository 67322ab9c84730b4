"""The configuration a what-if simulates: the recorded engine's (from the trace's header) with the
operator's overrides, and the KV budget turned into blocks by the engine's own sizing rule
(kvtop.protocol.sizing: `bytes_per_token`, `num_blocks_for`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtop.protocol.config import KV_CACHE_DTYPES, PREEMPTION_MODES, SCHEDULE_POLICIES, format_bytes, parse_size
from kvtop.protocol.errors import ConfigError
from kvtop.protocol.sizing import ELEMENT_BYTES, bytes_per_token, num_blocks_for

# the knobs a what-if may change, by their EngineConfig names
KNOBS = ("kv_cache_memory", "kv_cache_dtype", "block_size", "max_num_seqs", "max_num_batched_tokens",
         "max_model_len", "enable_prefix_caching", "schedule_policy", "preemption_mode", "cpu_offload_memory")  # fmt: skip


@dataclass(frozen=True)
class SimConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    schedule_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    cpu_blocks: int = 0
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int = 0  # bytes the blocks take
    bytes_per_token: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_seq_len(self) -> int:
        """Prompt + output one sequence may reach (engine.validation.PromptLimits)."""
        return min(self.max_model_len, self.kv_tokens)

    def describe(self) -> str:
        return (
            f"{self.num_blocks} blocks × {self.block_size} ({format_bytes(self.kv_cache_memory)} "
            f"{self.kv_cache_dtype}), max_num_seqs {self.max_num_seqs}, max_num_batched_tokens "
            f"{self.max_num_batched_tokens}, max_model_len {self.max_model_len}, prefix caching "
            f"{'on' if self.enable_prefix_caching else 'off'}"
        )


def recorded_config(header: dict) -> SimConfig:
    """The configuration the trace was recorded under (engine/telemetry/trace.py's `trace_header`)."""
    try:
        return SimConfig(
            num_blocks=int(header["num_blocks"]),
            block_size=int(header["block_size"]),
            max_num_seqs=int(header["max_num_seqs"]),
            max_num_batched_tokens=int(header["max_num_batched_tokens"]),
            max_model_len=int(header["max_model_len"]),
            enable_prefix_caching=bool(header.get("enable_prefix_caching", True)),
            schedule_policy=str(header.get("schedule_policy", "fcfs")),
            preemption_mode=str(header.get("preemption_mode", "recompute")),
            cpu_blocks=int(header.get("cpu_blocks") or 0),
            kv_cache_dtype=str(header.get("kv_cache_dtype", "auto")),
            kv_cache_memory=int(header.get("kv_cache_memory") or 0),
            bytes_per_token=int(header.get("bytes_per_token") or 0),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"the trace's engine configuration is incomplete ({exc}): re-record it") from None


def _bytes_per_token(header: dict, kv_cache_dtype: str) -> int:
    layers, kv_heads, head_dim = int(header["num_layers"]), int(header["num_kv_heads"]), int(header["head_dim"])
    model_dtype = header.get("dtype", "") if header.get("dtype", "") in ELEMENT_BYTES else "float32"
    return bytes_per_token(layers, kv_heads, head_dim, kv_cache_dtype, model_dtype)


def whatif_config(header: dict, **overrides) -> SimConfig:
    """The recorded configuration with `overrides` (KNOBS names; None: unchanged). Raises
    ConfigError naming the knob for a value the engine would refuse."""
    base = recorded_config(header)
    changes = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(changes) - set(KNOBS)
    if unknown:
        raise ConfigError(f"what-if cannot change {', '.join(sorted(unknown))}: only {', '.join(KNOBS)}")
    _check_choices(changes)
    kvd = changes.get("kv_cache_dtype", base.kv_cache_dtype)
    memory = parse_size(changes.get("kv_cache_memory")) or base.kv_cache_memory
    block_size = int(changes.get("block_size", base.block_size))
    if block_size <= 0 or block_size & (block_size - 1):
        raise ConfigError(f"--block-size {block_size} must be a positive power of two (16 is usual)")
    bpt = base.bytes_per_token
    if kvd != base.kv_cache_dtype or not bpt:
        bpt = _bytes_per_token(header, kvd)
    num_blocks = num_blocks_for(memory, bpt, block_size)
    if num_blocks < 1:
        raise ConfigError(
            f"--kv-cache-memory {format_bytes(memory)} holds no block: one block of {block_size} tokens "
            f"needs {format_bytes(bpt * block_size)} at {kvd}"
        )
    cpu = parse_size(changes.get("cpu_offload_memory"))
    return replace(
        base,
        num_blocks=num_blocks,
        block_size=block_size,
        kv_cache_dtype=kvd,
        kv_cache_memory=num_blocks * block_size * bpt,
        bytes_per_token=bpt,
        cpu_blocks=base.cpu_blocks if cpu is None else cpu // (bpt * block_size),
        **{k: changes[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                   "enable_prefix_caching", "schedule_policy", "preemption_mode") if k in changes},
    )  # fmt: skip


def _check_choices(changes: dict) -> None:
    for name, allowed in (("kv_cache_dtype", KV_CACHE_DTYPES), ("schedule_policy", SCHEDULE_POLICIES),
                          ("preemption_mode", PREEMPTION_MODES)):  # fmt: skip
        if name in changes and changes[name] not in allowed:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {changes[name]!r} is not one of {', '.join(allowed)}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if name in changes and int(changes[name]) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
