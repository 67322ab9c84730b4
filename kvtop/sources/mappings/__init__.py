"""One table per engine: which of its Prometheus series feeds which stats-frame field.

A `Mapping` names, for each frame field it can fill, the sample names that carry it (the first
one present wins, so a table can list an engine's old and new names). A field no table entry
names is left out of the frame, never set to 0; `cannot_show` says in one line what a panel
should print instead. `detect` picks the table from the names a `/metrics` page serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Mapping:
    kind: str  # engine.kind in the frame: kvtop | vllm | sglang | llamacpp
    label: str  # how the engine is named to a person ("vLLM")
    prefix: str  # every series of this engine starts with it
    gauges: dict[str, tuple[str, ...]]  # frame path ("scheduler.running") -> sample names
    counters: dict[str, tuple[str, ...]]  # frame path -> counter sample names (totals since start)
    rates: dict[str, tuple[str, ...]]  # throughput field -> counter sample names, per second over the last scrapes
    histograms: dict[str, str]  # latency key (ttft, itl, e2e, queue) -> histogram name (without _bucket)
    info: str | None = None  # an info gauge whose labels hold block_size / num_gpu_blocks / cache_dtype
    cannot_show: tuple[str, ...] = field(default=())  # panels' one-line notes


def all_mappings() -> tuple[Mapping, ...]:
    from kvtop.sources.mappings import kvtop, llamacpp, sglang, vllm

    return (kvtop.MAPPING, vllm.MAPPING, sglang.MAPPING, llamacpp.MAPPING)


def by_kind(kind: str) -> Mapping:
    for m in all_mappings():
        if m.kind == kind:
            return m
    raise ValueError(f"unknown engine {kind!r}: use one of {', '.join(m.kind for m in all_mappings())}")


def detect(names) -> Mapping | None:
    """The engine whose prefix most of the served sample names carry (ours first on a tie)."""
    counts = {m.kind: 0 for m in all_mappings()}
    for name in names:
        for m in all_mappings():
            if name.startswith(m.prefix):
                counts[m.kind] += 1
    best = max(all_mappings(), key=lambda m: counts[m.kind])
    return best if counts[best.kind] else None
