"""The replay timeline: play state and speed, position, the snapshot's trigger (and, when the
frame at the position is not a stats frame, why the last good one is still shown), and the events
along the recording as marks under a bar (`p` preemption, `e` eviction, `d` drain, `r` resume,
`a` abort, `s` snapshot; on a recording of another engine's /metrics, derived from its counters:
`p` preemptions, `x` requests rejected, `k` KV usage past 90 %, `q` the queue growing, `h` the
prefix hit rate collapsing; the most severe wins a cell)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from kvtop import fmt
from kvtop.sources import ReplaySource

MARKS = {"preempted": "p", "aborted": "a", "evicted": "e", "prefix_evicted": "e", "drain_started": "d", "drain_finished": "d",
         "resumed": "r", "snapshot": "s", "kv_full": "k", "queue_grew": "q", "rejected": "x",
         "prefix_collapsed": "h"}  # fmt: skip
SEVERITY = "pxkdaqhesr"  # earlier = more severe
MARK_STYLES = {"p": "red", "x": "red", "k": "red", "a": "red", "e": "yellow", "d": "yellow", "q": "yellow",
               "h": "yellow", "r": "green", "s": "cyan"}  # fmt: skip


def mmss(seconds: float) -> str:
    return f"{int(seconds // 60):02d}:{seconds % 60:04.1f}"


class Timeline(Static):
    """Three lines under the dashboard in replay mode."""

    def show(self, source: ReplaySource) -> None:
        width = max(10, self.content_size.width or 80)
        length = max(source.end_ts - source.start_ts, 1e-9)
        state = Text("▶ playing", "bold green") if source.playing else Text("⏸ paused", "bold yellow")
        head = Text.assemble(
            state,
            f"  ×{source.speed:g}  {mmss(source.position)} / {mmss(length)}",
            f"  frame {source.index + 1}/{len(source.frames)}  ",
            ("trigger: ", "bold"),
            (source.reason or "?", "italic"),
        )
        if source.error:  # a frame that is not a stats frame: the last good one stays on screen
            head = Text.assemble(head, "  ", (f"⚠ {source.error}", "bold red"))
            head.truncate(width * 2, overflow="ellipsis")
        pos = min(width - 1, int(source.position / length * (width - 1)))
        bar = Text.assemble(("━" * pos, "bold cyan"), ("●", "bold"), ("─" * (width - 1 - pos), "bright_black"))
        cells = [" "] * width
        for e in source.marked_events:
            mark = MARKS.get(e.get("kind", ""))
            if mark is None:
                continue
            col = min(width - 1, max(0, int((e["ts"] - source.start_ts) / length * (width - 1))))
            if cells[col] == " " or SEVERITY.index(mark) < SEVERITY.index(cells[col]):
                cells[col] = mark
        marks = Text()
        for ch in cells:
            marks.append(ch, MARK_STYLES.get(ch, ""))
        self.update(fmt.lines([head, bar, marks]))
