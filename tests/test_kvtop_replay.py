"""kvtop --replay over every snapshot in snapshots/: the dashboard fed from the file's frames,
stepped, jumped and played through the keys an operator uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtop.dashboard.app import KvtopApp
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.events import EventsPanel
from kvtop.dashboard.widgets.header import EngineHeader
from kvtop.dashboard.widgets.kv_panel import KVPanel
from kvtop.dashboard.widgets.sequences import SequencesPanel
from kvtop.dashboard.widgets.timeline import Timeline
from kvtop.protocol.snapshot import read_snapshot
from kvtop.sources import ReplaySource, parse_offset
from tests.helpers import widget_text as text

SNAPSHOTS = sorted((Path(__file__).resolve().parent.parent / "snapshots").glob("*.kvsnap"))


def last_at_or_before(frames: list[dict], offset: float) -> int:
    start = frames[0]["ts"]
    return max(i for i, f in enumerate(frames) if f["ts"] - start <= offset + 1e-6)


def test_there_are_incidents_to_replay():
    assert len(SNAPSHOTS) >= 2, "snapshots/ should hold the incidents recorded by scripts/record_incidents.py"
    for path in SNAPSHOTS:
        assert path.stat().st_size < 2 * 1024 * 1024, f"{path.name} is over 2 MB"


@pytest.mark.anyio
@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.stem)
@pytest.mark.slow  # 4 s of Pilot: the full suite's, not the fast lane's
async def test_replay_steps_jumps_and_plays(path: Path):
    snap = read_snapshot(path)
    source = ReplaySource(snap)
    n = len(snap.frames)
    length = snap.frames[-1]["ts"] - snap.frames[0]["ts"]
    app = KvtopApp(source)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        timeline = text(app.query_one(Timeline))
        assert f"frame 1/{n}" in timeline
        assert snap.meta["reason"][:40] in timeline  # the snapshot's trigger
        assert "paused" in timeline

        await pilot.press("right", "right", "right")
        assert source.index == 3
        assert f"frame 4/{n}" in text(app.query_one(Timeline))
        frame = snap.frames[3]
        assert f"step {frame['engine']['step']}" in text(app.query_one(EngineHeader))
        kv_lines = text(app.query_one(KVPanel)).splitlines()
        used = next(line for line in kv_lines if line.startswith("used"))
        assert used.split()[1] == str(frame["kv"]["used"])

        await pilot.press("left")
        assert source.index == 2

        await pilot.press("G")  # the snapshot's moment: the map and table are the file's last frame
        last = snap.frames[-1]
        assert source.index == n - 1
        await pilot.pause()
        grid = text(app.query_one(BlockMap).query_one("#block-grid"))
        assert last["kv"]["blocks"] in grid.replace("\n", "")
        table = app.query_one(SequencesPanel).table
        assert table.row_count == len(last["sequences"]) == len(snap.sequences)
        if any(e["kind"] == "preempted" for e in snap.events):
            assert "preempted" in text(app.query_one(EventsPanel))

        await pilot.press("g")
        assert source.index == 0
        await pilot.press("right_square_bracket")  # the last frame at or before +10 s
        assert source.index == last_at_or_before(snap.frames, 10.0)
        await pilot.press("left_square_bracket")
        assert source.index == 0

        await pilot.press("t")  # jump to a time (j moves the sequences cursor)
        await pilot.press(*"50%", "enter")
        assert source.index == last_at_or_before(snap.frames, length / 2)
        assert f"frame {source.index + 1}/{n}" in text(app.query_one(Timeline))

        for _ in range(3):
            await pilot.press("plus")
        assert source.speed == 8.0
        await pilot.press("minus")
        assert source.speed == 4.0
        await pilot.press("minus", "minus")  # ×1: on a loaded box the second space must come before the end
        before = source.index
        await pilot.press("space")
        assert source.playing
        await pilot.pause(1.0)
        await pilot.press("space")
        assert not source.playing
        assert source.index > before
        assert "paused" in text(app.query_one(Timeline))


@pytest.mark.anyio
async def test_replay_has_no_live_actions():
    source = ReplaySource(read_snapshot(SNAPSHOTS[0]))
    app = KvtopApp(source)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        for action in ("drain", "resume", "evict_sequence", "evict_prefix", "snapshot"):
            assert app.dashboard.check_action(action, ()) is False
        await pilot.press("d")
        assert app.screen is app.screen_stack[0]  # no dialog opened
        keys = {b.binding.key for b in app.active_bindings.values()}
        assert {"d", "r", "e", "E", "s"}.isdisjoint(keys)


@pytest.mark.anyio
async def test_a_long_folder_does_not_hide_the_snapshots_name(tmp_path: Path):
    """The header names the file first and its folder last: on an 80-column terminal a snapshot
    deep in a long path still says which file is on screen."""
    deep = tmp_path.joinpath(*(["incidents-from-the-night-shift"] * 4))
    deep.mkdir(parents=True)
    path = deep / "checkout-outage.kvsnap"
    path.write_bytes(SNAPSHOTS[0].read_bytes())
    app = KvtopApp(ReplaySource(read_snapshot(path)))
    async with app.run_test(size=(80, 30)) as pilot:
        await pilot.pause()
        header = text(app.query_one(EngineHeader))
        assert "◆ replay checkout-outage.kvsnap" in header
        assert "incidents-from-the-night-shift" not in header.split("checkout-outage.kvsnap")[0]


def test_replay_source_seeks_and_plays_with_a_clock():
    snap = read_snapshot(SNAPSHOTS[0])
    now = [100.0]
    source = ReplaySource(snap, clock=lambda: now[0])
    length = source.end_ts - source.start_ts
    assert source.seek(-5).get("ts") == snap.frames[0]["ts"]  # clamped at the start
    assert source.seek(length + 60) is snap.frames[-1]
    source.start()
    source.speed = 2.0
    source.play()
    now[0] += length / 4
    source.poll()  # twice the speed: half way
    assert source.index == last_at_or_before(snap.frames, length / 2)
    now[0] += 10 * length
    source.poll()
    assert source.index == len(snap.frames) - 1 and not source.playing  # stops at the end
    source.play()  # playing from the end starts over
    assert source.index == 0


@pytest.mark.parametrize(
    ("typed", "expected"),
    [("12.5", 12.5), ("+3", 3.0), ("-5", 55.0), ("1:30", 90.0), ("50%", 30.0), ("0", 0.0)],
)
def test_parse_offset(typed: str, expected: float):
    assert parse_offset(typed, 60.0) == pytest.approx(expected)


@pytest.mark.parametrize("typed", ["", "soon", "1:xx", "%"])
def test_parse_offset_refuses_with_a_usable_message(typed: str):
    with pytest.raises(ValueError, match="12.5"):
        parse_offset(typed, 60.0)
