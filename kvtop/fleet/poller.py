"""`Fleet`: one `MetricsSource` per target, polled together by a bounded pool of threads.

A round waits at most `timeout` (plus a little) whatever the targets do: one that hangs or answers
garbage is marked in its row and never holds up the others, and one whose page kvtop fails on
(a bug of ours a page brings out) is a row in state `error`, never the end of the fleet view. Each
target keeps its own source, so rates (preemptions/s) and last-minute percentiles come from its
own previous scrapes.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass

from kvtop.rates import window_rate
from kvtop.sources.base import SourceUnavailable
from kvtop.sources.metrics import MetricsSource

MAX_WORKERS = 32  # concurrent scrapes at most, whatever the fleet's size


@dataclass
class Row:
    """One engine's line in the fleet table; None where the engine does not say."""

    url: str
    state: str  # "ok", "unreachable" (refused, dropped), "not metrics" (no engine's page), "slow" (no answer
    # in time), "error" (kvtop failed on what the engine served)
    error: str | None = None
    kind: str | None = None
    model: str | None = None
    kv_usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions_per_s: float | None = None
    prefix_hit_rate: float | None = None
    ttft_p99: float | None = None
    itl_p99: float | None = None


def _p99(frame: dict, key: str) -> float | None:
    """Over the last minute: None before a second scrape, or when nothing was observed in it."""
    h = (frame.get("latency") or {}).get(key) or {}
    return (h.get("window") or {}).get("p99")


def row_of(url: str, frame: dict, history: list[dict]) -> Row:
    """`frame`'s row; preemptions/s over the frames of the last RATE_WINDOW_S seconds (`history`,
    oldest first, ending with `frame`), as Prometheus' `rate()`."""
    sched = frame.get("scheduler") or {}
    return Row(
        url=url, state="ok", kind=frame["engine"].get("kind"), model=frame["engine"].get("model"),
        kv_usage=(frame.get("kv") or {}).get("usage"), running=sched.get("running"), waiting=sched.get("waiting"),
        preemptions_per_s=window_rate(history, "scheduler.preemptions_total"),
        prefix_hit_rate=(frame.get("prefix") or {}).get("hit_rate"),
        ttft_p99=_p99(frame, "ttft"), itl_p99=_p99(frame, "itl"),
    )  # fmt: skip


class Fleet:
    def __init__(
        self,
        urls: list[str],
        timeout: float = 3.0,
        engine: str | None = None,
        interval: float = 2.0,
        deadline: float | None = None,
    ) -> None:
        """`timeout` per connect and read of a scrape, `deadline` for a whole page (MetricsSource's)."""
        if not urls:
            raise ValueError("no targets")
        self.timeout, self.interval = timeout, interval
        self.title = f"{len(urls)} targets, each /metrics scraped by kvtop"
        self.sources = [
            MetricsSource(u, timeout=timeout, engine=engine, deadline=deadline) for u in urls
        ]  # ValueError: a bad URL
        self._pool = cf.ThreadPoolExecutor(max_workers=min(MAX_WORKERS, len(urls)), thread_name_prefix="fleet")
        self._pending: dict[int, cf.Future] = {}  # a scrape still running from an earlier round
        self.rows: list[Row] = [Row(s.url, "unreachable", "not polled yet") for s in self.sources]

    def _scrape(self, i: int) -> Row:
        source = self.sources[i]
        try:
            frame = source.poll()
            return row_of(source.url, frame, source.history())
        except SourceUnavailable as exc:
            return Row(source.url, source.failure or "unreachable", str(exc))
        except Exception as exc:  # one engine's page must not end the round: its row says what failed
            return Row(source.url, "error", f"{type(exc).__name__}: {exc}"[:200])

    def poll(self) -> list[Row]:
        """One round: every target not still busy is scraped; returns when all answered or the time is up."""
        for i in range(len(self.sources)):
            if i not in self._pending:
                self._pending[i] = self._pool.submit(self._scrape, i)
        deadline = time.monotonic() + self.timeout + 1.0
        cf.wait(list(self._pending.values()), timeout=max(0.0, deadline - time.monotonic()))
        for i, future in list(self._pending.items()):
            if future.done():
                self.rows[i] = future.result()
                del self._pending[i]
            else:
                self.rows[i] = Row(self.sources[i].url, "slow", f"no answer in {self.timeout:g} s")
        return list(self.rows)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for s in self.sources:
            s.close()
