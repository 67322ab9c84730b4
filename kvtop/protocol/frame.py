"""The stats frame (DESIGN §6, `"schema": 1`) as types: the one place its shape is decided.

The engine builds one (engine/telemetry/stats.py's `build_frame`, the server's `server` section in
engine/server/loop.py), the control socket and `.kvsnap` files carry it as JSON, and the tools read
it (kvtop's panels, `kvctl status`, replay). Partial frames — another engine's `/metrics` read by
kvtop/sources/metrics.py — have the same shape, with what that engine cannot know left out or null.

Why TypedDicts and not dataclasses: the frame's wire form is JSON and both sides hold it as the
dict `json` gives; a TypedDict is that dict with static types, so nothing converts on the hot path
(a frame a step on the engine, a file of 200,000 frames in replay), partial and older frames stay
what they are (a key may be missing, or null), and the tools' reads keep working unchanged. A
dataclass would need a parse step that tolerates all of that, and a serializer back. What a
dataclass would check at construction, `kvtop.protocol.frame_schema` checks at the edges (replay
files, tests), from these same types.

Bounds the Python types cannot say (a count is never negative, a fraction is in [0, 1], the block
map's characters) ride along as `Schema(...)` in `Annotated`; `frame_schema` turns the whole into a
JSON Schema. `NotRequired` keys are those older frames or other engines may not carry.
"""

# no `from __future__ import annotations`: TypedDict must see `NotRequired` as an object, not a string,
# to leave those keys out of `__required_keys__`
from typing import Annotated, Any, Literal, NotRequired, TypedDict

SCHEMA_VERSION: Literal[1] = 1  # `StatsFrame.schema`; a reader refuses any other
FRAME_EVENTS = 50  # latest events carried in each frame
DEVICE_STATES = {".": "free", "c": "cached", "u": "used", "s": "shared"}  # `o` lives in the CPU tier


class Schema:
    """JSON Schema keywords a Python type cannot say (bounds, a pattern, a description), attached
    to a type with `Annotated`; nested ones merge, the outer winning."""

    def __init__(self, **keywords: Any) -> None:
        self.keywords = keywords


Count = Annotated[int, Schema(minimum=0)]
Positive = Annotated[int, Schema(minimum=1)]
NonNeg = Annotated[float, Schema(minimum=0)]
Fraction = Annotated[float, Schema(minimum=0, maximum=1)]
SecondsOrNone = Annotated[float | None, Schema(minimum=0)]
EngineState = Literal["running", "draining", "drained"]
SequenceState = Literal["waiting", "running", "swapped", "finished"]


class EngineInfo(TypedDict):
    state: EngineState
    model: Annotated[str, Schema(description="The served model id.")]
    device: str
    uptime_s: NonNeg
    step: Count
    dtype: NotRequired[str]
    attention_backend: NotRequired[str]
    max_model_len: NotRequired[Count]
    kind: NotRequired[Annotated[str, Schema(description="A partial frame's engine: vllm, sglang, llamacpp, kvtop.")]]
    start_time: NotRequired[
        Annotated[NonNeg, Schema(description="When the engine's process started, unix s (process_start_time_seconds).")]
    ]


class CpuTier(TypedDict):
    num_blocks: Count
    used: Count
    enabled: NotRequired[bool]
    prefix_blocks: NotRequired[Count]
    swapped_sequences: NotRequired[Count]
    bytes: NotRequired[Count]
    swap_outs: NotRequired[Count]
    swap_ins: NotRequired[Count]
    swap_out_bytes: NotRequired[Count]
    swap_in_bytes: NotRequired[Count]
    spilled_blocks: NotRequired[Count]
    restored_blocks: NotRequired[Count]
    dropped_blocks: NotRequired[Count]
    to_host_s: NotRequired[NonNeg]
    to_device_s: NotRequired[NonNeg]


