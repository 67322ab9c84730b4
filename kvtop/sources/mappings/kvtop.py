"""Our own server's `/metrics` (engine/server/exposition.py): for an engine whose socket is out of reach."""

from kvtop.protocol import metric_names as M  # where every kvtop_ name is defined: none is retyped here
from kvtop.sources.mappings.mapping import Mapping

T = "_total"  # a counter's samples carry it

MAPPING = Mapping(
    kind="kvtop",
    label="kvtop",
    prefix=M.P,
    gauges={
        "scheduler.running": (M.NUM_REQUESTS_RUNNING,),
        "scheduler.waiting": (M.NUM_REQUESTS_WAITING,),
        "scheduler.swapped": (M.NUM_REQUESTS_SWAPPED,),
        "scheduler.active_tokens": (M.NUM_ACTIVE_TOKENS,),
        "kv.usage": (M.KV_CACHE_USAGE,),
        "kv.peak_usage": (M.KV_CACHE_PEAK_USAGE,),
        "kv.num_blocks": (M.KV_CACHE_NUM_BLOCKS,),
        "kv.block_size": (M.KV_CACHE_BLOCK_SIZE,),
        "kv.bytes_per_token": (M.KV_CACHE_BYTES_PER_TOKEN,),
        "prefix.hit_rate": (M.PREFIX_CACHE_HIT_RATE,),
        "engine.uptime_s": (M.UPTIME,),
    },
    counters={
        "scheduler.preemptions_total": (M.NUM_PREEMPTIONS + T,),
        "prefix.query_tokens": (M.PREFIX_CACHE_QUERIES + T,),
        "prefix.hit_tokens": (M.PREFIX_CACHE_HITS + T,),
        "prefix.saved_prefill_s": (M.PREFIX_CACHE_SAVED_PREFILL + T,),
    },
    rates={
        "prompt_tokens_per_s": (M.PROMPT_TOKENS + T,),
        "generation_tokens_per_s": (M.GENERATION_TOKENS + T,),
        "requests_per_s": (M.REQUEST_SUCCESS + T,),
    },
    histograms={
        "ttft": M.TTFT,
        "itl": M.ITL,
        "e2e": M.E2E,
        "queue": M.QUEUE_TIME,
    },
    info=M.CACHE_CONFIG_INFO,
    cannot_show=(
        "/metrics carries no block map (kvtop --socket shows it)",
        "/metrics carries no per-sequence table (kvtop --socket shows it)",
    ),
)
