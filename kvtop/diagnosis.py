"""What bounds the engine now, in one line each, where the stats frames say it plainly.

    from kvtop.diagnosis import diagnose
    for line in diagnose(frame, history):   # history: earlier frames, oldest first (may be [])
        print(line)

`diagnose(frame, history=None) -> list[str]` is a pure function of stats frames (DESIGN §6): no
I/O, no clock. It returns the findings, most pressing first, each one sentence of the form
"what the frame shows: what it means — what to do"; an empty list when nothing stands out.

A finding claims only what the engine's own numbers show, so which findings an engine gets
follows from the series it serves (docs/engines.md has the table): "0 free blocks" only from a
free-block count (ours); on vLLM, SGLang and llama.cpp, KV-bound only from a KV usage at
`KV_FULL` or above; a sequence cap from ours' `max_num_seqs`, or where the engine serves none,
from requests waiting (vLLM: for capacity, `waiting_by_reason`) while the KV usage stayed under
`KV_SPARE`, nothing was preempted and the batch held at its largest. The advice names the
engine's own flags. Findings about rates (preemptions, rejections, prefix thrash, failures) need
`history`: they read the counter over the frames of the same engine run in the last
`RATE_WINDOW_S` seconds (`kvtop.rates`), and are left out when there is no earlier frame.

Frames may come from files and other engines: a figure that is not a usable number (NaN, ±Inf, an
integer too large for a float, a string: `kvtop.sources.prometheus.number`) is read as absent,
never a crash.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtop.rates import RATE_WINDOW_S, Rate, figure, run_window, window_increase, window_values
from kvtop.sources.prometheus import number

THRASH_HIT_RATE = 0.1  # prefix hits below this share of looked-up tokens…
THRASH_EVICTIONS_PER_S = 1.0  # …while this many cached blocks a second are reallocated: a thrash
THRASH_WINDOW_S = 5.0  # …over the last this many seconds: a thrash is now, and 30 s would blend in the warm cache
KV_FULL = 0.9  # a KV usage (fraction) at or above this, with requests waiting: KV-bound
KV_SPARE = 0.6  # a usage that stayed under this over the window, with requests waiting: not KV


@dataclass(frozen=True)
class Advice:
    """What to turn on each engine, in its own flags."""

    more_kv: str  # KV-bound, preempting
    shorter: str  # KV-bound: fewer tokens a sequence
    more_seqs: str  # bound by a sequence cap
    fewer_seqs: str  # preempting: the batch outgrows the cache


ADVICE = {
    "kvtop": Advice("more --kv-cache-memory", "a shorter --max-model-len", "raise --max-num-seqs",
                    "a lower --max-num-seqs"),
    "vllm": Advice("more KV cache (--gpu-memory-utilization; VLLM_CPU_KVCACHE_SPACE on CPU)",
                   "a shorter --max-model-len", "raise --max-num-seqs (or --max-num-batched-tokens)",
                   "a lower --max-num-seqs"),
    "sglang": Advice("a higher --mem-fraction-static", "a shorter --context-length", "raise --max-running-requests",
                     "a lower --max-running-requests"),
    "llamacpp": Advice("a larger --ctx-size", "fewer --parallel slots", "more --parallel slots",
                       "fewer --parallel slots"),
}  # fmt: skip
LABELS = {"kvtop": "kvtop", "vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp"}


def diagnose(frame: dict, history: list[dict] | None = None) -> list[str]:
    """The findings for `frame`, most pressing first (see the module docstring)."""
    window = run_window([*(history or []), frame], RATE_WINDOW_S)  # `frame` last, its run's frames before
    found = [_draining(frame), _kv_bound(frame), _preempting(window), _queue_full(window)]
    found += [_thrash(window), _failing(window), _seq_bound(frame, window)]
    return [line for line in found if line]


def allocatable(kv: dict) -> int:
    """Blocks a new request could get: free plus cached. Frames before `kv.allocatable` existed
    counted cached blocks inside `free`."""
    if number(kv.get("allocatable")) is not None:
        return int(number(kv["allocatable"]) or 0)
    return int(number(kv.get("free")) or 0)


def _get(frame: dict, path: str) -> float:
    return figure(frame, path) or 0.0


def _kind(frame: dict) -> str:
    """The engine's kind: a partial frame names it; our own frames do not."""
    kind = (frame.get("engine") or {}).get("kind")
    return kind if kind in ADVICE else "kvtop"


def _waiting(frame: dict) -> tuple[int, str]:
    """(requests waiting, how to say it): vLLM's waiting for capacity where it serves that count."""
    capacity = figure(frame, "scheduler.waiting_for_capacity")
    if capacity is not None:
        return int(capacity), f"{int(capacity)} waiting for capacity"
    waiting = int(_get(frame, "scheduler.waiting"))
    return waiting, f"{waiting} waiting"


def _queued(frame: dict) -> str:
    """`, queued p95 2.1 s` from the queue-time histogram's last minute, where the engine serves one."""
    p95 = figure(frame, "latency.queue.window.p95")
    return "" if p95 is None else f", queued p95 {p95:.1f} s"


