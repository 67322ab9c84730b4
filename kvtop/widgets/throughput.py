"""Throughput: prompt and generation tokens/s, requests/s and preemptions/s, each with a sparkline."""

from __future__ import annotations

from rich.text import Text

from kvtop.widgets import fmt, series
from kvtop.widgets.view import Panel, View

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
            now = series.get(view.frame, path)
            rows.append(
                Text.assemble(
                    (f"{label:<13}", "bold"),
                    f"{fmt.rate(now):>7} ",
                    (fmt.sparkline(series.bucketed(vals, spark_w), spark_w), style),
                )
            )
        pre = series.rates(hist, "scheduler.preemptions_total")
        pre_now = series.latest_rate(view.history, "scheduler.preemptions_total")
        rows.append(
            Text.assemble(
                ("preempt/s    ", "bold"),
                f"{fmt.rate(pre_now):>7} ",
                (fmt.sparkline(series.bucketed(pre, spark_w), spark_w), "red"),
            )
        )
        s = view.frame.get("scheduler", {})
        c = view.frame.get("counters", {})
        rows.append(
            fmt.label_value(
                "totals",
                f"{s.get('preemptions_total', 0)} preemptions · {c.get('requests_finished', 0)} finished · "
                f"{c.get('requests_aborted', 0)} aborted",
                13,
            )
        )
        return fmt.lines(rows, height)
