"""Prefix cache: hit rate in tokens and requests, tokens and prefill time saved, cached blocks,
evictions, and sparklines of the hit rate and eviction rate over the frames shown."""

from __future__ import annotations

from rich.text import Text

from kvtop import fmt
from kvtop.dashboard.widgets import series
from kvtop.dashboard.widgets.view import Panel, View


def latest_ratio(history: list[dict], num: str, den: str) -> float | None:
    """`num`'s share of `den`'s increase over the last few seconds; None where `den` did not grow."""
    d, n = series.latest_rate(history, den), series.latest_rate(history, num)
    return min(1.0, n / d) if d and n is not None else None


def _count(v: float | None) -> str:
    """A count the frame carries, or – where it does not (another engine's /metrics): never 0."""
    return fmt.NONE if v is None else f"{v:,}"


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
        # (SGLang serves its own hit rate and no lookup count: that rate is shown as it is)
        token_rate = p.get("hit_rate") if p.get("query_tokens") or "query_tokens" not in p else None
        request_rate = p.get("request_hit_rate") if p.get("queries") else None
        hit_now = latest_ratio(view.history, "prefix.hit_tokens", "prefix.query_tokens")
        saved = fmt.number(p.get("saved_prefill_s"))
        cached = (
            fmt.NONE
            if kv.get("cached") is None
            else f"{kv['cached']} blocks ({kv['cached'] * kv.get('block_size', 0)} tokens)"
        )
        rows = [
            fmt.label_value("hit rate", f"{fmt.pct(token_rate)} of tokens · {fmt.pct(request_rate)} of requests"),
            fmt.label_value(
                "hit tokens", f"{_count(p.get('hit_tokens'))} of {_count(p.get('query_tokens'))} looked up"
            ),
            fmt.label_value("requests", f"{_count(p.get('hit_requests'))} hit of {_count(p.get('queries'))}"),
            fmt.label_value("saved", f"{fmt.NONE if saved is None else f'{saved:.2f}'} s of prefill"),
            fmt.label_value("cached", cached),
            fmt.label_value("evictions", f"{_count(p.get('evictions'))} ({fmt.rate(evict_now)}/s)"),
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
