"""Time series derived from a run of frames: counters turned into rates, ratios over intervals.

Frames carry totals (preemptions, prefix hits, steps); panels want per-second rates and recent
ratios. Both live and replay hand the panels the frames up to the one shown, oldest first. A
figure that is not a usable number (a crafted file's 1e308 written as an integer) reads as missing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import pairwise

from kvtop.rates import RATE_WINDOW_S, window_rate
from kvtop.sources.prometheus import number


@functools.lru_cache(maxsize=256)
def _keys(path: str) -> tuple[str, ...]:
    return tuple(path.split("."))


def get(frame: dict, path: str, default: float | None = 0.0) -> float:
    """`frame["a"]["b"]` for path "a.b", or `default` where a key is missing or null, or the
    value there is not a usable number (`kvtop.sources.prometheus.number`)."""
    node: object = frame
    for key in _keys(path):
        if not isinstance(node, dict) or node.get(key) is None:
            return default
        node = node[key]
    return node if number(node) is not None else default  # type: ignore[return-value]


def values(history: list[dict], path: str) -> list[float]:
    return [float(get(f, path)) for f in history]


def rates(history: list[dict], path: str) -> list[float]:
    """Per-second increase of a counter between consecutive frames (restarts count from zero)."""
    out = []
    for a, b in pairwise(history):
        dt = get(b, "ts") - get(a, "ts")
        delta = get(b, path) - get(a, path)
        if delta < 0:  # the engine restarted: its counters began again
            delta = get(b, path)
        out.append(delta / dt if dt > 0 else 0.0)
    return out


def ratios(history: list[dict], num: str, den: str) -> list[float]:
    """Share of `den`'s increase that `num` made, interval by interval (0 where nothing happened)."""
    out = []
    for a, b in pairwise(history):
        d = get(b, den) - get(a, den)
        n = get(b, num) - get(a, num)
        out.append(n / d if d > 0 else 0.0)
    return out


def latest_rate(history: list[dict], path: str, span_s: float = RATE_WINDOW_S) -> float | None:
    """Per-second increase over the last `span_s` seconds of frames of the same engine run, as
    Prometheus' `rate()` (`kvtop.rates`); None where there is no earlier frame of that run."""
    return window_rate(history, path, span_s)


def frame_at_or_before(history: list[dict], ts: float) -> dict | None:
    """The newest frame no later than `ts` (history is oldest first)."""
    found = None
    for f in history:
        if f["ts"] > ts:
            break
        found = f
    return found


def bucketed(values_: list[float], width: int, reduce: Callable[[list[float]], float] = max) -> list[float]:
    """Squeeze a long series into at most `width` points (each the `reduce` of its slice)."""
    if width <= 0 or len(values_) <= width:
        return values_
    n = len(values_)
    return [reduce(values_[i * n // width : (i + 1) * n // width] or [0.0]) for i in range(width)]
