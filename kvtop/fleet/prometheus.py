"""`PrometheusFleet`: every engine a Prometheus server scrapes, found and aggregated by Prometheus.

The scale-out path: kvtop asks Prometheus' HTTP API, not the engines. `/api/v1/targets` lists the
engines (their scrape URL, health and last error); one PromQL query per figure and engine kind,
built from the same tables as `MetricsSource` (`kvtop/sources/mappings/`), gives each figure for
every instance at once (`sum by (instance)`, `rate(…[30s])`, `histogram_quantile(0.99, …[1m])`).
A round is a fixed number of requests to one server, whatever the fleet's size, each bounded in
size (MAX_ANSWER_BYTES) and in time as a whole (the timeout, `kvtop/sources/fetch.py`). A figure
Prometheus answers that no engine can have (NaN, ±Inf, a negative count, a usage above 1) is left
out of its row, as `MetricsSource` leaves it out of a frame. Every query of a round is evaluated at
one instant, SETTLE_S before Prometheus' own now: queried each at its own now, one figure of a row
could come from a scrape that landed between two queries and the next from the scrape before it (a
vLLM's p99 from its new page beside its running count from the old one).
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx

from kvtop.fleet.poller import Row
from kvtop.rates import RATE_WINDOW_S
from kvtop.sources import fetch
from kvtop.sources.mappings import Mapping, all_mappings
from kvtop.sources.prometheus import number

WINDOW = "1m"  # percentiles over the last minute, as the local fleet's (kvtop/sources/metrics.py WINDOW_S)
RATE = f"{RATE_WINDOW_S:.0f}s"  # rates over the window kvtop's own rates use (kvtop/rates.py)
MAX_ANSWER_BYTES = 64 * fetch.MiB  # /api/v1/targets of thousands of targets (most not engines) runs to tens of MiB
FRACTIONS = ("kv_usage", "prefix_hit_rate")  # row fields that are at most 1
SETTLE_S = 1.0  # a scrape that started before the round's instant has landed by the time it is asked


def _any(names: tuple[str, ...], agg: str) -> str:
    return " or ".join(f"{agg} by (instance) ({name})" for name in names)


def queries(m: Mapping) -> dict[str, str]:
    """Row field -> PromQL giving it for every instance of engine kind `m` (absent fields: no query)."""
    q = {"model": f'count by (instance, model_name) ({{__name__=~"{m.prefix}.+"}})'}
    if {"prefix.hit_tokens", "prefix.query_tokens"} <= m.counters.keys():  # 0 / 0 (nothing looked up) is NaN: no rate
        hits, asked = m.counters["prefix.hit_tokens"], m.counters["prefix.query_tokens"]
        q["prefix_hit_rate"] = f"({_any(hits, 'sum')}) / ({_any(asked, 'sum')})"
    for field, path, agg in (("kv_usage", "kv.usage", "max"), ("running", "scheduler.running", "sum"),
                             ("waiting", "scheduler.waiting", "sum"), ("prefix_hit_rate", "prefix.hit_rate", "max")):  # fmt: skip
        if path in m.gauges and field not in q:  # an engine's own hit-rate gauge only where it serves no counts
            q[field] = _any(m.gauges[path], agg)
    if "scheduler.preemptions_total" in m.counters:
        names = tuple(f"rate({n}[{RATE}])" for n in m.counters["scheduler.preemptions_total"])
        q["preemptions_per_s"] = _any(names, "sum")
    for field, key in (("ttft_p99", "ttft"), ("itl_p99", "itl")):
        if key in m.histograms:
            q[field] = f"histogram_quantile(0.99, sum by (instance, le) (rate({m.histograms[key]}_bucket[{WINDOW}])))"
    return q


def figure(field: str, value: float) -> float | int | None:
    """A row field from Prometheus' answer, or None for one no engine can have (NaN, ±Inf, past
    MAX_VALUE, negative: every figure is a count, a rate, a time or a fraction at most 1)."""
    value = number(value)
    if value is None or value < 0 or (field in FRACTIONS and value > 1):
        return None
    return int(value) if field in ("running", "waiting") else value


def state_of(target: dict, kind: str | None) -> tuple[str, str | None]:
    """ok / unreachable / not metrics / slow, from Prometheus' own view of the target."""
    error = target.get("lastError") or None
    if target.get("health") == "down":
        if "deadline exceeded" in (error or "") or "timeout" in (error or "").lower():
            return "slow", error
        if "dial tcp" in (error or "") or "connection" in (error or ""):
            return "unreachable", error
        return "not metrics", error
    if target.get("health") != "up":
        return "unreachable", error or "not scraped yet"
    if kind is None:
        return "not metrics", "it serves no vLLM, SGLang, llama.cpp or kvtop metrics"
    return "ok", None


