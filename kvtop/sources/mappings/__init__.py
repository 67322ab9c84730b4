"""One table per engine: which of its Prometheus series feeds which stats-frame field.

A `Mapping` names, for each frame field it can fill, the sample names that carry it (the first
one present wins, so a table can list an engine's old and new names). A field no table entry
names is left out of the frame, never set to 0; `cannot_show` says in one line what a panel
should print instead. `detect` picks the table from the names a `/metrics` page serves.
"""

from __future__ import annotations

from kvtop.sources.mappings.mapping import Mapping

__all__ = ["Mapping", "all_mappings", "by_kind", "detect", "engine_label"]


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


def engine_label(frame: dict) -> str:
    """How the engine that sent `frame` is named to a person ("vLLM"), or "the engine"."""
    kind = (frame.get("engine") or {}).get("kind") or "the engine"
    return next((m.label for m in all_mappings() if m.kind == kind), kind)
