"""When to take a snapshot without being asked (`--snapshot-on`).

- `preemption-storm`: at least `storm_preemptions` preemptions within `storm_window` seconds.
- `slo-breach`: TTFT or ITL P99 over the last minute above `slo_ttft` / `slo_itl`, once that
  minute holds `slo_min_requests` samples.
- `queue-full`: a request was refused because the queue was full.

Each trigger fires at most once per `snapshot_cooldown` seconds, so an incident leaves one
snapshot, not hundreds. `check` is fed every flight-recorder frame; it only reads the frame.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvtop.protocol.config import ServerConfig


@dataclass
class Firing:
    trigger: str
    detail: str


class SnapshotTriggers:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.enabled = set(config.snapshot_on)
        self.last_fired: dict[str, float] = {}
        self._preemptions: deque[tuple[float, int]] = deque()
        self._queue_full: str | None = None

    def note_queue_full(self, detail: str) -> None:
        """Called when a request is refused with 429; fires at the next frame."""
        self._queue_full = detail

    def check(self, frame: dict) -> list[Firing]:
        c = self.config
        now = frame["ts"]
        candidates: list[Firing] = []

        total = frame["scheduler"]["preemptions_total"]
        self._preemptions.append((now, total))
        while self._preemptions and self._preemptions[0][0] < now - c.storm_window:
            self._preemptions.popleft()
        delta = total - self._preemptions[0][1]
        if delta >= c.storm_preemptions:
            candidates.append(Firing("preemption-storm", f"{delta} preemptions in the last {c.storm_window:g} s"))

        for name, limit in (("ttft", c.slo_ttft), ("itl", c.slo_itl)):
            window = frame["latency"][name].get("window") or {}
            p99 = window.get("p99")
            if p99 is not None and window.get("count", 0) >= c.slo_min_requests and p99 > limit:
                candidates.append(
                    Firing("slo-breach", f"{name.upper()} P99 {p99:.3f} s over the last minute > {limit:g} s")
                )
                break

        if self._queue_full is not None:
            candidates.append(Firing("queue-full", self._queue_full))
            self._queue_full = None

        fired = []
        for f in candidates:
            if f.trigger not in self.enabled:
                continue
            last = self.last_fired.get(f.trigger)
            if last is not None and now - last < c.snapshot_cooldown:
                continue
            self.last_fired[f.trigger] = now
            fired.append(f)
        return fired