class PrometheusFleet:
    def __init__(self, url: str, timeout: float = 3.0, interval: float = 2.0) -> None:
        u = httpx.URL(url if "://" in url else f"http://{url}")
        if u.scheme not in ("http", "https") or not u.host:
            raise ValueError(f"{url!r} is not an http(s) URL")
        self.base = str(u).rstrip("/")
        self.timeout, self.interval = timeout, interval
        self.title = f"engines scraped by Prometheus at {self.base}"
        self._client = fetch.client(timeout)
        self._pool = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="prom")

    def _get(self, path: str, **params) -> dict | list:
        r = fetch.fetch(self._client, f"{self.base}{path}", params=params, max_bytes=MAX_ANSWER_BYTES,
                        deadline_s=self.timeout, what=f"Prometheus' answer to {path}")  # fmt: skip
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise ValueError(f"Prometheus answered HTTP {r.status_code}: {body.get('error', '')}".rstrip(": "))
        return body["data"]

    def _query(self, promql: str, at: float) -> list[tuple[dict, float]]:
        data = self._get("/api/v1/query", query=promql, time=f"{at:.3f}")
        return [(s["metric"], float(s["value"][1])) for s in data.get("result", [])]

    def _now(self) -> float:
        """Prometheus' own clock, in Unix seconds (kvtop's host may keep another time)."""
        data = self._get("/api/v1/query", query="time()")
        result = data.get("result") if isinstance(data, dict) and data.get("resultType") == "scalar" else None
        if not isinstance(result, list) or len(result) != 2:
            raise ValueError("Prometheus answered time() with no scalar")
        return float(result[0])

    def poll(self) -> list[Row]:
        """One round; a Prometheus that cannot be asked is one row saying why."""
        try:
            return self._round()
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError, RecursionError,
                fetch.PageTooLarge, fetch.PageTooSlow) as exc:  # fmt: skip  # not a Prometheus, or not in time
            return [Row(self.base, "unreachable", f"Prometheus: {type(exc).__name__}: {exc}"[:200])]

    def _round(self) -> list[Row]:
        deadline = time.monotonic() + self.timeout + 1.0
        targets = self._get("/api/v1/targets", state="active")["activeTargets"]
        at = self._now() - SETTLE_S  # one instant for every query of the round: a row is one scrape's
        asked = {
            (m.kind, f): self._pool.submit(self._query, q, at) for m in all_mappings() for f, q in queries(m).items()
        }
        cf.wait(list(asked.values()), timeout=max(0.0, deadline - time.monotonic()))
        found: dict[str, dict] = {}  # instance -> row fields
        for (kind, field), future in asked.items():
            if not future.done() or future.exception() is not None:
                continue
            for labels, value in future.result():
                fields = found.setdefault(labels.get("instance", ""), {})
                fields.setdefault("kind", kind)
                if field == "model":
                    fields["model"] = fields.get("model") or labels.get("model_name") or None
                elif (usable := figure(field, value)) is not None:
                    fields[field] = usable
        rows = []
        for t in targets:
            fields = found.get(t.get("labels", {}).get("instance", ""), {})
            state, error = state_of(t, fields.get("kind"))
            rows.append(Row(url=t.get("scrapeUrl", "?"), state=state, error=error, **fields))
        return rows

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
