"""The fleet as a rich table (`kvctl status` of several engines): one engine a line, state first,
`–` where the engine does not say, or said something that is not a usable number (NaN, ±Inf,
1e308), as everywhere in kvtop (kvtop/fmt.py)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from kvtop.fleet.poller import Row
from kvtop.fmt import NONE, count, ms, pct, rate


def fleet_table(rows: list[Row]) -> Table:
    t = Table(box=None, header_style="bold", title=f"{len(rows)} engines", title_justify="left")
    for col in ("engine", "state", "kind", "model", "KV", "running", "waiting", "preempt/s", "prefix hit",
                "TTFT p99 ms", "ITL p99 ms"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("engine", "kind", "model", "state") else "right")
    for r in rows:
        state = Text("ok", "green") if r.state == "ok" else Text(f"{r.state}: {r.error or ''}"[:60], "red")
        t.add_row(
            Text(r.url), state, r.kind or NONE, Text(r.model or NONE), pct(r.kv_usage), count(r.running),
            count(r.waiting), rate(r.preemptions_per_s), pct(r.prefix_hit_rate), ms(r.ttft_p99), ms(r.itl_p99),
        )  # fmt: skip
    return t
