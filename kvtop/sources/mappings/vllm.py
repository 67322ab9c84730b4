"""vLLM (V1) `/metrics`: `vllm:` names (docs.vllm.ai, "Production Metrics")."""

from kvtop.sources.mappings.mapping import Mapping

MAPPING = Mapping(
    kind="vllm",
    label="vLLM",
    prefix="vllm:",
    gauges={
        "scheduler.running": ("vllm:num_requests_running",),
        "scheduler.waiting": ("vllm:num_requests_waiting",),
        "scheduler.swapped": ("vllm:num_requests_swapped",),  # V0 only
        "kv.usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # a fraction; the second is V0's
    },
    selected={
        "scheduler.waiting_for_capacity": ("vllm:num_requests_waiting_by_reason", "reason", "capacity"),  # 0.11+
        "scheduler.waiting_deferred": ("vllm:num_requests_waiting_by_reason", "reason", "deferred"),
    },
    counters={
        "scheduler.preemptions_total": ("vllm:num_preemptions_total",),
        "scheduler.rejections_total": ("vllm:admission_rejections_total",),  # a queue limit said no (all reasons)
        "prefix.query_tokens": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        "prefix.hit_tokens": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    },
    rates={
        "prompt_tokens_per_s": ("vllm:prompt_tokens_total",),
        "generation_tokens_per_s": ("vllm:generation_tokens_total",),
        "requests_per_s": ("vllm:request_success_total",),
    },
    start_time="process_start_time_seconds",  # prometheus_client's, where the server serves it
    histograms={
        "ttft": "vllm:time_to_first_token_seconds",
        "itl": "vllm:inter_token_latency_seconds",  # vllm:time_per_output_token_seconds before 0.11
        "e2e": "vllm:e2e_request_latency_seconds",
        "queue": "vllm:request_queue_time_seconds",
    },
    request_histograms={
        "prompt_tokens": "vllm:request_prompt_tokens",
        "generation_tokens": "vllm:request_generation_tokens",
    },
    info="vllm:cache_config_info",
    reserved_blocks=1,  # block 0 is vLLM's null block: its usage is of num_gpu_blocks - 1
    cannot_show=(
        "vLLM exposes no block map",
        "vLLM exposes no per-sequence table",
        "vLLM has no drain, evict or snapshot control over HTTP",
    ),
)
