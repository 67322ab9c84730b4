"""SGLang `/metrics` (`--enable-metrics`): `sglang:` names (docs.sglang.io, "Production Metrics")."""

from kvtop.sources.mappings.mapping import Mapping

MAPPING = Mapping(
    kind="sglang",
    label="SGLang",
    prefix="sglang:",
    gauges={
        "scheduler.running": ("sglang:num_running_reqs",),
        "scheduler.waiting": ("sglang:num_queue_reqs",),
        "kv.usage": ("sglang:token_usage",),  # a fraction of the token pool (SGLang's KV is per token, not block)
        "kv.used_tokens": ("sglang:num_used_tokens",),
        "prefix.hit_rate": ("sglang:cache_hit_rate",),  # SGLang's own rate; it serves no query/hit counts
    },
    counters={
        "prefix.hit_tokens": ("sglang:cached_tokens_total",),
    },
    rates={
        "prompt_tokens_per_s": ("sglang:prompt_tokens_total",),
        "generation_tokens_per_s": ("sglang:generation_tokens_total",),
        "requests_per_s": ("sglang:num_requests_total",),
    },
    start_time="process_start_time_seconds",  # prometheus_client's, where the server serves it
    histograms={
        "ttft": "sglang:time_to_first_token_seconds",
        "itl": "sglang:inter_token_latency_seconds",
        "e2e": "sglang:e2e_request_latency_seconds",
        "queue": "sglang:queue_time_seconds",
    },
    cannot_show=(
        "SGLang exposes no block map (its KV pool is counted in tokens)",
        "SGLang exposes no per-sequence table",
        "SGLang exposes no preemption count",
        "SGLang has no drain, evict or snapshot control kvtop can use",
    ),
)