class KVCache(TypedDict):
    block_size: Positive
    num_blocks: Count
    free: Annotated[
        Count, Schema(description="Blocks shown '.': free and holding nothing reusable. Never includes cached.")
    ]
    cached: Annotated[Count, Schema(description="Blocks shown 'c': free, but still holding a reusable prefix.")]
    used: Annotated[Count, Schema(description="Blocks shown 'u': held by exactly one sequence. Never includes shared.")]
    shared: Annotated[Count, Schema(description="Blocks shown 's': held by more than one sequence (ref count > 1).")]
    allocatable: Annotated[Count, Schema(description="free + cached: blocks a new request can be given.")]
    usage: Annotated[
        Fraction,
        Schema(description="(used + shared) / num_blocks: blocks held by requests, as vLLM's kv_cache_usage_perc."),
    ]
    bytes_per_token: Positive
    dtype: str
    blocks: Annotated[
        str,
        Schema(
            pattern="^[.cuso]*$",
            description="One char per block: . free, c cached, u used by one sequence, s shared, o offloaded to the CPU tier.",
        ),
    ]
    cpu: CpuTier
    offloaded: NotRequired[Annotated[Count, Schema(description="Blocks shown 'o': in the CPU tier.")]]
    peak_usage: NotRequired[
        Annotated[Fraction, Schema(description="The highest usage since the engine started; never below usage.")]
    ]
    total_bytes: NotRequired[Count]
    used_bytes: NotRequired[Count]


class SequenceInfo(TypedDict):
    id: str
    state: SequenceState
    prompt_tokens: Count
    output_tokens: Count
    cached_tokens: Count
    num_blocks: Count
    kv_bytes: Count
    age_s: NonNeg
    ttft_s: SecondsOrNone
    block_ids: list[Count]
    computed_tokens: NotRequired[Count]
    itl_s: NotRequired[SecondsOrNone]
    preemptions: NotRequired[Count]
    host_blocks: NotRequired[Count]


class SchedulerInfo(TypedDict):
    running: Count
    waiting: Count
    swapped: Count
    max_num_seqs: Positive
    max_num_batched_tokens: Positive
    active_tokens: Count
    preemptions_total: Count
    waiting_for_capacity: NotRequired[
        Annotated[Count, Schema(description="Of those waiting, for scheduling capacity (vLLM's waiting_by_reason).")]
    ]
    waiting_deferred: NotRequired[
        Annotated[Count, Schema(description="Of those waiting, deferred by a transient constraint (vLLM's reason).")]
    ]
    rejections_total: NotRequired[
        Annotated[Count, Schema(description="Requests a queue limit turned away since start (vLLM's admission).")]
    ]


class PrefixCache(TypedDict):
    query_tokens: Count
    hit_tokens: Count
    hit_rate: Fraction
    hit_requests: Count
    saved_prefill_s: NonNeg
    enabled: NotRequired[bool]
    queries: NotRequired[Count]
    request_hit_rate: NotRequired[Fraction]
    evictions: NotRequired[Count]
    restored_blocks: NotRequired[Count]
    cached_blocks: NotRequired[Count]
    window_hit_rate: NotRequired[
        Annotated[
            Fraction,
            Schema(description="A partial frame's: the token hit rate over the scrapes of the last rate window."),
        ]
    ]


class Window(TypedDict):
    """The last minute of a histogram (the engine's), or the span between two scrapes (a partial frame's)."""

    seconds: NonNeg
    count: Count
    p50: NotRequired[float | None]
    p95: NotRequired[float | None]
    p99: NotRequired[float | None]


class Histogram(TypedDict):
    """A histogram with its engine's buckets (seconds, or tokens for request lengths): counts has one more entry
    than buckets (the last is +Inf)."""

    count: Count
    sum: NonNeg
    p50: float | None
    p95: float | None
    p99: float | None
    buckets: Annotated[list[float], Schema(minItems=1)]
    counts: Annotated[list[Count], Schema(minItems=2)]
    window: NotRequired[Window]


class RequestLengths(TypedDict):
    """Finished requests' lengths in tokens, as histograms (an engine that serves no per-sequence table)."""

    prompt_tokens: NotRequired[Histogram]
    generation_tokens: NotRequired[Histogram]


class Latency(TypedDict):
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue: Histogram


class Throughput(TypedDict):
    prompt_tokens_per_s: NonNeg
    generation_tokens_per_s: NonNeg
    requests_per_s: NonNeg
    window_s: NotRequired[Annotated[NonNeg, Schema(description="A partial frame's: the seconds its rates span.")]]


