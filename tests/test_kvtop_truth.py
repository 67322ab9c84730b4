"""kvtop tells the truth: one meaning per number, nothing stale, no zeros where there is no data.

The diagnosis on hand-made frames and on the frames of the recorded incidents in snapshots/;
the dashboard's panels on hand-made frames; and against a real `kvctl serve`: the header when
the engine is killed, and the restart as an event.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from engine.snapshot import read_snapshot
from kvtop.diagnosis import diagnose

ROOT = Path(__file__).resolve().parent.parent
STORM = ROOT / "snapshots" / "preemption-storm.kvsnap"
THRASH = ROOT / "snapshots" / "prefix-thrash.kvsnap"


def frame(ts: float = 1000.0, uptime: float = 100.0, **parts: dict) -> dict:
    """A frame of a healthy engine (DESIGN §6), with `parts` merged over it section by section."""
    f = {
        "schema": 1,
        "ts": ts,
        "engine": {"state": "running", "model": "m", "device": "cpu", "uptime_s": uptime, "step": int(uptime * 10)},
        "kv": {"block_size": 16, "num_blocks": 64, "free": 30, "cached": 10, "allocatable": 40, "used": 24,
               "shared": 0, "usage": 0.375, "blocks": "." * 30 + "c" * 10 + "u" * 24},
        "sequences": [],
        "scheduler": {"running": 4, "waiting": 0, "swapped": 0, "max_num_seqs": 8, "active_tokens": 400,
                      "preemptions_total": 0},
        "prefix": {"enabled": True, "query_tokens": 1000, "hit_tokens": 500, "hit_rate": 0.5, "queries": 10,
                   "hit_requests": 5, "request_hit_rate": 0.5, "evictions": 0},
        "counters": {"requests_finished": 10, "requests_aborted": 0, "requests_failed": 0},
        "server": {"in_flight": 4, "max_queue": 16, "rejected": {}, "drain": None},
        "events": [],
    }  # fmt: skip
    for section, values in parts.items():
        f[section] = {**f[section], **values} if isinstance(f[section], dict) else values
    return f


def later(f: dict, seconds: float, **parts: dict) -> dict:
    """The same engine `seconds` later, with `parts` changed."""
    g = copy.deepcopy(f)
    g["ts"] += seconds
    g["engine"]["uptime_s"] += seconds
    for section, values in parts.items():
        g[section] = {**g[section], **values}
    return g


# ---- the diagnosis on hand-made frames ------------------------------------------------------
def test_a_healthy_engine_has_nothing_to_say():
    f = frame()
    assert diagnose(f) == []
    assert diagnose(later(f, 2), [f]) == []


def test_waiting_with_no_free_block_is_kv_bound():
    f = frame(kv={"free": 0, "cached": 0, "allocatable": 0}, scheduler={"waiting": 7})
    (line,) = diagnose(f)
    assert line.startswith("7 waiting, 0 free blocks: KV-bound")
    assert "--kv-cache-memory" in line and "--max-model-len" in line


def test_cached_blocks_are_free_for_a_new_request():
    """Cached blocks can be reallocated, so a queue with cached blocks is not KV-bound."""
    f = frame(kv={"free": 0, "cached": 5, "allocatable": 5}, scheduler={"waiting": 3})
    assert not any("KV-bound" in line for line in diagnose(f))


def test_an_old_frame_without_allocatable_counts_cached_in_free():
    f = frame(scheduler={"waiting": 2})
    del f["kv"]["allocatable"]
    f["kv"].update(free=5, cached=5)  # the old meaning: 5 allocatable, 5 of them cached
    assert diagnose(f) == []
    f["kv"].update(free=0, cached=0)
    assert diagnose(f)[0].startswith("2 waiting, 0 free blocks: KV-bound")


def test_preemptions_need_history_and_give_a_rate():
    f = frame(scheduler={"preemptions_total": 10})
    g = later(f, 4, scheduler={"preemptions_total": 18})
    assert diagnose(g) == []  # one frame cannot say how often
    (line,) = diagnose(g, [f])
    assert line.startswith("preempting 2.0/s:")


def test_prefix_thrash_from_the_last_seconds():
    f = frame(prefix={"query_tokens": 1000, "hit_tokens": 500, "evictions": 10})
    g = later(f, 5, prefix={"query_tokens": 2000, "hit_tokens": 500, "evictions": 25})
    (line,) = diagnose(g, [f])
    assert line.startswith("prefix hit rate 0 % with evictions 3.0 blocks/s: prefix thrash")
    healthy = later(f, 5, prefix={"query_tokens": 2000, "hit_tokens": 1000, "evictions": 25})
    assert diagnose(healthy, [f]) == []  # evicting while hitting half the time: not a thrash


def test_draining_and_drained_say_so():
    f = frame(engine={"state": "draining"}, server={"in_flight": 3})
    assert diagnose(f)[0].startswith("draining: admitting nothing (503), 3 in flight")
    f = frame(engine={"state": "drained"}, server={"in_flight": 0})
    assert diagnose(f)[0].startswith("drained: admitting nothing")


def test_queue_full_rejections_in_the_window():
    f = frame(server={"rejected": {"queue_full": 3}})
    g = later(f, 4, server={"rejected": {"queue_full": 15, "draining": 2}})
    (line,) = diagnose(g, [f])
    assert line.startswith("queue full: 12 requests refused (429) in 4s")


def test_bound_by_max_num_seqs_when_kv_has_room():
    f = frame(scheduler={"running": 8, "waiting": 5})
    (line,) = diagnose(f)
    assert line.startswith("5 waiting, 8/8 running: bound by --max-num-seqs with 40 blocks free")


def test_a_restart_in_the_window_is_not_a_rate():
    """Counters of a new engine run start again: comparing them with the old run would lie."""
    old = frame(ts=1000, uptime=500, scheduler={"preemptions_total": 100})
    new = frame(ts=1003, uptime=2, scheduler={"preemptions_total": 4})
    assert diagnose(new, [old]) == []


def test_several_findings_most_pressing_first():
    f = frame(kv={"free": 0, "cached": 0, "allocatable": 0}, scheduler={"waiting": 4, "preemptions_total": 0})
    g = later(f, 2, scheduler={"preemptions_total": 6}, engine={"state": "draining"})
    lines = diagnose(g, [f])
    assert [line.split(":")[0] for line in lines] == ["draining", "4 waiting, 0 free blocks", "preempting 3.0/s"]


# ---- the diagnosis on real frames (the recorded incidents) --------------------------------------
def findings(path: Path) -> list[list[str]]:
    frames = read_snapshot(path).frames
    return [diagnose(f, frames[max(0, i - 50) : i]) for i, f in enumerate(frames)]


def test_the_preemption_storm_is_diagnosed_as_preempting_and_kv_bound():
    seen = [line for lines in findings(STORM) for line in lines]
    assert any(line.startswith("preempting ") for line in seen)
    assert any("waiting, 0 free blocks: KV-bound" in line for line in seen)
    assert findings(STORM)[0] == []  # the first frame, before the storm: nothing yet


def test_the_prefix_thrash_is_diagnosed_as_a_thrash():
    per_frame = findings(THRASH)
    assert "prefix thrash" in per_frame[-1][0]
    assert per_frame[0] == []
    assert not any("preempting" in line for lines in per_frame for line in lines)


@pytest.mark.parametrize("path", [STORM, THRASH], ids=["storm", "thrash"])
def test_every_finding_says_what_to_do(path: Path):
    for lines in findings(path):
        for line in lines:
            assert ": " in line and " — " in line, line
