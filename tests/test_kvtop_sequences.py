"""The sequences table drawn as lines of text (issue #10: kvtop's CPU), and the selection the block
map follows: the cursor keys, page keys, clicks on rows and headers, many rows in a small panel,
and the two races that left the map showing another frame or another sequence than the cursor.
Replayed from the recorded incidents, so every frame is known."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual import events

from kvtop import fmt
from kvtop.dashboard.app import KvtopApp
from kvtop.dashboard.messages import SortChosen
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.sequence_detail import SequenceScreen
from kvtop.dashboard.widgets.sequences import SequencesPanel, SequencesTable
from kvtop.protocol.snapshot import Snapshot, read_snapshot, write_snapshot
from kvtop.sources import ReplaySource
from tests.helpers import widget_text as text

STORM = Path(__file__).resolve().parent.parent / "snapshots" / "preemption-storm.kvsnap"
SIZE = (160, 48)


def highlighted(app: KvtopApp) -> int:
    """How many cells of the block map are drawn in reverse video (the selected sequence's blocks)."""
    grid = app.query_one(BlockMap).query_one("#block-grid").content
    return sum(span.end - span.start for span in grid.spans if "reverse" in str(span.style))


def shows_selection(app: KvtopApp, frame: dict) -> bool:
    """The block map draws `frame` with the selected sequence's blocks reversed and named under it."""
    bm = app.query_one(BlockMap)
    grid = text(bm.query_one("#block-grid")).replace("\n", "")
    seq = next(s for s in frame["sequences"] if s["id"] == app.dashboard.state.selected_seq)
    named = f"{seq['id']}: {len(seq['block_ids'])} blocks" in str(bm.border_subtitle)
    return frame["kv"]["blocks"] in grid and named and highlighted(app) == len(seq["block_ids"])


def table_lines(app: KvtopApp) -> list[str]:
    return text(app.query_one(SequencesTable)).splitlines()


def crowd(tmp_path: Path, copies: int = 5) -> Snapshot:
    """The storm with each sequence five times over: more rows than the panel has lines."""
    snap = read_snapshot(STORM)
    frames = [
        {**f, "sequences": [{**s, "id": f"{s['id']}-{k}"} for k in range(copies) for s in f["sequences"]]}
        for f in snap.frames
    ]
    path = write_snapshot(tmp_path / "crowd.kvsnap", model="tiny", config={}, reason="test", frames=frames, events=[])
    return read_snapshot(path)


@pytest.mark.anyio
async def test_a_resize_then_a_new_frame_draws_the_new_frame_in_the_block_map():
    """The race behind the replayed `[/x]` test: the map's redraw after a resize used the view it
    had at the resize, so a frame shown meanwhile (`G` right after opening) was drawn over by an
    older one, the selection's highlight with it. Textual calls `on_resize` when the map's size
    changes (the first layout, a terminal resize, a scrollbar); here the next frame comes before
    the screen refreshes, as it did then."""
    snap = read_snapshot(STORM)
    app = KvtopApp(ReplaySource(snap))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
        app.dashboard.action_step(10)
        await pilot.pause(0.2)
        assert shows_selection(app, snap.frames[10])
        app.query_one(BlockMap).on_resize()
        app.dashboard.action_step(30)
        await pilot.pause(0.3)
        assert snap.frames[40]["kv"]["blocks"] != snap.frames[10]["kv"]["blocks"]
        assert shows_selection(app, snap.frames[40])
        await pilot.press("j")  # and a cursor move right after
        await pilot.pause(0.2)
        assert shows_selection(app, snap.frames[40])


@pytest.mark.anyio
async def test_a_frame_right_after_a_cursor_move_keeps_the_cursor():
    """The cursor sets the selection as it moves: a frame drawn before the app has read the move
    (a live poll, a replay step) keeps the row the operator chose, and the map shows that row's."""
    snap = read_snapshot(STORM)
    app = KvtopApp(ReplaySource(snap))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
        app.dashboard.action_step(10)
        await pilot.pause(0.2)
        table = app.query_one(SequencesTable)
        chosen = table.ids[5]
        table.move_cursor(row=5)
        app.dashboard.action_step(1)  # the next frame, before any message is read
        await pilot.pause(0.3)
        frame = snap.frames[11]
        assert chosen in {s["id"] for s in frame["sequences"]}
        assert app.dashboard.state.selected_seq == chosen and table.cursor_id() == chosen
        assert shows_selection(app, frame)


@pytest.mark.anyio
async def test_clicks_select_a_row_open_it_and_sort_by_a_header():
    snap = read_snapshot(STORM)
    app = KvtopApp(ReplaySource(snap))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("G")
        await pilot.pause(0.2)
        table = app.query_one(SequencesTable)
        assert table.row_count == len(snap.frames[-1]["sequences"]) >= 2
        second = table.ids[1]
        assert app.dashboard.state.selected_seq != second
        await pilot.click(SequencesTable, offset=(3, 2))  # the header is line 0: the second row
        assert app.dashboard.state.selected_seq == second and table.cursor_row == 1
        assert table_lines(app)[2].strip().startswith(second)
        await pilot.pause(0.2)
        assert shows_selection(app, snap.frames[-1])
        assert app.screen is app.dashboard  # a click on another row only selects it
        await pilot.click(SequencesTable, offset=(3, 2))  # on the selected row: its details
        assert isinstance(app.screen, SequenceScreen) and app.screen.seq_id == second
        await pilot.press("escape")

        header = table_lines(app)[0]
        await pilot.click(SequencesTable, offset=(1 + header.index("prompt") + 1, 0))
        assert app.dashboard.state.sort == "prompt" and app.dashboard.state.sort_reverse
        prompts = {s["id"]: s["prompt_tokens"] for s in snap.frames[-1]["sequences"]}
        assert [prompts[i] for i in table.ids] == sorted(prompts.values(), reverse=True)
        assert "prompt↓" in table_lines(app)[0]
        assert app.dashboard.state.selected_seq == second  # sorting keeps the selection, wherever its row went


@pytest.mark.anyio
@pytest.mark.slow  # 3 s of Pilot: the full suite's, not the fast lane's
async def test_more_rows_than_lines_the_cursor_stays_on_screen(tmp_path: Path):
    snap = crowd(tmp_path)
    app = KvtopApp(ReplaySource(snap))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("G")
        await pilot.pause(0.2)
        table = app.query_one(SequencesTable)
        n = len(snap.frames[-1]["sequences"])
        on_screen = len(table_lines(app)) - 1
        assert table.row_count == n > on_screen
        assert f"Sequences ({n})" in str(app.query_one(SequencesPanel).border_title)
        assert isinstance(app.focused, SequencesTable)
        await pilot.press("end")
        last = table.ids[-1]
        assert table.cursor_row == n - 1 and app.dashboard.state.selected_seq == last
        assert table_lines(app)[-1].strip().startswith(last)  # scrolled to it
        await pilot.pause(0.2)
        assert shows_selection(app, snap.frames[-1])
        await pilot.press("home", "pagedown")
        assert table.cursor_row == on_screen - 1 and table.ids[on_screen - 1] in " ".join(table_lines(app))
        await pilot.press("j", "j")  # below the last line: the table scrolls one line at a time
        lines = table_lines(app)
        assert lines[-1].strip().startswith(table.ids[on_screen + 1]) and table.ids[0] not in " ".join(lines)
        await pilot.press("k", "enter")
        assert isinstance(app.screen, SequenceScreen) and app.screen.seq_id == table.ids[on_screen]
        await pilot.press("escape", "home")
        # the wheel moves the cursor three rows a notch (Pilot has no wheel: its own mouse-event poster)
        await pilot._post_mouse_events([events.MouseScrollDown], SequencesTable, (3, 3), times=2)
        assert table.cursor_row == 6 and app.dashboard.state.selected_seq == table.ids[6]
        await pilot.double_click(SequencesTable, offset=(3, 2))  # a double click opens a row at once
        assert isinstance(app.screen, SequenceScreen) and app.screen.seq_id == table.ids[table.top + 1]


@pytest.mark.anyio
@pytest.mark.slow  # 2 s of Pilot: the full suite's, not the fast lane's
async def test_a_narrow_panel_hides_the_least_needed_columns_not_the_latencies():
    """The 120x40 overview's sequences panel cannot hold every column: blocks (its KV MiB says as
    much), then cached, age, prompt go, so TTFT and ITL stay whole and clickable; the column sorted
    by never goes; a wide panel shows them all."""
    snap = read_snapshot(STORM)
    itl = {s["id"]: s.get("itl_s") for s in snap.frames[-1]["sequences"]}
    app = KvtopApp(ReplaySource(snap))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("G")
        await pilot.pause(0.2)
        table = app.query_one(SequencesTable)
        lines = table_lines(app)
        assert lines[0].split()[-2:] == ["TTFT", "ITL"] and "blks" not in lines[0].split()
        rows = lines[1 : 1 + len(table.ids)]
        assert rows and all("…" not in row for row in rows)  # no cell cut
        assert [row.split()[-1] for row in rows] == [fmt.secs(itl[i]) if itl[i] is not None else "-" for i in table.ids]

        await pilot.click(SequencesTable, offset=(1 + lines[0].index("ITL") + 1, 0))
        assert app.dashboard.state.sort == "itl"  # a header's place still maps to its own column

        app.dashboard.on_sort_chosen(SortChosen("blocks"))
        await pilot.pause(0.2)
        assert "blks↓" in table_lines(app)[0].split()  # the column sorted by shows, narrow or not

    app = KvtopApp(ReplaySource(snap))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("G")
        await pilot.pause(0.2)
        header = table_lines(app)[0].split()
        assert header == ["id", "state", "prompt", "out", "cached", "blks", "KV", "MiB", "age↓", "TTFT", "ITL"]
