"""Engine metrics: latency histograms (vLLM's buckets), counters, throughput windows, events.

The engine updates these on every step; `engine.stats` turns them into the stats frame.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

# vLLM's histogram buckets, so figures compare with a vLLM deployment's dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
WINDOW_S = 60.0
MAX_SAMPLES = 100_000  # raw values kept for percentiles (since start, up to this many)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    count: int = 0
    sum: float = 0.0
    values: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    recent: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))  # (ts, value)

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last is +Inf

    def observe(self, value: float, now: float | None = None) -> None:
        self.count += 1
        self.sum += value
        self.counts[int(np.searchsorted(self.buckets, value, side="left"))] += 1
        self.values.append(value)
        self.recent.append((now or time.time(), value))

    def summary(self, now: float | None = None) -> dict:
        now = now or time.time()
        while self.recent and self.recent[0][0] < now - WINDOW_S:
            self.recent.popleft()
        return {
            "count": self.count,
            "sum": self.sum,
            **_percentiles(self.values),
            "buckets": list(self.buckets),
            "counts": list(self.counts),
            "window": {"seconds": WINDOW_S, "count": len(self.recent), **_percentiles([v for _, v in self.recent])},
        }


def _percentiles(values) -> dict:
    if not len(values):
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(np.fromiter(values, dtype=float), [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


@dataclass
class Counters:
    prompt_tokens: int = 0  # prompt tokens computed (prefix hits excluded)
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    prefill_tokens: int = 0  # for the measured prefill speed
    prefill_seconds: float = 0.0


class Metrics:
    """Everything the engine measures, updated from its step loop."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue = Histogram(E2E_BUCKETS)
        self.counters = Counters()
        self.events: deque[dict] = deque(maxlen=5000)
        self._rate_samples: deque[tuple[float, int, int, int]] = deque(maxlen=4096)
        self.peak_kv_usage = 0.0

    def event(self, kind: str, seq_id: str | None = None, detail: str = "") -> None:
        # every frame and snapshot carries the ring: text that cannot be UTF-8 (a lone surrogate
        # from a client) would make each of them fail to encode until it aged out
        self.events.append({"ts": time.time(), "kind": kind, "seq_id": _utf8(seq_id), "detail": _utf8(detail)})

    def record_step(self, now: float) -> None:
        c = self.counters
        self._rate_samples.append((now, c.prompt_tokens, c.generation_tokens, c.requests_finished))

    def prefill_seconds_per_token(self) -> float | None:
        c = self.counters
        return c.prefill_seconds / c.prefill_tokens if c.prefill_tokens else None

    def throughput(self, now: float, window: float = 10.0) -> dict:
        samples = self._rate_samples
        zero = {"prompt_tokens_per_s": 0.0, "generation_tokens_per_s": 0.0, "requests_per_s": 0.0}
        if not samples:
            return zero
        c = self.counters
        latest = (now, c.prompt_tokens, c.generation_tokens, c.requests_finished)
        first = next((s for s in samples if s[0] >= now - window), samples[-1])
        dt = max(latest[0] - first[0], 1e-9)
        if latest[0] - first[0] < 1e-3:
            return zero
        return {
            "prompt_tokens_per_s": (latest[1] - first[1]) / dt,
            "generation_tokens_per_s": (latest[2] - first[2]) / dt,
            "requests_per_s": (latest[3] - first[3]) / dt,
        }


def _utf8(text: str | None) -> str | None:
    """`text` as valid UTF-8 text: a lone surrogate becomes its escape (`\\udcff`)."""
    if text is None:
        return None
    text = str(text)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
