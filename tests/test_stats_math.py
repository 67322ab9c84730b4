"""One percentile for the engine, bench, the demo, the what-if and the benchmarks (issue #42): its
linear method is numpy's default to the last bit (so the engine's and the what-if's figures did not
move when they left np.percentile), its rank method what benchmarks/prefix.py computed."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtop.protocol.stats_math import percentile, percentiles

PS = [0, 1, 12.5, 25, 50, 90, 95, 99, 99.9, 100]


def test_linear_is_numpys_default_to_the_bit():
    rng = random.Random(7)
    for _ in range(500):
        xs = [rng.lognormvariate(0, 2) * rng.choice((1e-3, 1.0, 1e3)) for _ in range(rng.randint(1, 200))]
        want = [float(v) for v in np.percentile(np.array(xs), PS)]
        assert percentiles(xs, PS) == want
        assert percentiles(np.sort(np.array(xs)), PS, presorted=True) == want


def test_rank_is_the_value_at_floor_q_n():
    rng = random.Random(8)
    for n in range(1, 120):
        xs = [rng.random() for _ in range(n)]
        s = sorted(xs)
        for q in (0.25, 0.5, 0.99):
            assert percentile(xs, q * 100, method="rank") == s[min(n - 1, int(q * n))]
    assert percentiles([4.0, 1.0, 3.0, 2.0], (50,), method="rank") == [3.0]  # index 2, not nearest rank's 2.0


def test_no_values_and_unknown_methods():
    assert percentiles([], (50, 99)) == [None, None]
    assert percentile(iter(()), 50, method="rank") is None
    assert percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError, match="unknown percentile method"):
        percentiles([1.0], (50,), method="nearest")
