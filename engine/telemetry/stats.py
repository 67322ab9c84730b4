"""The stats frame (DESIGN §6): the composition of what each component reports of itself, in the
types of kvtop/protocol/frame.py (which the tools read by, and whose JSON Schema the tests
validate these frames against) — `Scheduler.stats()` (SchedulerInfo), `PrefixStats.report()`
(PrefixCache), `CpuTier.report()` (the CPU tier), the block manager's map and counts, the
metrics' histograms and counters. Nothing here writes a component's state (the KV usage's peak
is the metrics' own, `Metrics.observe_kv_usage`).

`build_frame(engine)` is called under the engine lock; everything it returns is plain JSON.
`build_gauges(engine)` is what a `/metrics` scrape reads, also under the lock: the same sections
and keys, less what no metric carries and costs most to build — the per-sequence rows, the block
map's string, the percentiles (a scrape sends bucket counts), the memory figures (read after the
lock by `memory_gauges`).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from kvtop.protocol.frame import (
    FRAME_EVENTS,
    SCHEMA_VERSION,
    CpuTier,
    KVCache,
    Memory,
    NvmlReading,
    PrefixCache,
    SequenceInfo,
    StatsFrame,
    block_counts,
)

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def build_frame(engine: LLMEngine) -> StatsFrame:
    now = time.time()
    kv = engine.kv
    sched = engine.scheduler
    m = engine.metrics
    kv_section = _kv(engine)
    sequences = [
        _sequence(s, kv.bytes_per_token, kv.block_size, now) for s in list(sched.running) + list(sched.waiting)
    ]
    return {
        "schema": SCHEMA_VERSION,
        "ts": now,
        "engine": {
            "state": engine.state.value,
            "model": engine.config.served_model_name or engine.config.model,
            "device": engine.device,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "attention_backend": engine.attention_backend,
            "uptime_s": now - engine.start_time,
            "step": engine.step_count,
            "max_model_len": engine.max_model_len,
        },
        "kv": kv_section,
        "sequences": sequences,
        "scheduler": engine.scheduler.stats(queued_elsewhere=engine.num_unscheduled()),
        "prefix": _prefix(engine, kv_section["cached"]),
        "latency": {key: h.summary(now) for key, h in _latency(engine).items()},
        "throughput": m.throughput(now),
        "counters": _counters(engine),
        "memory": _memory(engine),
        "events": list(m.events)[-FRAME_EVENTS:],
    }


def build_gauges(engine: LLMEngine) -> dict:
    """The frame's counters and gauges for a `/metrics` scrape (see the module docstring)."""
    now = time.time()
    kv_section = _kv(engine)
    del kv_section["blocks"]
    return {
        "ts": now,
        "engine": {"state": engine.state, "uptime_s": now - engine.start_time, "step": engine.step_count},
        "kv": kv_section,
        "scheduler": engine.scheduler.stats(queued_elsewhere=engine.num_unscheduled()),
        "prefix": _prefix(engine, kv_section["cached"]),
        "latency": {key: h.counts_only() for key, h in _latency(engine).items()},
        "counters": _counters(engine),
    }


def memory_gauges(engine: LLMEngine) -> dict:
    """What a scrape sends of the memory: the process's resident bytes and the weights' (no NVML)."""
    return {"device_used": _device_used(engine), "weights": engine.weights_bytes}


def _latency(engine: LLMEngine) -> dict:
    m = engine.metrics
    return {"ttft": m.ttft, "itl": m.itl, "e2e": m.e2e, "queue": m.queue}


def _counters(engine: LLMEngine) -> dict:
    c = engine.metrics.counters
    return {
        "prompt_tokens": c.prompt_tokens,
        "generation_tokens": c.generation_tokens,
        "requests_finished": c.requests_finished,
        "requests_aborted": c.requests_aborted,
        "requests_failed": c.requests_failed,
    }


def _prefix(engine: LLMEngine, cached_blocks: int) -> PrefixCache:
    """The frame's `prefix`: the prefix cache's own report, its saved prefill priced at today's speed."""
    bm = engine.block_manager
    return bm.prefix.report(bm.enable_prefix_caching, cached_blocks, engine.metrics.prefill_seconds_per_token())


def _kv(engine: LLMEngine) -> KVCache:
    """The frame's `kv`: block counts by map character, usage and its peak, sizes, the map."""
    kv, bm, m = engine.kv, engine.block_manager, engine.metrics
    blocks = bm.block_states()
    counts = block_counts(blocks[: kv.num_blocks])
    held = counts["used"] + counts["shared"]  # blocks held by requests: vLLM's kv_cache_usage_perc
    cpu: CpuTier = (
        bm.cpu.report(len(engine.scheduler.swapped))
        if bm.cpu is not None
        else {"num_blocks": 0, "used": 0, "enabled": False}
    )
    return {
        "block_size": kv.block_size,
        "num_blocks": kv.num_blocks,
        **counts,
        "allocatable": counts["free"] + counts["cached"],
        "offloaded": blocks.count("o"),
        "usage": held / kv.num_blocks,
        "peak_usage": max(m.peak_kv_usage, held / kv.num_blocks),  # never below what this frame shows
        "bytes_per_token": kv.bytes_per_token,
        "total_bytes": kv.total_bytes,
        "used_bytes": held * kv.block_size * kv.bytes_per_token,
        "dtype": kv.kv_cache_dtype,
        "blocks": blocks,
        "cpu": cpu,
    }


def _sequence(seq, bytes_per_token: int, block_size: int, now: float) -> SequenceInfo:
    met = seq.metrics
    itl = sum(met.itls) / len(met.itls) if met.itls else None
    return {
        "id": seq.seq_id,
        "state": seq.state.value,
        "prompt_tokens": seq.num_prompt_tokens,
        "output_tokens": seq.num_output_tokens,
        "cached_tokens": seq.num_cached_tokens,
        "computed_tokens": seq.num_computed_tokens,
        "num_blocks": len(seq.block_table),
        "kv_bytes": len(seq.block_table) * block_size * bytes_per_token,
        "age_s": now - met.arrival_time,
        "ttft_s": met.ttft,
        "itl_s": itl,
        "preemptions": seq.num_preemptions,
        "block_ids": list(seq.block_table),
        "host_blocks": len(seq.host_table),
    }


def _memory(engine: LLMEngine) -> Memory:
    import torch

    if engine.device.startswith("cuda"):
        device_total = torch.cuda.mem_get_info()[1]
    else:
        device_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "device_total": device_total,
        "device_used": _device_used(engine),
        "weights": engine.weights_bytes,
        "weights_format": engine.weights_format,
        "prefill_copy": engine.prefill_copy_bytes,
        "kv": engine.kv.total_bytes,
        "nvml": _nvml(engine),
    }


def _device_used(engine: LLMEngine) -> int:
    """Device memory in use: the CUDA device's, or this process's resident bytes on CPU."""
    if engine.device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free
    return _rss_bytes()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _nvml(engine: LLMEngine) -> NvmlReading | None:
    """GPU utilisation through NVML when there is an NVIDIA GPU; None otherwise, never an error."""
    if not engine.device.startswith("cuda"):
        return None
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        index = torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {"gpu_util": util.gpu, "mem_bw_util": util.memory, "mem_used": mem.used, "mem_total": mem.total}
    except Exception:  # no driver, no permission, old card: the dashboard just shows no NVML
        return None
