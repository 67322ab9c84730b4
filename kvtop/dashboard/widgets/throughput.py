"""Throughput: prompt and generation tokens/s, requests/s, preemptions/s and rejections/s (429 queue
full, 503 draining), each with a sparkline; then the totals."""

from __future__ import annotations

from rich.text import Text

from kvtop import fmt
from kvtop.dashboard.widgets import series
from kvtop.dashboard.widgets.header import rejected_summary
from kvtop.dashboard.widgets.view import Panel, View
from kvtop.rates import RATE_WINDOW_S

LINES = (  # label, style, how to get the series
    ("prompt tok/s", "cyan", "throughput.prompt_tokens_per_s"),
    ("gen tok/s", "green", "throughput.generation_tokens_per_s"),
    ("requests/s", "blue", "throughput.requests_per_s"),
)


class ThroughputPanel(Panel):
    TITLE = "Throughput"

    def draw(self, view: View, width: int, height: int) -> Text:
        spark_w = max(4, width - 22)
        hist = series.bucketed(view.history, spark_w * 4, reduce=lambda fs: fs[-1])
        rows = []
        for label, style, path in LINES:
            vals = series.values(hist, path)
            now = series.get(view.frame, path, None)  # – where the frame has no usable rate, not 0
            rows.append(
                Text.assemble(
                    (f"{label:<13}", "bold"),
                    f"{fmt.rate(now):>7} ",
                    (fmt.sparkline(series.bucketed(vals, spark_w), spark_w), style),
                )
            )
        pre = series.rates(hist, "scheduler.preemptions_total")
        rows.append(
            self._rate_row("preempt/s", series.latest_rate(view.history, "scheduler.preemptions_total"), pre, spark_w)
        )
        known = rejected_total(view.frame) is not None  # frames from `kvctl run` or `LLM` have no server part
        totals = [{"ts": f["ts"], "engine": f.get("engine"), "n": rejected_total(f)} for f in hist]
        since = view.frame.get("ts", 0) - RATE_WINDOW_S  # the rate's window: only its frames are copied
        latest = [{"ts": f["ts"], "engine": f.get("engine"), "n": rejected_total(f)}
                  for f in view.history if f.get("ts", 0) >= since]  # fmt: skip
        now = series.latest_rate(latest, "n") if known else None
        rows.append(self._rate_row("rejected/s", now, series.rates(totals, "n") if known else [], spark_w))
        s = view.frame.get("scheduler", {})
        c = view.frame.get("counters", {})
        refused = rejected_summary(view.frame)
        if "counters" not in view.frame:  # another engine's /metrics: its totals, where it has them
            preempted = s.get("preemptions_total")
            rows.append(fmt.label_value("totals", f"{fmt.NONE if preempted is None else preempted} preemptions", 13))
            return fmt.lines(rows, height)
        rows.append(
            fmt.label_value(
                "totals",
                f"{s.get('preemptions_total', 0)} preemptions · {c.get('requests_finished', 0)} finished · "
                f"{c.get('requests_aborted', 0)} aborted" + (f" · {refused or '0 rejected'}" if known else ""),
                13,
            )
        )
        return fmt.lines(rows, height)

    @staticmethod
    def _rate_row(label: str, now: float | None, rates: list[float], spark_w: int) -> Text:
        return Text.assemble(
            (f"{label:<13}", "bold"),
            f"{fmt.rate(now):>7} ",
            (fmt.sparkline(series.bucketed(rates, spark_w), spark_w), "red"),
        )


def rejected_total(frame: dict) -> int | None:
    """Requests the server refused since it started (429 queue full, 503 draining, …), or another
    engine's count of requests its queue limits turned away (vLLM's admission rejections); None
    where the frame has neither (frames from `kvctl run` or `LLM`: nothing refuses requests there)."""
    rejected = (frame.get("server") or {}).get("rejected")
    if rejected is None:
        return (frame.get("scheduler") or {}).get("rejections_total")
    return sum(rejected.values())
