"""Prometheus exposition: every `kvtop_…` metric name lives here (DESIGN §6).

Names mirror vLLM's (`vllm:num_requests_running` → `kvtop_num_requests_running`) so existing
dashboards carry over, with vLLM's meaning where the name is vLLM's, and every `kvtop_` series
carries vLLM's `model_name` and `engine` labels. Values are read from one stats frame per scrape —
the same numbers `kvctl status` and the dashboard show — through a collector in a dedicated
registry (never the process-global one), beside prometheus-client's `process_*`/`python_*`
collectors. Histograms carry the engine's own bucket counts, i.e. vLLM's buckets
(engine/metrics.py); the per-request ones come from `RequestStats`, which the API feeds.
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

from engine.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, RequestStats

if TYPE_CHECKING:
    from engine.server.loop import EngineLoop

CONTENT_TYPE = CONTENT_TYPE_LATEST
P = "kvtop_"

# gauges
NUM_REQUESTS_RUNNING = P + "num_requests_running"
NUM_REQUESTS_WAITING = P + "num_requests_waiting"
NUM_REQUESTS_SWAPPED = P + "num_requests_swapped"
NUM_ACTIVE_TOKENS = P + "num_active_tokens"
KV_CACHE_USAGE = P + "kv_cache_usage_perc"  # a fraction in [0, 1], as vLLM's
KV_CACHE_PEAK_USAGE = P + "kv_cache_peak_usage_perc"  # the highest usage since start
KV_CACHE_ALLOCATABLE = P + "kv_cache_allocatable_blocks"  # free + cached
KV_CACHE_BLOCKS = P + "kv_cache_blocks"  # {state}
KV_CACHE_NUM_BLOCKS = P + "kv_cache_num_blocks"
KV_CACHE_BLOCK_SIZE = P + "kv_cache_block_size_tokens"
KV_CACHE_BYTES_PER_TOKEN = P + "kv_cache_bytes_per_token"
KV_CACHE_BYTES = P + "kv_cache_bytes"
KV_CACHE_USED_BYTES = P + "kv_cache_used_bytes"
CPU_CACHE_NUM_BLOCKS = P + "cpu_cache_num_blocks"
CPU_CACHE_USED_BLOCKS = P + "cpu_cache_used_blocks"
CPU_CACHE_USAGE = P + "cpu_cache_usage_perc"
PREFIX_CACHE_HIT_RATE = P + "prefix_cache_hit_rate"
CACHE_CONFIG_INFO = P + "cache_config_info"  # {block_size, num_gpu_blocks, cache_dtype, …}: 1
ENGINE_STATE = P + "engine_state"  # {state}: 1 for the current one
ENGINE_DRAINING = P + "engine_draining"
UPTIME = P + "engine_uptime_seconds"
REQUESTS_IN_FLIGHT = P + "num_requests_in_flight"
MEMORY_DEVICE_USED = P + "memory_device_used_bytes"
MEMORY_WEIGHTS = P + "memory_weights_bytes"
# counters (exposed with a `_total` suffix)
PREFIX_CACHE_QUERIES = P + "prefix_cache_queries"  # tokens, as vLLM's
PREFIX_CACHE_HITS = P + "prefix_cache_hits"  # tokens
PREFIX_CACHE_EVICTIONS = P + "prefix_cache_evictions"
NUM_PREEMPTIONS = P + "num_preemptions"
PREFIX_CACHE_SAVED_PREFILL = P + "prefix_cache_saved_prefill_seconds"  # estimate; only ever grows
PROMPT_TOKENS = P + "prompt_tokens"  # vLLM's meaning: whole prompts, prefix hits included
PROMPT_TOKENS_COMPUTED = P + "prompt_tokens_computed"  # prompt tokens run through the model
GENERATION_TOKENS = P + "generation_tokens"
REQUEST_SUCCESS = P + "request_success"  # {finished_reason}
REQUESTS_REJECTED = P + "requests_rejected"  # {reason}
ENGINE_STEPS = P + "engine_steps"
SNAPSHOTS = P + "snapshots"  # {reason}
# histograms
TTFT = P + "time_to_first_token_seconds"
ITL = P + "inter_token_latency_seconds"
E2E = P + "e2e_request_latency_seconds"
QUEUE_TIME = P + "request_queue_time_seconds"
ITERATION_TOKENS = P + "iteration_tokens_total"  # a histogram, named as vLLM's
# per-request histograms, vLLM V1's (observed as requests finish: RequestStats)
REQUEST_HISTOGRAMS = {
    "prompt": (P + "request_prompt_tokens", "Prompt tokens per request."),
    "generation": (P + "request_generation_tokens", "Generated tokens per request."),
    "max_tokens": (P + "request_params_max_tokens", "The max_tokens each request asked for."),
    "max_generation": (P + "request_max_num_generation_tokens", "Tokens of the longest choice per prompt."),
    "n": (P + "request_params_n", "The n each request asked for."),
    "prefill": (P + "request_prefill_time_seconds", "First scheduled to first token."),
    "decode": (P + "request_decode_time_seconds", "First token to last token."),
    "inference": (P + "request_inference_time_seconds", "First scheduled to last token."),
    "tpot": (P + "time_per_output_token_seconds", "Decode time over output tokens after the first, per request."),
}
LABELS = ("model_name", "engine")

HISTOGRAMS = {
    "ttft": (TTFT, TTFT_BUCKETS, "Time to first token."),
    "itl": (ITL, ITL_BUCKETS, "Time between consecutive output tokens."),
    "e2e": (E2E, E2E_BUCKETS, "Request latency from arrival to the last token."),
    "queue": (QUEUE_TIME, E2E_BUCKETS, "Time from arrival to first being scheduled."),
}
BLOCK_STATES = {".": "free", "c": "cached", "u": "used", "s": "shared", "o": "offloaded"}
ENGINE_STATES = ("running", "draining", "drained")


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


class FrameCollector(Collector):
    """Turns one stats frame per scrape (and the request stats) into metric families."""

    def __init__(self, loop: EngineLoop, requests: RequestStats) -> None:
        self.loop = loop
        self.requests = requests
        config = loop.engine.config
        self.labels = {"model_name": config.served_model_name or config.model, "engine": "0"}
        self._saved_lock = threading.Lock()
        self._saved = (0, 0.0)  # (prefix hit tokens, saved prefill seconds) at the last scrape

    def collect(self):
        f = self.loop.frame()
        for family in (*self._scheduler(f), *self._kv(f), *self._prefix(f), *self._counters(f), *self._engine(f),
                       *self._histograms(f)):  # fmt: skip
            family.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield family

    def _scheduler(self, f: dict):
        sched = f["scheduler"]
        yield _gauge(NUM_REQUESTS_RUNNING, "Requests running (holding KV blocks).", sched["running"])
        yield _gauge(NUM_REQUESTS_WAITING, "Requests waiting to be scheduled.", sched["waiting"])
        yield _gauge(NUM_REQUESTS_SWAPPED, "Requests swapped out to the CPU tier.", sched["swapped"])
        yield _gauge(NUM_ACTIVE_TOKENS, "Tokens of running requests held in the KV cache.", sched["active_tokens"])
        yield _gauge(REQUESTS_IN_FLIGHT, "Engine requests the server has in flight.", f["server"]["in_flight"])
        yield _counter(NUM_PREEMPTIONS, "Preemptions (blocks taken back from a running request).",
                       sched["preemptions_total"])  # fmt: skip

    def _kv(self, f: dict):
        kv = f["kv"]
        yield _gauge(KV_CACHE_USAGE, "Fraction of KV blocks held by requests, used + shared (0-1).", kv["usage"])
        yield _gauge(KV_CACHE_PEAK_USAGE, "Highest kv_cache_usage_perc since the engine started (0-1).",
                     kv.get("peak_usage", kv["usage"]))  # fmt: skip
        blocks = GaugeMetricFamily(
            KV_CACHE_BLOCKS,
            "KV blocks by state, as the block map: free (not cached), cached, used (not shared), shared, "
            "offloaded (in the CPU tier).",
            labels=["state"],
        )
        for state in BLOCK_STATES.values():  # the frame's counts: one meaning per number on every surface
            blocks.add_metric([state], kv[state])
        yield blocks
        yield _gauge(KV_CACHE_ALLOCATABLE, "KV blocks a new request can get: free + cached.", kv["allocatable"])
        yield _gauge(KV_CACHE_NUM_BLOCKS, "KV blocks on the device.", kv["num_blocks"])
        yield _gauge(KV_CACHE_BLOCK_SIZE, "Tokens per KV block.", kv["block_size"])
        yield _gauge(KV_CACHE_BYTES_PER_TOKEN, "KV bytes per token (all layers, K and V).", kv["bytes_per_token"])
        yield _gauge(KV_CACHE_BYTES, "KV cache size in bytes.", kv.get("total_bytes", 0))
        yield _gauge(KV_CACHE_USED_BYTES, "KV bytes held by requests.", kv.get("used_bytes", 0))
        cpu = kv["cpu"]
        yield _gauge(CPU_CACHE_NUM_BLOCKS, "KV blocks in the CPU tier.", cpu["num_blocks"])
        yield _gauge(CPU_CACHE_USED_BLOCKS, "CPU-tier KV blocks in use.", cpu["used"])
        yield _gauge(CPU_CACHE_USAGE, "Fraction of CPU-tier blocks in use (0-1).",
                     cpu["used"] / cpu["num_blocks"] if cpu["num_blocks"] else 0.0)  # fmt: skip
        config = self.loop.engine.config
        info = GaugeMetricFamily(CACHE_CONFIG_INFO, "The KV cache's configuration (as vLLM's cache_config_info).",
                                 labels=["block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype",
                                         "enable_prefix_caching", "gpu_memory_utilization"])  # fmt: skip
        info.add_metric([str(kv["block_size"]), str(kv["num_blocks"]), str(cpu["num_blocks"]), str(kv.get("dtype")),
                         str(f["prefix"]["enabled"]), str(config.gpu_memory_utilization)], 1.0)  # fmt: skip
        yield info

    def _prefix(self, f: dict):
        prefix = f["prefix"]
        yield _counter(PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.", prefix["query_tokens"])
        yield _counter(PREFIX_CACHE_HITS, "Prompt tokens served from the prefix cache.", prefix["hit_tokens"])
        yield _counter(PREFIX_CACHE_EVICTIONS, "Cached prefix blocks dropped.", prefix.get("evictions", 0))
        yield _gauge(PREFIX_CACHE_HIT_RATE, "Prefix-cache hits over queries, in tokens (0-1).", prefix["hit_rate"])
        yield _counter(PREFIX_CACHE_SAVED_PREFILL, "Prefill time saved by prefix hits (estimate: new hits times "
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
        yield _counter(PROMPT_TOKENS, "Prompt tokens of requests that produced a token, prefix hits included (as "
                       "vLLM's).", prompt_tokens)  # fmt: skip
        yield _counter(PROMPT_TOKENS_COMPUTED, "Prompt tokens run through the model (prefix hits excluded, "
                       "recomputed ones included).", counters.get("prompt_tokens", 0))  # fmt: skip
        yield _counter(GENERATION_TOKENS, "Tokens generated.", counters.get("generation_tokens", 0))
        success = CounterMetricFamily(REQUEST_SUCCESS, "Requests finished, by reason.", labels=["finished_reason"])
        for reason in sorted({"stop", "length", "abort", *server["finish_reasons"]}):
            success.add_metric([reason], server["finish_reasons"].get(reason, 0))
        yield success
        rejected = CounterMetricFamily(REQUESTS_REJECTED, "Requests refused at admission.", labels=["reason"])
        for reason in sorted({"queue_full", "draining", *server["rejected"]}):
            rejected.add_metric([reason], server["rejected"].get(reason, 0))
        yield rejected
        snaps = CounterMetricFamily(SNAPSHOTS, "Snapshots written, by reason.", labels=["reason"])
        for reason, n in sorted(self.loop.snapshot_counts.items()):
            snaps.add_metric([reason], n)
        yield snaps

    def _engine(self, f: dict):
        eng = f["engine"]
        yield _counter(ENGINE_STEPS, "Engine steps run.", eng["step"])
        state = GaugeMetricFamily(ENGINE_STATE, "Engine state (1 for the current one).", labels=["state"])
        for s in ENGINE_STATES:
            state.add_metric([s], 1.0 if eng["state"] == s else 0.0)
        yield state
        yield _gauge(ENGINE_DRAINING, "1 while draining or drained, else 0.", 0.0 if eng["state"] == "running" else 1.0)
        yield _gauge(UPTIME, "Seconds since the engine started.", eng["uptime_s"])
        mem = f.get("memory", {})
        yield _gauge(MEMORY_DEVICE_USED, "Device memory in use (RSS on CPU).", mem.get("device_used", 0))
        yield _gauge(MEMORY_WEIGHTS, "Model weight bytes.", mem.get("weights", 0))

    def _histograms(self, f: dict):
        for key, (name, bounds, doc) in HISTOGRAMS.items():
            yield _histogram(name, doc, bounds, f["latency"][key])
        iteration = self.loop.engine.metrics.iteration.counts_only()
        yield _histogram(ITERATION_TOKENS, "Tokens computed per engine step (prompt + generated).", None, iteration)
        _, hists = self.requests.read()
        for key, (name, doc) in REQUEST_HISTOGRAMS.items():
            yield _histogram(name, doc, None, hists[key])


class ServerRegistry(CollectorRegistry):
    """The server's registry; `requests` is what the API observes per request (RequestStats)."""

    requests: RequestStats


def make_registry(loop: EngineLoop) -> ServerRegistry:
    registry = ServerRegistry(auto_describe=False)
    registry.requests = RequestStats(loop.engine.max_model_len)
    registry.register(FrameCollector(loop, registry.requests))
    # what prometheus-client's default registry exports (process_*, python_*), as vLLM's /metrics
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
