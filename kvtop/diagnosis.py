"""What bounds the engine now, in one line each, where the stats frames say it plainly.

    from kvtop.diagnosis import diagnose
    for line in diagnose(frame, history):   # history: earlier frames, oldest first (may be [])
        print(line)

`diagnose(frame, history=None) -> list[str]` is a pure function of stats frames (DESIGN §6): no
I/O, no clock. It returns the findings, most pressing first, each one sentence of the form
"what the frame shows: what it means — what to do"; an empty list when nothing stands out.
Findings about rates (preemptions, rejections, prefix thrash, failures) need `history`: they
compare `frame` with the oldest frame of the same engine run in the last `WINDOW_S` seconds, and
are left out when there is none. The dashboard shows the first finding under its header; other
tools (`kvctl status`, the demo's summary) may print them all.

Frames may come from files and other engines: a figure that is not a usable number (NaN, ±Inf, an
integer too large for a float, a string: `kvtop.sources.prometheus.number`) is read as absent,
never a crash.
"""

from __future__ import annotations

from kvtop.sources.prometheus import number

WINDOW_S = 5.0  # rates are measured over the last this many seconds of frames
THRASH_HIT_RATE = 0.1  # prefix hits below this share of looked-up tokens…
THRASH_EVICTIONS_PER_S = 1.0  # …while this many cached blocks a second are reallocated: a thrash


def diagnose(frame: dict, history: list[dict] | None = None) -> list[str]:
    """The findings for `frame`, most pressing first (see the module docstring)."""
    then = _baseline(frame, history or [])
    found = [_draining(frame), _kv_bound(frame), _preempting(frame, then), _queue_full(frame, then)]
    found += [_thrash(frame, then), _failing(frame, then), _seq_bound(frame)]
    return [line for line in found if line]


def allocatable(kv: dict) -> int:
    """Blocks a new request could get: free plus cached. Frames before `kv.allocatable` existed
    counted cached blocks inside `free`."""
    if number(kv.get("allocatable")) is not None:
        return int(number(kv["allocatable"]) or 0)
    return int(number(kv.get("free")) or 0)


def _get(frame: dict, path: str) -> float:
    node: object = frame
    for key in path.split("."):
        if not isinstance(node, dict) or node.get(key) is None:
            return 0.0
        node = node[key]
    return number(node) or 0.0


def _start(frame: dict) -> float:
    return _get(frame, "ts") - _get(frame, "engine.uptime_s")


def _baseline(frame: dict, history: list[dict]) -> dict | None:
    """The oldest frame of the same engine run in the window before `frame`, or None."""
    ts, start, found = _get(frame, "ts"), _start(frame), None
    for f in reversed(history):  # newest first: only the window's frames are read
        age = ts - _get(f, "ts")
        if age > WINDOW_S + 1e-9 or abs(_start(f) - start) >= 1.0:
            break
        if age > 0:
            found = f
    return found


def _rate(frame: dict, then: dict | None, path: str) -> tuple[float, float] | None:
    """(increase, seconds) of a counter since `then`, or None without a usable earlier frame."""
    if then is None:
        return None
    dt = _get(frame, "ts") - _get(then, "ts")
    delta = _get(frame, path) - _get(then, path)
    return (delta, dt) if dt > 0 and delta >= 0 else None


def _per_s(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.1f}" if v >= 0.1 else f"{v:.2f}"


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
    waiting = int(_get(frame, "scheduler.waiting"))
    kv = frame.get("kv") or {}
    if waiting <= 0 or _get(frame, "kv.num_blocks") <= 0 or allocatable(kv) > 0:
        return ""
    return f"{waiting} waiting, 0 free blocks: KV-bound — more --kv-cache-memory or a shorter --max-model-len"


def _preempting(frame: dict, then: dict | None) -> str:
    r = _rate(frame, then, "scheduler.preemptions_total")
    if not r or r[0] <= 0:
        return ""
    return (
        f"preempting {_per_s(r[0] / r[1])}/s: the batch outgrows the KV cache — "
        "more --kv-cache-memory or a lower --max-num-seqs"
    )


def _queue_full(frame: dict, then: dict | None) -> str:
    r = _rate(frame, then, "server.rejected.queue_full")
    if not r or r[0] <= 0:
        return ""
    return (
        f"queue full: {r[0]:.0f} requests refused (429) in {r[1]:.0f}s — "
        "raise --max-queue, or the engine needs more capacity"
    )


def _thrash(frame: dict, then: dict | None) -> str:
    looked = _rate(frame, then, "prefix.query_tokens")
    hits = _rate(frame, then, "prefix.hit_tokens")
    evicted = _rate(frame, then, "prefix.evictions")
    if not (looked and hits and evicted) or looked[0] <= 0:
        return ""
    hit_rate, per_s = hits[0] / looked[0], evicted[0] / evicted[1]
    if hit_rate >= THRASH_HIT_RATE or per_s < THRASH_EVICTIONS_PER_S:
        return ""
    return (
        f"prefix hit rate {hit_rate * 100:.0f} % with evictions {_per_s(per_s)} blocks/s: prefix thrash — "
        "cached prefixes are reallocated before reuse; more --kv-cache-memory or fewer distinct prompts"
    )


def _failing(frame: dict, then: dict | None) -> str:
    r = _rate(frame, then, "counters.requests_failed")
    if not r or r[0] <= 0:
        return ""
    return f"{r[0]:.0f} requests failed in {r[1]:.0f}s: steps are failing — see the events (`v`) and the server log"


def _seq_bound(frame: dict) -> str:
    waiting, running = int(_get(frame, "scheduler.waiting")), int(_get(frame, "scheduler.running"))
    limit = int(_get(frame, "scheduler.max_num_seqs"))
    if waiting <= 0 or limit <= 0 or running < limit or _kv_bound(frame):
        return ""
    free = allocatable(frame.get("kv") or {})
    return (
        f"{waiting} waiting, {running}/{limit} running: bound by --max-num-seqs "
        f"with {free} blocks free — raise --max-num-seqs"
    )
