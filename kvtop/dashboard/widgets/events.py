"""Events: the latest preemptions, evictions, drains, aborts, snapshots and restarts, newest last.

Times are relative to the frame shown (`-3.2s`), so a replayed incident reads the same as a live
one. Bursty kinds (`prefix_evicted`, which a thrash sends every second) are folded: a run of them
with no gap over `BURST_GAP_S` is one line with its count, span and rate, placed at its latest
event, so a thrash cannot push a drain or a snapshot off the panel. `v` adds the routine events
(admitted, scheduled, first token, finished) and shows every event on its own line.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field

from rich.text import Text

from kvtop import fmt
from kvtop.dashboard.widgets.view import Panel, View, set_border
from kvtop.sources import BURSTY_EVENTS, NOTABLE_EVENTS

BURST_GAP_S = 5.0
KIND_STYLES = {
    "preempted": "bold red",
    "evicted": "yellow",
    "prefix_evicted": "yellow",
    "aborted": "red",
    "drain_started": "bold yellow",
    "drain_finished": "bold yellow",
    "resumed": "bold green",
    "snapshot": "bold cyan",
    "engine_restarted": "bold magenta",
}
LEADING_INT = re.compile(r"\s*(?:derived: )?(\d+)")
BURST_UNITS = {"prefix_evicted": "blocks", "rejected": "requests"}  # what a bursty kind's leading number counts


@dataclass
class Burst:
    """A run of events of one bursty kind."""

    kind: str
    events: list[dict] = field(default_factory=list)

    @property
    def ts(self) -> float:
        return self.events[-1].get("ts") or 0.0

    def detail(self) -> str:
        first, last = self.events[0].get("ts") or 0.0, self.ts
        span = last - first
        text = f"×{len(self.events)} in {fmt.duration(span)}"
        counts = [LEADING_INT.match(e.get("detail") or "") for e in self.events]
        unit = BURST_UNITS.get(self.kind, "")
        if all(counts) and unit:  # "N cached prefix blocks …": how many, and how fast (the first N came before `first`)
            numbers = [int(m.group(1)) for m in counts if m]
            text += f": {sum(numbers):,} {unit}"
            if span > 0:
                text += f", {fmt.rate(sum(numbers[1:]) / span)} {unit}/s"
        elif span > 0:
            text += f", {fmt.rate((len(self.events) - 1) / span)}/s"
        return text


def fold(events: list[dict]) -> list[dict | Burst]:
    """Events oldest first, each run of a bursty kind (two or more) folded into one Burst."""
    rows: list[dict | Burst] = []
    open_runs: dict[str, Burst] = {}
    for e in events:
        kind = e.get("kind") or "?"
        if kind not in BURSTY_EVENTS:
            rows.append(e)
            continue
        run = open_runs.get(kind)
        if run is None or (e.get("ts") or 0.0) - run.ts > BURST_GAP_S:
            run = open_runs[kind] = Burst(kind)
            rows.append(run)
        run.events.append(e)
    out = [r.events[0] if isinstance(r, Burst) and len(r.events) == 1 else r for r in rows]
    return sorted(out, key=lambda r: r.ts if isinstance(r, Burst) else r.get("ts") or 0.0)


DERIVED_NONE_YET = (
    "none derived yet: /metrics carries counts, not events — kvtop marks preemptions, rejections, KV usage past "
    "90 %, the queue growing and the prefix hit rate collapsing as they show in the counts"
)


class EventsPanel(Panel):
    TITLE = "Events"

    def draw(self, view: View, width: int, height: int) -> Text:
        verbose = view.state.verbose_events
        events = [e for e in view.events if verbose or e.get("kind") in NOTABLE_EVENTS]
        set_border(self, f"Events ({'all' if verbose else 'notable'}; v toggles)")
        if not events and "unavailable" in view.frame:  # another engine's /metrics: events are kvtop's own reading
            return fmt.lines([Text(line, "dim italic") for line in textwrap.wrap(DERIVED_NONE_YET, max(8, width))])
        if not events:
            return fmt.lines([Text("no notable events yet" if not verbose else "no events yet", "dim italic")])
        now = view.frame.get("ts", 0)
        shown = (events if verbose else fold(events))[-height:]
        ids = [(r.get("seq_id") or "") for r in shown if isinstance(r, dict)]
        id_width = min(max((len(i) for i in ids), default=0), max(12, width - 40))
        rows = []
        for r in shown:
            if isinstance(r, Burst):
                ts, kind, seq_id, detail = r.ts, r.kind, "", r.detail()
            else:
                ts, kind, seq_id, detail = r.get("ts", now), r.get("kind", "?"), r.get("seq_id") or "", r.get("detail")
            rows.append(
                Text.assemble(
                    (f"{ts - now:>+8.1f}s ", "dim"),
                    (f"{kind:<16}", KIND_STYLES.get(kind, "")),
                    (f"{seq_id[:id_width]:<{id_width}} ", "bold"),
                    str(detail or ""),
                )
            )
        return fmt.lines(rows, height)