def _has_block_counts(frame: dict) -> bool:
    kv = frame.get("kv") or {}
    return _get(frame, "kv.num_blocks") > 0 and (number(kv.get("free")) is not None or "allocatable" in kv)


def _pct(v: float) -> str:
    return f"{v * 100:.1f} %"


def _per_s(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.1f}" if v >= 0.1 else f"{v:.2f}"


def _grew(window: list[dict], path: str) -> Rate | None:
    """The counter's increase over the window, where it grew."""
    r = window_increase(window, path, RATE_WINDOW_S)
    return r if r is not None and r.increase > 0 else None


def _draining(frame: dict) -> str:
    state = (frame.get("engine") or {}).get("state")
    if state not in ("draining", "drained"):
        return ""
    server = frame.get("server") or {}
    left = server.get("in_flight", len(frame.get("sequences") or []))
    if state == "drained":
        return "drained: admitting nothing (new requests get 503) — `kvctl resume` (or r) admits again"
    return f"draining: admitting nothing (503), {left} in flight finishing — `kvctl resume` (or r) admits again"


def _kv_bound(frame: dict) -> str:
    waiting, said = _waiting(frame)
    if waiting <= 0:
        return ""
    advice = ADVICE[_kind(frame)]
    more_kv = f"{advice.more_kv} or {advice.shorter}"
    if _has_block_counts(frame):  # ours: the free-block count itself
        if allocatable(frame.get("kv") or {}) > 0:
            return ""
        return f"{said}, 0 free blocks: KV-bound — {more_kv}"
    usage = figure(frame, "kv.usage")  # the others serve a usage, never a free-block count
    if usage is None or usage < KV_FULL:
        return ""
    return f"{said}{_queued(frame)}, KV {_pct(usage)} used: KV-bound — {more_kv}"


def _preempting(window: list[dict]) -> str:
    r = _grew(window, "scheduler.preemptions_total")
    if r is None:
        return ""
    return (
        f"preempting {_per_s(r.per_s)}/s (over {r.seconds:.0f} s): the batch outgrows the KV cache — "
        f"{ADVICE[_kind(window[-1])].more_kv} or {ADVICE[_kind(window[-1])].fewer_seqs}"
    )


def _queue_full(window: list[dict]) -> str:
    r = _grew(window, "server.rejected.queue_full")
    if r is None:
        return ""
    return (
        f"queue full: {r.increase:.0f} requests refused (429) in {r.seconds:.0f}s — "
        "raise --max-queue, or the engine needs more capacity"
    )


def _thrash(window: list[dict]) -> str:
    looked = window_increase(window, "prefix.query_tokens", THRASH_WINDOW_S)
    hits = window_increase(window, "prefix.hit_tokens", THRASH_WINDOW_S)
    evicted = window_increase(window, "prefix.evictions", THRASH_WINDOW_S)
    if not (looked and hits and evicted) or looked.increase <= 0:
        return ""
    hit_rate, per_s = hits.increase / looked.increase, evicted.per_s
    if hit_rate >= THRASH_HIT_RATE or per_s < THRASH_EVICTIONS_PER_S:
        return ""
    return (
        f"prefix hit rate {hit_rate * 100:.0f} % with evictions {_per_s(per_s)} blocks/s: prefix thrash — "
        "cached prefixes are reallocated before reuse; more --kv-cache-memory or fewer distinct prompts"
    )


def _failing(window: list[dict]) -> str:
    r = _grew(window, "counters.requests_failed")
    if r is None:
        return ""
    return f"{r.increase:.0f} requests failed in {r.seconds:.0f}s: steps are failing — see the events (`v`) and the server log"


def _seq_bound(frame: dict, window: list[dict]) -> str:
    if _kv_bound(frame):
        return ""
    waiting, said = _waiting(frame)
    running = int(_get(frame, "scheduler.running"))
    if waiting <= 0 or running <= 0:
        return ""
    more_seqs = ADVICE[_kind(frame)].more_seqs
    limit = int(_get(frame, "scheduler.max_num_seqs"))
    if limit > 0:  # ours serves its cap
        if running < limit:
            return ""
        free = allocatable(frame.get("kv") or {})
        return f"{said}, {running}/{limit} running: bound by --max-num-seqs with {free} blocks free — {more_seqs}"
    # the others serve no cap: over frames (one cannot say), the batch held at its largest with KV
    # to spare and nothing preempted
    usages = window_values(window, "kv.usage", RATE_WINDOW_S)
    if len(window) < 2 or not usages or max(usages) >= KV_SPARE or _grew(window, "scheduler.preemptions_total"):
        return ""
    if running < max(window_values(window, "scheduler.running", RATE_WINDOW_S), default=running):
        return ""
    label = LABELS[_kind(frame)]
    return (
        f"{said}{_queued(frame)}, {running} running, KV {_pct(usages[-1])} used: a sequence cap, not KV — "
        f"{more_seqs} ({label} does not serve its cap; {running} is where the batch holds)"
    )
