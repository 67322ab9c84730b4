"""Prometheus exposition: every `kvtop_…` metric name lives here (DESIGN §6).

Names mirror vLLM's (`vllm:num_requests_running` → `kvtop_num_requests_running`) so existing
dashboards carry over. Values are read from one stats frame per scrape — the same numbers
`kvctl status` and the dashboard show — through a collector in a dedicated registry (never the
process-global one). Histograms carry the engine's own bucket counts, i.e. vLLM's buckets
(engine/metrics.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

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
PREFIX_CACHE_SAVED_PREFILL = P + "prefix_cache_saved_prefill_seconds"
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
PROMPT_TOKENS = P + "prompt_tokens"
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


def _histogram(name: str, doc: str, bounds: tuple[float, ...], summary: dict) -> HistogramMetricFamily:
    counts = summary["counts"]
    if list(summary["buckets"]) != list(bounds) or len(counts) != len(bounds) + 1:
        raise ValueError(f"{name}: the engine's buckets differ from the declared ones")
    cumulative, buckets = 0, []
    for le, c in zip(bounds, counts, strict=False):
        cumulative += c
        buckets.append((floatToGoString(le), cumulative))
    buckets.append(("+Inf", summary["count"]))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=summary["sum"])


class FrameCollector(Collector):
    """Turns one stats frame per scrape into metric families."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def collect(self):
        f = self.loop.frame()
        kv, sched, prefix, eng = f["kv"], f["scheduler"], f["prefix"], f["engine"]
        yield _gauge(NUM_REQUESTS_RUNNING, "Requests running (holding KV blocks).", sched["running"])
        yield _gauge(NUM_REQUESTS_WAITING, "Requests waiting to be scheduled.", sched["waiting"])
        yield _gauge(NUM_REQUESTS_SWAPPED, "Requests swapped out to the CPU tier.", sched["swapped"])
        yield _gauge(NUM_ACTIVE_TOKENS, "Tokens of running requests held in the KV cache.", sched["active_tokens"])
        yield _gauge(REQUESTS_IN_FLIGHT, "Engine requests the server has in flight.", f["server"]["in_flight"])
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
        yield _counter(PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.", prefix["query_tokens"])
        yield _counter(PREFIX_CACHE_HITS, "Prompt tokens served from the prefix cache.", prefix["hit_tokens"])
        yield _counter(PREFIX_CACHE_EVICTIONS, "Cached prefix blocks dropped.", prefix.get("evictions", 0))
        yield _gauge(PREFIX_CACHE_HIT_RATE, "Prefix-cache hits over queries, in tokens (0-1).", prefix["hit_rate"])
        yield _gauge(PREFIX_CACHE_SAVED_PREFILL, "Prefill time saved by prefix hits (estimate).",
                     prefix["saved_prefill_s"])  # fmt: skip
        yield _counter(NUM_PREEMPTIONS, "Preemptions (blocks taken back from a running request).",
                       sched["preemptions_total"])  # fmt: skip
        counters = f.get("counters", {})
        yield _counter(
            PROMPT_TOKENS, "Prompt tokens computed (prefix hits excluded).", counters.get("prompt_tokens", 0)
        )
        yield _counter(GENERATION_TOKENS, "Tokens generated.", counters.get("generation_tokens", 0))
        server = f["server"]
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
        for key, (name, bounds, doc) in HISTOGRAMS.items():
            yield _histogram(name, doc, bounds, f["latency"][key])


def make_registry(loop: EngineLoop) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FrameCollector(loop))
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
