"""Latency: TTFT, ITL, e2e and queue time as histograms over vLLM's buckets, P50/P95/P99 marked.

The frame carries each histogram since start plus the last minute's count and percentiles; the
last minute's bucket counts are the difference between the newest frame and the one a minute
before it. The bars show the last minute (or, with `w`, everything since start); the percentiles
of both are printed. Under the bars `▲` marks the buckets that hold P50, P95 and P99, in order.
"""

from __future__ import annotations

from bisect import bisect_left

from rich.text import Text

from kvtop import fmt
from kvtop.dashboard.widgets import series
from kvtop.dashboard.widgets.view import Panel, View, set_border

METRICS = (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "e2e"), ("queue", "queue"))
MARGIN = 6
P_STYLES = (("p50", "green"), ("p95", "yellow"), ("p99", "red"))


def window_counts(view: View, name: str) -> tuple[list[int], str]:
    """The bucket counts of the last minute (as far as the frames reach back) and their label."""
    frame = view.frame
    counts = list(frame["latency"][name].get("counts") or [])
    if frame.get("engine", {}).get("uptime_s", 0) <= 60 or not view.history:
        return counts, "last 1m"
    then = series.frame_at_or_before(view.history, frame["ts"] - 60)
    label = "last 1m"
    if then is None:
        then = view.history[0]
        label = f"last {frame['ts'] - then['ts']:.0f}s"
    before = ((then.get("latency") or {}).get(name) or {}).get("counts") or []
    diff = [a - b for a, b in zip(counts, before)]
    if len(before) != len(counts) or any(d < 0 for d in diff):  # engine restarted in between
        return counts, "since restart"
    return diff, label


def bound(v: float) -> str:
    """A bucket bound, short, in the unit that keeps it to three figures: 2.5ms, 80ms, 1s, 7.5s,
    80s, 10.7m, 2.13h; `?` for a bound that is not a usable number (a crafted file)."""
    v = fmt.number(v)
    if v is None:
        return "?"
    if v < 1:
        return f"{v * 1e3:.3g}ms"
    if v < 120:
        return f"{v:.3g}s"
    if v < 7200:
        return f"{v / 60:.3g}m"
    return f"{v / 3600:.3g}h"


def pct_line(label: str, summary: dict) -> str:
    head = f"{label:<4}n={summary.get('count', 0):<6}"
    return head + " ".join(f"{k.upper()} {fmt.secs(summary.get(k)):>6}" for k, _ in P_STYLES)


def histogram(counts: list[int], buckets: list[float], marks: dict, width: int, lines: int) -> list[Text]:
    """At most `lines` rows for the non-empty bucket range: bars (two rows when there is room),
    a row of `▲` under the P50/P95/P99 buckets, an axis of bucket bounds. With only one line,
    the percentile buckets are drawn reversed in the bar row instead. A count that is not a usable
    number, or below 0, is drawn as 0."""
    counts = [max(0.0, fmt.number(c) or 0.0) for c in counts]
    nz = [i for i, c in enumerate(counts) if c]
    if not nz:
        return [Text(" " * MARGIN + "no observations", "dim italic")]
    rows = 2 if lines >= 4 else 1
    lo, hi = max(0, nz[0] - 1), min(len(counts) - 1, nz[-1] + 1)
    while hi - lo < 7 and (lo > 0 or hi < len(counts) - 1):
        lo, hi = max(0, lo - 1), min(len(counts) - 1, hi + 1)
    shown = range(lo, hi + 1)
    cw = max(1, min(3, (width - MARGIN) // len(shown)))
    if cw * len(shown) > width - MARGIN:  # too narrow: keep the slow end
        shown = range(max(lo, hi + 1 - (width - MARGIN)), hi + 1)
    top = max(counts[i] for i in shown) or 1
    mark_idx = {k: bisect_left(buckets, v) for k, v in marks.items() if v is not None}
    marked = set(mark_idx.values())
    p50, p95 = mark_idx.get("p50", 10**9), mark_idx.get("p95", 10**9)
    bars = [Text(" " * MARGIN) for _ in range(rows)]
    for i in shown:
        level = 0 if not counts[i] else max(1, round(counts[i] / top * 8 * rows))
        style = "green" if i <= p50 else "yellow" if i <= p95 else "red"
        if lines == 1 and i in marked:
            style += " reverse"
        for r in range(rows):  # r = 0 is the top row
            part = level - 8 * (rows - 1 - r)
            ch = " " if part <= 0 else fmt.SPARK[min(8, part) - 1]
            bars[r].append(ch * cw, style)
    out = list(bars)
    if lines >= 2:
        marker = Text("P ▲   ", "bold")
        cells = {MARGIN + (mark_idx[k] - shown.start) * cw: style for k, style in reversed(P_STYLES) if k in mark_idx}
        for col in range(MARGIN, MARGIN + cw * len(shown)):
            marker.append("▲" if col in cells else " ", cells.get(col, ""))
        out.append(marker)
    if lines >= 3:
        axis = [" "] * (MARGIN + cw * len(shown) + 8)
        axis[:MARGIN] = list("≤     ")
        end = MARGIN
        for i in shown:
            col = MARGIN + (i - shown.start) * cw
            label = bound(buckets[i]) if i < len(buckets) else "+Inf"
            if col >= end and col + len(label) <= len(axis):
                axis[col : col + len(label)] = list(label)
                end = col + len(label) + 1
        out.append(Text("".join(axis).rstrip(), "dim"))
    return out


class LatencyPanel(Panel):
    TITLE = "Latency"

    def draw(self, view: View, width: int, height: int) -> Text:
        lat = view.frame.get("latency") or {}
        per = max(2, height // len(METRICS))
        rows: list[Text] = []
        which = "since start" if view.state.latency_all else "last 1m"
        for name, title in METRICS:
            s = lat.get(name)
            if not s:
                continue
            win = s.get("window") or {}
            if view.state.latency_all:
                counts, marks = list(s.get("counts") or []), s
            else:
                counts, which, marks = (*window_counts(view, name), win)
            block = [
                Text.assemble((f"{title:<6}", "bold"), pct_line("1m", win)),
                Text.assemble(" " * 6, pct_line("all", s)),
            ]
            if per >= 3:
                marks = {k: marks.get(k) for k, _ in P_STYLES}
                block += histogram(counts, list(s.get("buckets") or []), marks, width, per - 2)
            rows += block[:per]
        subtitle = "▲ P50 P95 P99 buckets" if per >= 4 else "reversed: P50 P95 P99 buckets"
        set_border(self, f"Latency · bars: {which} (w toggles)", subtitle)  # a set repaints the panel whole
        return fmt.lines(rows, height)
