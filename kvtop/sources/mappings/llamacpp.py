"""llama.cpp's `llama-server --metrics`: `llamacpp:` names (tools/server/README.md, GET /metrics)."""

from kvtop.sources.mappings import Mapping

MAPPING = Mapping(
    kind="llamacpp",
    label="llama.cpp",
    prefix="llamacpp:",
    gauges={
        "scheduler.running": ("llamacpp:requests_processing",),
        "scheduler.waiting": ("llamacpp:requests_deferred",),
        "kv.usage": ("llamacpp:kv_cache_usage_ratio",),  # dropped by newer llama-server builds
        "kv.used_tokens": ("llamacpp:kv_cache_tokens",),
    },
    counters={},
    rates={
        "prompt_tokens_per_s": ("llamacpp:prompt_tokens_total",),
        "generation_tokens_per_s": ("llamacpp:tokens_predicted_total",),
    },
    histograms={},  # llama-server serves averages, not histograms: no P50/P95/P99
    cannot_show=(
        "llama.cpp exposes no block map",
        "llama.cpp exposes no latency histograms (no P50/P95/P99)",
        "llama.cpp exposes no prefix-cache counts",
        "llama.cpp has no drain, evict or snapshot control kvtop can use",
    ),
)