class Counters(TypedDict):
    prompt_tokens: Count
    generation_tokens: Count
    requests_finished: Count
    requests_aborted: Count
    requests_failed: Count


class NvmlReading(TypedDict, total=False):
    """GPU utilisation from NVML."""

    gpu_util: float
    mem_bw_util: float
    mem_used: Count
    mem_total: Count


class Memory(TypedDict):
    device_total: Count
    device_used: Count
    weights: Annotated[
        Count, Schema(description="Resident weight bytes: every parameter and buffer, quantized blocks as held.")
    ]
    weights_format: NotRequired[
        Annotated[
            str,
            Schema(
                description="The formats the weights are held in, most bytes first: float32, bfloat16, or a GGUF "
                "file's block formats kept quantized (Q4_1, Q8_0, float32). Absent from older engines' frames."
            ),
        ]
    ]
    kv: Count
    nvml: Annotated[NvmlReading | None, Schema(description="GPU utilisation from NVML; null where there is none.")]
    prefill_copy: NotRequired[
        Annotated[
            Count,
            Schema(
                description="Held besides the weights: a second, oneDNN-packed copy of the projections for long "
                "prefill steps (0 without)."
            ),
        ]
    ]


class Event(TypedDict):
    ts: float
    kind: Annotated[str, Schema(minLength=1)]
    seq_id: str | None
    detail: str
    derived: NotRequired[
        Annotated[bool, Schema(description="kvtop's, from the engine's counters and gauges (kvtop/derived.py).")]
    ]


class ServerInfo(TypedDict, total=False):
    """Added by the server (engine/server/loop.py): admission, drain and snapshot state."""

    pid: int | None
    addresses: dict[str, Any]
    in_flight: Count
    max_queue: Count
    rejected: dict[str, Count]
    finish_reasons: dict[str, Count]
    drain: dict[str, Any] | None
    snapshots: list[Any]
    stats_interval_s: NonNeg
    history_s: NonNeg


class SourceInfo(TypedDict):
    """Where a partial frame came from (`kind` "metrics": another engine's /metrics at `url`)."""

    kind: str
    url: NotRequired[str]


class StatsFrame(TypedDict):
    """One stats frame. Times in seconds, sizes in bytes, rates per second. More keys are welcome
    anywhere: a reader ignores what it does not know."""

    schema: Literal[1]
    ts: Annotated[float, Schema(description="Unix time of the frame.")]
    engine: EngineInfo
    kv: KVCache
    sequences: list[SequenceInfo]
    scheduler: SchedulerInfo
    prefix: PrefixCache
    latency: Latency
    throughput: Throughput
    memory: Memory
    events: list[Event]
    counters: NotRequired[Counters]
    server: NotRequired[ServerInfo]
    source: NotRequired[SourceInfo]
    unavailable: NotRequired[Annotated[list[str], Schema(description="What a partial frame's engine cannot show.")]]
    requests: NotRequired[RequestLengths]


def block_counts(device_blocks: str) -> dict[str, int]:
    """Device blocks by map character (DESIGN §6): each block counts in exactly one state, so
    free + cached + used + shared == num_blocks. `free` never includes `cached`, `used` never
    includes `shared`."""
    return {state: device_blocks.count(ch) for ch, state in DEVICE_STATES.items()}


def normalize_kv(kv: dict) -> dict:
    """A frame's `kv` in today's meaning. Frames written before `allocatable` existed (old
    snapshot files) counted cached blocks inside `free` and shared ones inside `used`; this
    takes them out and adds `allocatable`. Frames already in today's meaning, and partial ones
    (no `cached`/`shared` to take out), are returned as they are."""
    if "allocatable" in kv or kv.get("free") is None:
        return kv
    cached, shared = kv.get("cached") or 0, kv.get("shared") or 0
    out = {**kv, "allocatable": kv["free"], "free": kv["free"] - cached}
    if kv.get("used") is not None:
        out["used"] = kv["used"] - shared
    return out


def normalize_frame(frame: dict) -> dict:
    """`frame` with its `kv` in today's meaning (see normalize_kv); other keys untouched."""
    if isinstance(frame, dict) and isinstance(frame.get("kv"), dict):
        return {**frame, "kv": normalize_kv(frame["kv"])}
    return frame
