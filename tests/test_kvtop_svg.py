"""SVG snapshots of the dashboard (pytest-textual-snapshot) at 80×24, 120×40 and 160×48, live and replay.

Stable by construction: replay shows a fixed frame of a snapshot in snapshots/; live is fed the
same kind of fixed frames through LiveSource with a stand-in client (no clock, no engine), and
times are drawn in UTC. After re-recording snapshots/, refresh with
`.venv/bin/python -m pytest tests/test_kvtop_svg.py --snapshot-update` and look at the SVGs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar

import pytest

from kvtop.dashboard.app import KvtopApp
from kvtop.protocol.snapshot import read_snapshot
from kvtop.sources import LiveSource, ReplaySource

ROOT = Path(__file__).resolve().parent.parent
STORM = Path("snapshots/preemption-storm.kvsnap")  # relative: the header shows the path as typed
THRASH = Path("snapshots/prefix-thrash.kvsnap")
SOCKET = "/run/user/1000/kvtop-1000/engine.sock"


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


class FixedClient:
    """Stands in for EngineClient: the frames of a recorded incident, the last one as "now"."""

    frames: ClassVar[list[dict]] = []

    def __init__(self, path, timeout) -> None:
        pass

    def stats(self) -> dict:
        return self.frames[-1]

    def history(self, since: float | None = None) -> dict:
        return {"frames": self.frames[:-1], "events": []}

    def close(self) -> None:
        pass

    def __enter__(self) -> FixedClient:
        return self

    def __exit__(self, *exc) -> None:
        pass


def live_app(snapshot: Path, at: int) -> KvtopApp:
    FixedClient.frames = read_snapshot(snapshot).frames[: at + 1]
    return KvtopApp(LiveSource(SOCKET, interval=3600, client_factory=FixedClient))


async def two_polls(pilot) -> None:
    """The first poll shows a frame, the second seeds the sparklines from the history."""
    app = pilot.app
    app.dashboard.source.poll()
    app.dashboard.source.poll()
    app.dashboard.redraw()
    await pilot.pause()


def replay_app(snapshot: Path, at: int = 0) -> KvtopApp:
    source = ReplaySource(read_snapshot(snapshot))
    source.step(at)  # as if → had been pressed `at` times (test_kvtop_replay presses the keys)
    return KvtopApp(source)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_live(snap_compare, size):
    assert snap_compare(live_app(THRASH, at=120), terminal_size=size, run_before=two_polls)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_replay(snap_compare, size):
    # 60 frames in: mid-storm, with preemptions in the events and on the timeline
    assert snap_compare(replay_app(STORM, at=60), terminal_size=size)


def test_live_overview_120x40(snap_compare):
    """A common SSH window: KV cache, block map, sequences, prefix cache and latency at once."""
    assert snap_compare(live_app(STORM, at=60), terminal_size=(120, 40), run_before=two_polls)


def test_live_sequences_tab_80x24(snap_compare):
    assert snap_compare(live_app(STORM, at=60), terminal_size=(80, 24), run_before=two_polls, press=["2"])


def test_replay_latency_tab_80x24(snap_compare):
    assert snap_compare(replay_app(THRASH), terminal_size=(80, 24), press=["G", "3"])


def test_drain_dialog_80x24(snap_compare):
    assert snap_compare(live_app(STORM, at=60), terminal_size=(80, 24), run_before=two_polls, press=["d"])


def test_help_160x48(snap_compare):
    assert snap_compare(live_app(STORM, at=60), terminal_size=(160, 48), run_before=two_polls, press=["question_mark"])


def test_too_small(snap_compare):
    assert snap_compare(replay_app(STORM), terminal_size=(50, 14))
