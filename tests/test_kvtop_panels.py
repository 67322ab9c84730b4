"""Panels drawn from hand-made frames, for what the test engine never produces: NVML figures
(no GPU here), a drain deadline, counters reset by a restart, sequences without a TTFT yet."""

from __future__ import annotations

import copy
from pathlib import Path

from kvtop.dashboard.widgets import series
from kvtop.dashboard.widgets.header import drain_detail
from kvtop.dashboard.widgets.latency import LatencyPanel, window_counts
from kvtop.dashboard.widgets.memory import MemoryPanel
from kvtop.dashboard.widgets.sequences import visible
from kvtop.dashboard.widgets.view import View, ViewState
from kvtop.protocol.snapshot import read_snapshot

STORM = Path(__file__).resolve().parent.parent / "snapshots" / "preemption-storm.kvsnap"
FRAMES = read_snapshot(STORM).frames


def view(frame: dict, history: list[dict] | None = None, **state) -> View:
    return View(frame, history or [frame], frame.get("events", []), ViewState(**state))


def test_memory_with_and_without_nvml():
    frame = copy.deepcopy(FRAMES[-1])
    assert "no NVIDIA GPU" in MemoryPanel().draw(view(frame), 60, 10).plain
    frame["engine"]["device"] = "cuda:0"
    frame["memory"]["nvml"] = {"gpu_util": 87, "mem_bw_util": 64, "mem_used": 70 * 2**30, "mem_total": 80 * 2**30}
    text = MemoryPanel().draw(view(frame), 60, 10).plain
    assert "no NVIDIA GPU" not in text
    assert "GPU util" in text and "87%" in text and "mem bw" in text and "64%" in text
    assert "70.0 GiB / 80.0 GiB" in text


def test_memory_shows_a_prefill_copy_beside_the_weights_only_where_there_is_one():
    frame = copy.deepcopy(FRAMES[-1])  # a snapshot from before the field: no copy shown
    assert "prefill copy" not in MemoryPanel().draw(view(frame), 70, 10).plain
    frame["memory"]["prefill_copy"] = 203 * 2**20
    line = next(t for t in MemoryPanel().draw(view(frame), 70, 10).plain.splitlines() if t.startswith("weights"))
    assert "+ 203.0 MiB prefill copy" in line


def test_memory_says_the_weights_format_where_the_engine_sends_it():
    frame = copy.deepcopy(FRAMES[-1])  # a snapshot from before the field: the bytes alone
    frame["memory"]["weights"] = 96_576_768
    frame["memory"]["weights_format"] = "Q4_1, Q8_0, float32"
    line = next(t for t in MemoryPanel().draw(view(frame), 70, 10).plain.splitlines() if t.startswith("weights"))
    assert "92.1 MiB Q4_1, Q8_0, float32" in line


def test_drain_detail_in_the_header():
    frame = copy.deepcopy(FRAMES[-1])
    assert drain_detail(frame) == ""
    frame["engine"]["state"] = "draining"
    ts = frame["ts"]
    frame["server"] = {"in_flight": 3, "drain": {"deadline": ts + 25, "abort_after": True}}
    assert drain_detail(frame) == " (3 in flight, abort in 25s)"


def test_last_minute_histogram_is_a_difference_of_frames():
    first, last = copy.deepcopy(FRAMES[0]), copy.deepcopy(FRAMES[-1])
    last["engine"]["uptime_s"] = 600.0
    first["ts"] = last["ts"] - 90  # more than a minute back: the window starts after it
    mid = copy.deepcopy(last)
    mid["ts"] = last["ts"] - 61
    mid["latency"]["itl"]["counts"] = [max(0, c - 1) for c in last["latency"]["itl"]["counts"]]
    counts, label = window_counts(view(last, [first, mid, last]), "itl")
    assert label == "last 1m"
    assert counts == [c - max(0, c - 1) for c in last["latency"]["itl"]["counts"]]
    restarted = copy.deepcopy(mid)
    restarted["latency"]["itl"]["counts"] = [c + 5 for c in last["latency"]["itl"]["counts"]]
    assert window_counts(view(last, [restarted, last]), "itl")[1] == "since restart"


def test_latency_panel_marks_percentiles():
    frame = FRAMES[-1]
    text = LatencyPanel().draw(view(frame, FRAMES, latency_all=True), 52, 28).plain
    for name in ("TTFT", "ITL", "e2e", "queue"):
        assert name in text
    assert "▲" in text and "≤" in text


def test_rates_survive_a_counter_reset():
    a, b, c = (copy.deepcopy(FRAMES[-1]) for _ in range(3))
    a["ts"], b["ts"], c["ts"] = 0.0, 1.0, 2.0
    a["scheduler"]["preemptions_total"], b["scheduler"]["preemptions_total"] = 10, 14
    c["scheduler"]["preemptions_total"] = 2  # the engine restarted
    assert series.rates([a, b, c], "scheduler.preemptions_total") == [4.0, 2.0]


def test_sequences_sort_puts_missing_values_last_both_ways():
    seqs = [
        {"id": "a", "state": "running", "ttft_s": 0.5},
        {"id": "b", "state": "waiting", "ttft_s": None},
        {"id": "c", "state": "running", "ttft_s": 0.1},
    ]
    assert [s["id"] for s in visible(seqs, "", "ttft", reverse=False)] == ["c", "a", "b"]
    assert [s["id"] for s in visible(seqs, "", "ttft", reverse=True)] == ["a", "c", "b"]
    assert [s["id"] for s in visible(seqs, "WAIT", "id", reverse=False)] == ["b"]
