"""Every `kvtop_…` Prometheus metric name (DESIGN §6): the engine's `/metrics` writes them
(engine/server/exposition.py), and the tools read them (kvctl bench, kvtop's metrics source) — one
place, so neither side retypes a name.

Names mirror vLLM's (`vllm:num_requests_running` → `kvtop_num_requests_running`) so existing
dashboards carry over, with vLLM's meaning where the name is vLLM's; every `kvtop_` series carries
vLLM's `model_name` and `engine` labels (`LABELS`).
"""

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
    "tpot": (
        P + "request_time_per_output_token_seconds",
        "Decode time over output tokens after the first, per request.",
    ),
}
LABELS = ("model_name", "engine")
