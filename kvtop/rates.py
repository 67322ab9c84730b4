"""Counter rates over a window of frames, as Prometheus' `rate()` computes them.

    from kvtop.rates import window_rate, RATE_WINDOW_S
    window_rate(history, "scheduler.preemptions_total")   # per second over the last 30 s, or None

Every rate kvtop shows (preempt/s live and in replay, the fleet's, the diagnosis's, `kvctl status
--url`'s throughput) is this one computation: the counter's increase over the frames of the last
`window_s` seconds, divided by the time between the first and last of them, both taken from the
frames' own `ts` (the scrape or stats time, never the clock now). Frames of an earlier engine run
are left out: a run is known by when its engine started (`engine.start_time`, vLLM's
`process_start_time_seconds`; or `ts − engine.uptime_s`, ours). Where neither is served, a counter
that went back is read as a reset and counts from 0, as Prometheus reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from kvtop.sources.prometheus import number

RATE_WINDOW_S = 30.0  # rates over the last this many seconds of frames
SAME_RUN_S = 1.0  # two frames whose engines started further apart than this are two runs


@dataclass(frozen=True)
class Rate:
    """A counter's increase over a window, and the seconds it spans."""

    increase: float
    seconds: float

    @property
    def per_s(self) -> float:
        return self.increase / self.seconds


def figure(frame: dict, path: str) -> float | None:
    """The usable number at `path` ("a.b": `frame["a"]["b"]`), or None where a key is missing or
    null or the value is not one (`kvtop.sources.prometheus.number`): one reading for every module."""
    node: object = frame
    for key in path.split("."):
        if not isinstance(node, dict) or node.get(key) is None:
            return None
        node = node[key]
    return number(node)


def engine_start(frame: dict) -> float | None:
    """When the engine that sent `frame` started (unix seconds), or None where the frame does not say."""
    start = figure(frame, "engine.start_time")
    if start is not None:
        return start
    ts, up = figure(frame, "ts"), figure(frame, "engine.uptime_s")
    return None if ts is None or up is None else ts - up


def same_run(a: dict, b: dict) -> bool:
    """False where both frames say when their engine started and those starts differ."""
    sa, sb = engine_start(a), engine_start(b)
    return sa is None or sb is None or abs(sa - sb) < SAME_RUN_S


def run_window(history: list[dict], window_s: float = RATE_WINDOW_S) -> list[dict]:
    """The frames (oldest first) of the last frame's engine run in the `window_s` seconds up to it;
    a frame not later than the one after it (a repeat, a clock step back) is left out."""
    if not history:
        return []
    last = history[-1]
    since = (figure(last, "ts") or 0.0) - window_s
    out = [last]
    for f in reversed(history[:-1]):  # newest first: only the window's frames are read
        ts = figure(f, "ts")
        if ts is None or ts < since - 1e-9 or not same_run(f, last):
            break
        if ts < (figure(out[-1], "ts") or 0.0):
            out.append(f)
    return out[::-1]


def increase(values: list[float]) -> float:
    """A counter's increase over successive readings; one that went back was reset and counts from 0."""
    return sum(b - a if b >= a else b for a, b in pairwise(values))


def window_increase(history: list[dict], path: str, window_s: float = RATE_WINDOW_S) -> Rate | None:
    """The increase of the counter at `path` over the window, or None where fewer than two frames
    of the run carry it."""
    frames = [f for f in run_window(history, window_s) if figure(f, path) is not None]
    if len(frames) < 2:
        return None
    seconds = (figure(frames[-1], "ts") or 0.0) - (figure(frames[0], "ts") or 0.0)
    if seconds <= 0:
        return None
    return Rate(increase([figure(f, path) or 0.0 for f in frames]), seconds)


def window_rate(history: list[dict], path: str, window_s: float = RATE_WINDOW_S) -> float | None:
    """Per-second increase of the counter at `path` over the window (see the module docstring)."""
    r = window_increase(history, path, window_s)
    return None if r is None else r.per_s


def window_values(history: list[dict], path: str, window_s: float = RATE_WINDOW_S) -> list[float]:
    """The gauge at `path` in each frame of the window that carries it, oldest first."""
    return [v for f in run_window(history, window_s) if (v := figure(f, path)) is not None]
