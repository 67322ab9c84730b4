"""Percentiles of raw values, one way for the engine, `kvctl bench`, the demo, the what-if and the
benchmarks (stdlib only: the light install has no numpy, and the engine imports the protocol).

Two methods, named where they are used so that no caller's numbers change under it:

- `"linear"` (the default): numpy's default (`np.percentile(..., method="linear")`), to the last
  bit: the value at index `(n - 1) * p / 100` of the sorted values, interpolated between the two
  nearest as numpy's `_lerp` does (from the upper one where the fraction is at least 0.5). This is
  also statistics' `quantiles(method="inclusive")`, up to rounding.
- `"rank"`: no interpolation: the value at index `floor(n * p / 100)` of the sorted values (counted
  from 0, the last where that is past the end): nearest rank, one higher where `n * p / 100` is whole.

Histogram buckets are another thing: `kvtop.sources.prometheus.histogram_quantile`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

METHODS = ("linear", "rank")


def percentiles(
    values: Iterable[float], ps: Sequence[float], *, method: str = "linear", presorted: bool = False
) -> list[float | None]:
    """The `ps` percentiles (0 to 100) of `values` by `method`; a None for each where there are no
    values. `presorted`: `values` is a sequence sorted already (an `np.sort`ed array, say), used as is."""
    if method not in METHODS:
        raise ValueError(f"unknown percentile method {method!r}: use one of {', '.join(METHODS)}")
    xs = values if presorted else sorted(values)
    n = len(xs)
    if not n:
        return [None] * len(ps)
    if method == "rank":
        return [float(xs[min(n - 1, int(p / 100 * n))]) for p in ps]
    return [_linear(xs, n, p) for p in ps]


def percentile(values: Iterable[float], p: float, *, method: str = "linear") -> float | None:
    """One percentile (0 to 100) of `values` by `method` (see `percentiles`); None where there are none."""
    return percentiles(values, (p,), method=method)[0]


def _linear(xs: Sequence[float], n: int, p: float) -> float:
    index = (n - 1) * (p / 100)
    below = math.floor(index)
    t = index - below
    a, b = xs[below], xs[min(below + 1, n - 1)]
    diff = b - a
    return float(b - diff * (1 - t) if t >= 0.5 else a + diff * t)
