"""`Mapping`: one engine's table, which of its Prometheus series feeds which stats-frame field.

Its own module so that the tables (`kvtop.py`, `vllm.py`, …) and the package that lists them
import it without importing each other.
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
    request_histograms: dict[str, str] = field(default_factory=dict)  # requests key (prompt_tokens,
    # generation_tokens) -> histogram of finished requests' lengths in tokens
    selected: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # frame path -> (sample name,
    # label, value): the series of that name whose label has that value (vLLM's waiting by reason)
    start_time: str | None = None  # a gauge of when the engine's process started (a new value: a new run)
    info: str | None = None  # an info gauge whose labels hold block_size / num_gpu_blocks / cache_dtype
    reserved_blocks: int = 0  # of the info gauge's blocks, those no request gets (vLLM's null block)
    cannot_show: tuple[str, ...] = field(default=())  # panels' one-line notes
