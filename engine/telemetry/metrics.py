"""Engine metrics: latency histograms (vLLM's buckets), counters, throughput windows, events.

The engine updates these on every step; `engine.telemetry.stats` turns them into the stats frame. The
per-request figures vLLM exports (prompt and generation lengths, prefill/decode/inference time,
`n`, `max_tokens`) are observed by the server as requests finish (`RequestStats`).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from engine.sequence import SequenceState
from kvtop.protocol.stats_math import percentiles

# vLLM's histogram buckets, so figures compare with a vLLM deployment's dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # tokens in one step
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n
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
        # the first bucket whose bound is >= value (Prometheus' `le`); bisect, not np.searchsorted,
        # which makes an array of the tuple on every call (several us a step, twice a decode step)
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.values.append(value)
        self.recent.append((now or time.time(), value))

    def counts_only(self) -> dict:
        """Buckets, counts and sum without percentiles: what a Prometheus scrape needs, cheaply."""
        counts = list(self.counts)
        return {"buckets": list(self.buckets), "counts": counts, "count": sum(counts), "sum": self.sum}

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
    """P50, P95 and P99 as numpy's default computes them (np.sort: several times faster than sorted())."""
    p50, p95, p99 = percentiles(np.sort(np.fromiter(values, dtype=float)), (50, 95, 99), presorted=True)
    return {"p50": p50, "p95": p95, "p99": p99}


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
        self.iteration = Histogram(ITERATION_BUCKETS)  # tokens computed per step (prompt + generated)
        self._step_tokens = 0
        self._evictions_unreported = 0
        self._evictions_reported_at = 0.0

    def observe_kv_usage(self, usage: float) -> None:
        """The KV usage now (blocks held / blocks): the peak the frame reports never falls below it."""
        self.peak_kv_usage = max(self.peak_kv_usage, usage)

    def event(self, kind: str, seq_id: str | None = None, detail: str = "") -> dict:
        """Append an event to the ring; returns it (a snapshot that fails takes its own back)."""
        # every frame and snapshot carries the ring: text that cannot be UTF-8 (a lone surrogate
        # from a client) would make each of them fail to encode until it aged out
        event = {"ts": time.time(), "kind": kind, "seq_id": _utf8(seq_id), "detail": _utf8(detail)}
        self.events.append(event)
        return event

    # ---- what the engine reports of its requests, from its step -----------------------------
    def scheduled(self, batch, now: float) -> None:
        """A schedule's events (preempted, swapped, scheduled) and each new request's queue time."""
        for seq in batch.preempted:
            if seq.state is SequenceState.SWAPPED:
                self.event("swapped", seq.seq_id, f"out: {len(seq.host_table)} blocks to the CPU tier")
            else:
                self.event("preempted", seq.seq_id, f"recompute; {seq.num_tokens} tokens")
        for seq in batch.swapped_in:
            self.event("swapped", seq.seq_id, f"in: {len(seq.block_table)} blocks from the CPU tier")
        for seq in batch.admitted:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
                self.queue.observe(now - seq.metrics.arrival_time, now)
                self.event("scheduled", seq.seq_id, f"{seq.num_cached_tokens} cached tokens")

    def prefix_evictions(self, evicted: int, now: float, where: str) -> None:
        """At most one `prefix_evicted` event a second: a thrash must show without flooding the log."""
        self._evictions_unreported += evicted
        if self._evictions_unreported and now - self._evictions_reported_at >= 1.0:
            self.event(
                "prefix_evicted", None, f"{self._evictions_unreported} cached prefix blocks reallocated ({where})"
            )
            self._evictions_unreported, self._evictions_reported_at = 0, now

    def token(self, seq, now: float) -> None:
        """A sequence got its token at `now`: the count, its TTFT (the first) or inter-token latency."""
        self.counters.generation_tokens += 1
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.ttft.observe(now - m.arrival_time, now)
            self.event("first_token", seq.seq_id, f"ttft {now - m.arrival_time:.3f} s")
        else:
            itl = now - m.last_token_time
            m.itls.append(itl)
            self.itl.observe(itl, now)
        m.last_token_time = now

    def finished(self, seq, now: float) -> None:
        """A sequence ended at `now` (the scheduler has set its reason): its counter, E2E, event."""
        seq.metrics.finished_time = now
        reason, detail = seq.finish_reason, seq.finish_detail
        if reason == "abort":
            self.counters.requests_aborted += 1
            self.event("aborted", seq.seq_id, detail)
        elif reason == "error":
            self.counters.requests_failed += 1
            self.event("failed", seq.seq_id, detail)
        else:
            self.counters.requests_finished += 1
            self.e2e.observe(now - seq.metrics.arrival_time, now)
            self.event("finished", seq.seq_id, f"{reason}: {seq.num_output_tokens} tokens")

    def record_step(self, now: float) -> None:
        c = self.counters
        self._rate_samples.append((now, c.prompt_tokens, c.generation_tokens, c.requests_finished))
        tokens = c.prompt_tokens + c.generation_tokens
        if tokens > self._step_tokens:
            self.iteration.observe(tokens - self._step_tokens, now)
        self._step_tokens = tokens

    def account_step(self, batch, elapsed: float) -> None:
        """A step's prompt tokens, and its prefill tokens with their share of the step's time."""
        c = self.counters
        prefill_tokens = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                c.prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            if n > 1:
                prefill_tokens += n
        if prefill_tokens:
            c.prefill_tokens += prefill_tokens
            c.prefill_seconds += elapsed * prefill_tokens / batch.num_tokens

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


