"""The fleet as a rich table: one engine a line, `-` where the engine does not say, or said
something that is not a usable number (NaN, ±Inf, 1e308: `kvtop.sources.prometheus.number`)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from kvtop.fleet.poller import Row
from kvtop.sources.prometheus import number


def pct(v: float | None) -> str:
    v = number(v)
    return "-" if v is None else f"{v * 100:.1f} %"


def ms(v: float | None) -> str:
    v = number(v)
    return "-" if v is None else f"{v * 1000:.0f}"


def n(v) -> str:
    if number(v) is None:
        return "-"
    return str(v)


def rate(v: float | None) -> str:
    """A per-second rate rounded for reading (0.086, 1.3, 12), as the dashboard's."""
    v = number(v)
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2f}" if v >= 0.01 else f"{v:.3f}"


def fleet_table(rows: list[Row]) -> Table:
    t = Table(box=None, header_style="bold", title=f"{len(rows)} engines", title_justify="left")
    for col in ("engine", "kind", "model", "KV", "running", "waiting", "preempt/s", "prefix hit", "TTFT p99 ms",
                "ITL p99 ms", "state"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("engine", "kind", "model", "state") else "right")
    for r in rows:
        state = Text("ok", "green") if r.state == "ok" else Text(f"{r.state}: {r.error or ''}"[:60], "red")
        t.add_row(
            Text(r.url), r.kind or "-", Text(r.model or "-"), pct(r.kv_usage), n(r.running), n(r.waiting),
            rate(r.preemptions_per_s), pct(r.prefix_hit_rate), ms(r.ttft_p99), ms(r.itl_p99), state,
        )  # fmt: skip
    return t
