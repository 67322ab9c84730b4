"""`benchmarks/peers.py --serving --rounds N`: what the alternated serving table reports.

The figures in benchmarks/README.md come from this arithmetic, so it is pinned here on made-up runs:
each round gives both servers the same seed (moved on by the round), each server's figure is the
median of its runs, and the ratio is the median of the rounds' own ratios, oriented so that > 1
means ours is better (throughput ours/vLLM, latency vLLM/ours).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from serving_peers import ROWS, summary, with_seed


def test_each_round_moves_the_seed_for_both_servers():
    load = "--num-prompts 32 --input-len 256 --seed 7"
    assert with_seed(load, 0) == ["--num-prompts", "32", "--input-len", "256", "--seed", "7"]
    assert with_seed(load, 3)[-2:] == ["--seed", "10"]
    assert with_seed("--num-prompts 4", 2) == ["--num-prompts", "4", "--seed", "2"]  # none given: from 0


def _run(server: str, rnd: int, tok_s: float, ttft_s: float) -> dict:
    return {
        "dtype": "bfloat16", "server": server, "round": rnd, "output_token_throughput": tok_s,
        "ttft_s": {"p50": ttft_s, "p99": 2 * ttft_s}, "itl_s": {"p50": 0.05, "p99": 0.08},
        "server_tok_per_cpu_s": tok_s / 2, "failed": 0,
    }  # fmt: skip


def test_medians_and_per_round_ratios_oriented_ours_better_above_one():
    # round 0 a quiet minute (both fast), round 1 a busy one (both slow), round 2 in between
    reps = [
        _run("ours", 0, 300.0, 1.0), _run("vllm", 0, 200.0, 2.0),
        _run("vllm", 1, 100.0, 4.0), _run("ours", 1, 120.0, 3.0),
        _run("ours", 2, 200.0, 1.5), _run("vllm", 2, 160.0, 3.0),
    ]  # fmt: skip
    ours, vllm, ratios = summary(reps, "bfloat16")
    assert ours["output tok/s"] == 200.0 and vllm["output tok/s"] == 160.0  # medians of the runs
    assert ours["TTFT P50 ms"] == 1.5 and vllm["TTFT P50 ms"] == 3.0  # seconds here; the table scales
    by_label = dict(zip([label for label, *_ in ROWS], ratios, strict=True))
    assert by_label["output tok/s"] == pytest.approx(1.25)  # rounds: 1.5, 1.2, 1.25
    assert by_label["TTFT P50 ms"] == pytest.approx(2.0)  # vLLM/ours: 2.0, 1.33, 2.0 -> ours faster
    assert by_label["failed"] is None  # nothing to divide


def test_a_round_one_server_missed_counts_in_its_median_not_in_the_ratios():
    reps = [_run("ours", 0, 100.0, 1.0), _run("vllm", 0, 100.0, 1.0), _run("ours", 1, 400.0, 1.0)]
    ours, _vllm, ratios = summary(reps, "bfloat16")
    assert ours["output tok/s"] == 250.0
    assert ratios[0] == pytest.approx(1.0)  # only round 0 has both
