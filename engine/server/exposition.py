"""Prometheus exposition of the `kvtop_…` metrics, whose names live in kvtop/protocol/metric_names.py
(DESIGN §6; the tools read the same names). Values are read once per scrape from the engine's
counters and gauges (`EngineLoop.gauges`: the stats frame's sections and keys, less the
per-sequence rows, the block map and the percentiles, which no metric carries) — the same numbers
`kvctl status` and the dashboard show — through a collector in a dedicated
registry (never the process-global one), beside prometheus-client's `process_*`/`python_*`
collectors. Histograms carry the engine's own bucket counts, i.e. vLLM's buckets
(engine/telemetry/metrics.py); the per-request ones come from `RequestStats`, which the API feeds.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.drain import EngineState
from engine.telemetry.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, RequestStats
from kvtop.protocol import metric_names as M

if TYPE_CHECKING:
    from engine.server.loop import EngineLoop

CONTENT_TYPE = CONTENT_TYPE_LATEST

HISTOGRAMS = {
    "ttft": (M.TTFT, TTFT_BUCKETS, "Time to first token."),
    "itl": (M.ITL, ITL_BUCKETS, "Time between consecutive output tokens."),
    "e2e": (M.E2E, E2E_BUCKETS, "Request latency from arrival to the last token."),
    "queue": (M.QUEUE_TIME, E2E_BUCKETS, "Time from arrival to first being scheduled."),
}
BLOCK_STATES = {".": "free", "c": "cached", "u": "used", "s": "shared", "o": "offloaded"}
ENGINE_STATES = tuple(s.value for s in EngineState)  # running, draining, drained


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _histogram(name: str, doc: str, bounds: tuple[float, ...] | None, summary: dict) -> HistogramMetricFamily:
    counts = summary["counts"]
    bounds = summary["buckets"] if bounds is None else bounds
    if list(summary["buckets"]) != list(bounds) or len(counts) != len(bounds) + 1:
        raise ValueError(f"{name}: the engine's buckets differ from the declared ones")
    cumulative, buckets = 0, []
    for le, c in zip(bounds, counts, strict=False):
        cumulative += c
        buckets.append((floatToGoString(le), cumulative))
    buckets.append(("+Inf", max(summary["count"], cumulative)))  # never below the last bucket
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=summary["sum"])


class GaugesCollector(Collector):
    """Turns the engine's counters and gauges (and the request stats), read once per scrape, into metric families."""

    def __init__(self, loop: EngineLoop, requests: RequestStats) -> None:
        self.loop = loop
        self.requests = requests
        config = loop.engine.config
        self.labels = {"model_name": config.served_model_name or config.model, "engine": "0"}
        self._saved_lock = threading.Lock()
        self._saved = (0, 0.0)  # (prefix hit tokens, saved prefill seconds) at the last scrape

    def collect(self):
        f = self.loop.gauges()
        for family in (*self._scheduler(f), *self._kv(f), *self._prefix(f), *self._counters(f), *self._engine(f),
                       *self._histograms(f)):  # fmt: skip
            family.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield family

    def _scheduler(self, f: dict):
        sched = f["scheduler"]
        yield _gauge(M.NUM_REQUESTS_RUNNING, "Requests running (holding KV blocks).", sched["running"])
        yield _gauge(M.NUM_REQUESTS_WAITING, "Requests waiting to be scheduled.", sched["waiting"])
        yield _gauge(M.NUM_REQUESTS_SWAPPED, "Requests swapped out to the CPU tier.", sched["swapped"])
        yield _gauge(M.NUM_ACTIVE_TOKENS, "Tokens of running requests held in the KV cache.", sched["active_tokens"])
        yield _gauge(M.REQUESTS_IN_FLIGHT, "Engine requests the server has in flight.", f["server"]["in_flight"])
        yield _counter(M.NUM_PREEMPTIONS, "Preemptions (blocks taken back from a running request).",
                       sched["preemptions_total"])  # fmt: skip

    def _kv(self, f: dict):
        kv = f["kv"]
        yield _gauge(M.KV_CACHE_USAGE, "Fraction of KV blocks held by requests, used + shared (0-1).", kv["usage"])
        yield _gauge(M.KV_CACHE_PEAK_USAGE, "Highest kv_cache_usage_perc since the engine started (0-1).",
                     kv.get("peak_usage", kv["usage"]))  # fmt: skip
        blocks = GaugeMetricFamily(
            M.KV_CACHE_BLOCKS,
            "KV blocks by state, as the block map: free (not cached), cached, used (not shared), shared, "
            "offloaded (in the CPU tier).",
            labels=["state"],
        )
        for state in BLOCK_STATES.values():  # the frame's counts: one meaning per number on every surface
            blocks.add_metric([state], kv[state])
        yield blocks
        yield _gauge(M.KV_CACHE_ALLOCATABLE, "KV blocks a new request can get: free + cached.", kv["allocatable"])
        yield _gauge(M.KV_CACHE_NUM_BLOCKS, "KV blocks on the device.", kv["num_blocks"])
        yield _gauge(M.KV_CACHE_BLOCK_SIZE, "Tokens per KV block.", kv["block_size"])
        yield _gauge(M.KV_CACHE_BYTES_PER_TOKEN, "KV bytes per token (all layers, K and V).", kv["bytes_per_token"])
        yield _gauge(M.KV_CACHE_BYTES, "KV cache size in bytes.", kv.get("total_bytes", 0))
        yield _gauge(M.KV_CACHE_USED_BYTES, "KV bytes held by requests.", kv.get("used_bytes", 0))
        cpu = kv["cpu"]
        yield _gauge(M.CPU_CACHE_NUM_BLOCKS, "KV blocks in the CPU tier.", cpu["num_blocks"])
        yield _gauge(M.CPU_CACHE_USED_BLOCKS, "CPU-tier KV blocks in use.", cpu["used"])
        yield _gauge(M.CPU_CACHE_USAGE, "Fraction of CPU-tier blocks in use (0-1).",
                     cpu["used"] / cpu["num_blocks"] if cpu["num_blocks"] else 0.0)  # fmt: skip
        config = self.loop.engine.config
        info = GaugeMetricFamily(M.CACHE_CONFIG_INFO, "The KV cache's configuration (as vLLM's cache_config_info).",
                                 labels=["block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype",
                                         "enable_prefix_caching", "gpu_memory_utilization"])  # fmt: skip
        info.add_metric([str(kv["block_size"]), str(kv["num_blocks"]), str(cpu["num_blocks"]), str(kv.get("dtype")),
                         str(f["prefix"]["enabled"]), str(config.gpu_memory_utilization)], 1.0)  # fmt: skip
        yield info

    def _prefix(self, f: dict):
        prefix = f["prefix"]
        yield _counter(M.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.", prefix["query_tokens"])
        yield _counter(M.PREFIX_CACHE_HITS, "Prompt tokens served from the prefix cache.", prefix["hit_tokens"])
        yield _counter(M.PREFIX_CACHE_EVICTIONS, "Cached prefix blocks dropped.", prefix.get("evictions", 0))
        yield _gauge(M.PREFIX_CACHE_HIT_RATE, "Prefix-cache hits over queries, in tokens (0-1).", prefix["hit_rate"])
        yield _counter(M.PREFIX_CACHE_SAVED_PREFILL, "Prefill time saved by prefix hits (estimate: new hits times "
                       "the prefill seconds per token measured when scraped).", self._saved_prefill(prefix))  # fmt: skip

    def _saved_prefill(self, prefix: dict) -> float:
        """A counter: new hits are priced at today's prefill speed; what was saved stays saved."""
        hits = prefix["hit_tokens"]
        with self._saved_lock:
            last_hits, saved = self._saved
            if hits > last_hits and prefix["saved_prefill_s"] > 0:
                saved += (hits - last_hits) * prefix["saved_prefill_s"] / hits
                last_hits = hits
            self._saved = (last_hits, saved)
            return saved

    def _counters(self, f: dict):
        counters, server = f.get("counters", {}), f["server"]
        prompt_tokens, _ = self.requests.read()
        yield _counter(M.PROMPT_TOKENS, "Prompt tokens of requests that produced a token, prefix hits included (as "
                       "vLLM's).", prompt_tokens)  # fmt: skip
        yield _counter(M.PROMPT_TOKENS_COMPUTED, "Prompt tokens run through the model (prefix hits excluded, "
                       "recomputed ones included).", counters.get("prompt_tokens", 0))  # fmt: skip
        yield _counter(M.GENERATION_TOKENS, "Tokens generated.", counters.get("generation_tokens", 0))
        success = CounterMetricFamily(M.REQUEST_SUCCESS, "Requests finished, by reason.", labels=["finished_reason"])
        for reason in sorted({"stop", "length", "abort", *server["finish_reasons"]}):
            success.add_metric([reason], server["finish_reasons"].get(reason, 0))
        yield success
        rejected = CounterMetricFamily(M.REQUESTS_REJECTED, "Requests refused at admission.", labels=["reason"])
        for reason in sorted({"queue_full", "draining", *server["rejected"]}):
            rejected.add_metric([reason], server["rejected"].get(reason, 0))
        yield rejected
        snaps = CounterMetricFamily(M.SNAPSHOTS, "Snapshots written, by reason.", labels=["reason"])
        for reason, n in sorted(self.loop.snapshot_counts.items()):
            snaps.add_metric([reason], n)
        yield snaps

    def _engine(self, f: dict):
        eng = f["engine"]
        yield _counter(M.ENGINE_STEPS, "Engine steps run.", eng["step"])
        state = GaugeMetricFamily(M.ENGINE_STATE, "Engine state (1 for the current one).", labels=["state"])
        for s in ENGINE_STATES:
            state.add_metric([s], 1.0 if eng["state"] == s else 0.0)
        yield state
        yield _gauge(
            M.ENGINE_DRAINING, "1 while draining or drained, else 0.", 0.0 if eng["state"] == "running" else 1.0
        )
        yield _gauge(M.UPTIME, "Seconds since the engine started.", eng["uptime_s"])
        mem = f.get("memory", {})
        yield _gauge(M.MEMORY_DEVICE_USED, "Device memory in use (RSS on CPU).", mem.get("device_used", 0))
        yield _gauge(M.MEMORY_WEIGHTS, "Model weight bytes.", mem.get("weights", 0))

    def _histograms(self, f: dict):
        for key, (name, bounds, doc) in HISTOGRAMS.items():
            yield _histogram(name, doc, bounds, f["latency"][key])
        iteration = self.loop.engine.metrics.iteration.counts_only()
        yield _histogram(M.ITERATION_TOKENS, "Tokens computed per engine step (prompt + generated).", None, iteration)
        _, hists = self.requests.read()
        for key, (name, doc) in M.REQUEST_HISTOGRAMS.items():
            yield _histogram(name, doc, None, hists[key])


class ServerRegistry(CollectorRegistry):
    """The server's registry; `requests` is what the API observes per request (RequestStats)."""

    requests: RequestStats


def make_registry(loop: EngineLoop) -> ServerRegistry:
    registry = ServerRegistry(auto_describe=False)
    registry.requests = RequestStats(loop.engine.max_model_len)
    registry.register(GaugesCollector(loop, registry.requests))
    # what prometheus-client's default registry exports (process_*, python_*), as vLLM's /metrics
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