def one_two_five(limit: int) -> tuple[int, ...]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50… up to `limit`."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > limit:
                return tuple(out)
            out.append(v)
        exp += 1


class RequestStats:
    """vLLM's per-request histograms and its meaning of prompt tokens, observed by the server from
    each request's outputs (the event-loop thread) and read by scrapes (other threads): one lock.

    Times follow vLLM V1: prefill = first token - first scheduled, decode = last token - first
    token, inference = last token - first scheduled, time per output token = decode / (tokens - 1)."""

    def __init__(self, max_model_len: int) -> None:
        lengths = one_two_five(max_model_len)
        self.lock = threading.Lock()
        self.prompt_tokens = 0  # whole prompts, prefix hits included, counted at their first token (vLLM's)
        self.hist = {
            "prompt": Histogram(lengths),
            "generation": Histogram(lengths),
            "max_tokens": Histogram(lengths),
            "max_generation": Histogram(lengths),
            "n": Histogram(N_BUCKETS),
            "prefill": Histogram(E2E_BUCKETS),
            "decode": Histogram(E2E_BUCKETS),
            "inference": Histogram(E2E_BUCKETS),
            "tpot": Histogram(ITL_BUCKETS),
        }
        for h in self.hist.values():  # no raw values: percentiles of these are nobody's
            h.values, h.recent = deque(maxlen=1), deque(maxlen=1)

    def first_token(self, prompt_len: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_len

    def finished(self, prompt_len: int, generated: int, max_tokens: int, m) -> None:
        """One engine request done; `m` its RequestMetrics (None when it never reached the engine)."""
        with self.lock:
            h = self.hist
            h["prompt"].observe(prompt_len)
            h["generation"].observe(generated)
            h["max_tokens"].observe(max_tokens)
            if m is None or m.first_token_time is None or m.first_scheduled_time is None:
                return
            last = m.last_token_time or m.first_token_time
            h["prefill"].observe(max(0.0, m.first_token_time - m.first_scheduled_time))
            h["decode"].observe(max(0.0, last - m.first_token_time))
            h["inference"].observe(max(0.0, last - m.first_scheduled_time))
            if generated > 1:
                h["tpot"].observe(max(0.0, (last - m.first_token_time) / (generated - 1)))

    def group_finished(self, n: int, max_generated: int) -> None:
        """One HTTP request's choices (of one prompt) all done: its `n` and its longest choice."""
        with self.lock:
            self.hist["n"].observe(n)
            self.hist["max_generation"].observe(max_generated)

    def read(self) -> tuple[int, dict[str, dict]]:
        with self.lock:
            return self.prompt_tokens, {k: h.counts_only() for k, h in self.hist.items()}


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
