"""Our own server's `/metrics` (engine/server/metrics.py): for an engine whose socket is out of reach."""

from kvtop.sources.mappings.mapping import Mapping

MAPPING = Mapping(
    kind="kvtop",
    label="kvtop",
    prefix="kvtop_",
    gauges={
        "scheduler.running": ("kvtop_num_requests_running",),
        "scheduler.waiting": ("kvtop_num_requests_waiting",),
        "scheduler.swapped": ("kvtop_num_requests_swapped",),
        "scheduler.active_tokens": ("kvtop_num_active_tokens",),
        "kv.usage": ("kvtop_kv_cache_usage_perc",),
        "kv.peak_usage": ("kvtop_kv_cache_peak_usage_perc",),
        "kv.num_blocks": ("kvtop_kv_cache_num_blocks",),
        "kv.block_size": ("kvtop_kv_cache_block_size_tokens",),
        "kv.bytes_per_token": ("kvtop_kv_cache_bytes_per_token",),
        "prefix.hit_rate": ("kvtop_prefix_cache_hit_rate",),
        "engine.uptime_s": ("kvtop_engine_uptime_seconds",),
    },
    counters={
        "scheduler.preemptions_total": ("kvtop_num_preemptions_total",),
        "prefix.query_tokens": ("kvtop_prefix_cache_queries_total",),
        "prefix.hit_tokens": ("kvtop_prefix_cache_hits_total",),
        "prefix.saved_prefill_s": ("kvtop_prefix_cache_saved_prefill_seconds_total",),
    },
    rates={
        "prompt_tokens_per_s": ("kvtop_prompt_tokens_total",),
        "generation_tokens_per_s": ("kvtop_generation_tokens_total",),
        "requests_per_s": ("kvtop_request_success_total",),
    },
    histograms={
        "ttft": "kvtop_time_to_first_token_seconds",
        "itl": "kvtop_inter_token_latency_seconds",
        "e2e": "kvtop_e2e_request_latency_seconds",
        "queue": "kvtop_request_queue_time_seconds",
    },
    info="kvtop_cache_config_info",
    cannot_show=(
        "/metrics carries no block map (kvtop --socket shows it)",
        "/metrics carries no per-sequence table (kvtop --socket shows it)",
    ),
)
