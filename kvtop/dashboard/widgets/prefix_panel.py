"""Prefix cache: hit rate in tokens and requests, tokens and prefill time saved, cached blocks,
evictions, and sparklines of the hit rate and eviction rate over the frames shown."""

from __future__ import annotations

from rich.text import Text

from kvtop.dashboard.widgets import fmt, series
from kvtop.dashboard.widgets.view import Panel, View


def latest_ratio(history: list[dict], num: str, den: str) -> float | None:
    """`num`'s share of `den`'s increase over the last few seconds; None where `den` did not grow."""
    d, n = series.latest_rate(history, den), series.latest_rate(history, num)
    return min(1.0, n / d) if d and n is not None else None


class PrefixPanel(Panel):
    TITLE = "Prefix cache"

    def draw(self, view: View, width: int, height: int) -> Text:
        p = view.frame.get("prefix", {})
        kv = view.frame.get("kv", {})
        if p.get("enabled") is False:
            return fmt.lines([Text("prefix caching is off (--no-enable-prefix-caching)", "italic")])
        spark_w = max(4, width - 20)
        hist = series.bucketed(view.history, max(spark_w, 1) * 4, reduce=lambda fs: fs[-1])
        hit = [min(1.0, r) for r in series.ratios(hist, "prefix.hit_tokens", "prefix.query_tokens")]
        evictions = series.rates(hist, "prefix.evictions")
        evict_now = series.latest_rate(view.history, "prefix.evictions")
        # with nothing looked up yet there is no hit rate (a 0 % would say the cache missed)
        token_rate = p.get("hit_rate") if p.get("query_tokens") else None
        request_rate = p.get("request_hit_rate") if p.get("queries") else None
        hit_now = latest_ratio(view.history, "prefix.hit_tokens", "prefix.query_tokens")
        rows = [
            fmt.label_value("hit rate", f"{fmt.pct(token_rate)} of tokens · {fmt.pct(request_rate)} of requests"),
            fmt.label_value("hit tokens", f"{p.get('hit_tokens', 0):,} of {p.get('query_tokens', 0):,} looked up"),
            fmt.label_value("requests", f"{p.get('hit_requests', 0):,} hit of {p.get('queries', 0):,}"),
            fmt.label_value("saved", f"{p.get('saved_prefill_s', 0.0):.2f} s of prefill"),
            fmt.label_value(
                "cached", f"{kv.get('cached', 0)} blocks ({kv.get('cached', 0) * kv.get('block_size', 0)} tokens)"
            ),
            fmt.label_value("evictions", f"{p.get('evictions', 0):,} ({fmt.rate(evict_now)}/s)"),
            Text.assemble(
                ("hit %     ", "bold"),
                (fmt.sparkline(series.bucketed(hit, spark_w), spark_w), "green"),
                f" {fmt.pct(hit_now)}",
            ),
            Text.assemble(
                ("evict/s   ", "bold"),
                (fmt.sparkline(series.bucketed(evictions, spark_w), spark_w), "yellow"),
                f" {fmt.rate(evict_now)}",
            ),
        ]
        return fmt.lines(rows, height)
