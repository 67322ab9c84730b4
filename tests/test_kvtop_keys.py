"""kvtop's keys against a real `kvctl serve` (tiny model) under load: nothing typed by accident
reaches the engine (issue #10), htop/k9s habits (quit keys, j/k, details, sort picker), and ids
or filter text that look like markup (issue #11). Type-ahead is sent with `pilot.press` (each key
handled before the next) and with `burst`: every key at once, as a terminal read of several bytes
delivers them (tmux send-keys, a paste, a slow link) — the case that drained a live engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from textual import events
from textual.widgets import Button, Checkbox, Input

from kvtop.dashboard.app import KvtopApp
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.confirm import ConfirmScreen
from kvtop.dashboard.widgets.drain_dialog import DrainScreen
from kvtop.dashboard.widgets.help import HelpScreen, key_label
from kvtop.dashboard.widgets.jump_dialog import JumpScreen
from kvtop.dashboard.widgets.sequence_detail import SequenceScreen, block_ranges
from kvtop.dashboard.widgets.sequences import SequencesPanel, SequencesTable
from kvtop.dashboard.widgets.sort_picker import SortScreen
from kvtop.protocol.snapshot import read_snapshot, write_snapshot
from kvtop.sources import ReplaySource
from tests.helpers import widget_text as text
from tests.test_kvtop_live import SIZE, Engine, Load, busy, live_app, until
from tests.test_kvtop_terminal import Terminal, base_env

KEY_CHARS = {"slash": "/", "enter": "\r", "left_square_bracket": "[", "escape": "\x1b"}
SNAPSHOTS = sorted((Path(__file__).resolve().parent.parent / "snapshots").glob("*.kvsnap"))


@pytest.fixture(scope="module")
def server(tiny_dir):
    """test_kvtop_live's engine under its load: one `kvctl serve` for the module."""
    engine = Engine(tiny_dir)
    load = Load(engine, str(tiny_dir)).start()
    yield engine
    load.stop_event.set()
    engine.server.stop(signal.SIGKILL)  # nothing to drain gracefully
    load.stop()
    engine.server.cleanup()


def burst(app: KvtopApp, *keys: str) -> None:
    """Every key at once, before the app has handled the first (as one read from a terminal)."""
    for key in keys:
        event = events.Key(key, KEY_CHARS.get(key, key if len(key) == 1 else None))
        event.set_sender(app)
        app._driver.send_message(event)


async def stopped(app: KvtopApp, timeout: float = 10.0) -> bool:
    """Whether the app stops within `timeout` (a generous bound: it proves only "it quits")."""
    deadline = time.monotonic() + timeout
    while app.is_running and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not app.is_running


def engine_state(server: Engine) -> str:
    with server.client() as c:
        return c.stats()["engine"]["state"]


def order(app: KvtopApp) -> list[str]:
    return list(app.query_one(SequencesTable).ids)


# ---- type-ahead: keys typed after `/` are filter text -------------------------------------------
@pytest.mark.anyio
async def test_keys_typed_after_slash_go_to_the_filter_never_to_an_action(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await busy(pilot, app)
        await pilot.press("slash", "x", "d")
        assert app.dashboard.state.filter == "xd" and app.screen is app.dashboard, "a key typed after / opened a dialog"
        await pilot.press("escape")
        assert app.dashboard.state.filter == "" and isinstance(app.focused, SequencesTable)

        burst(app, "slash", "x", "d")  # the tmux send-keys "/xd" of the issue
        await until(pilot, lambda: len(app.dashboard.state.filter) == 2 or app.screen is not app.dashboard, "the keys")
        await pilot.pause(0.2)
        assert app.dashboard.state.filter == "xd" and not isinstance(app.screen, DrainScreen)
        await pilot.press("escape")

        await pilot.press("slash", "5", "d", "0", "enter")  # enter only closes the filter
        assert (
            app.dashboard.state.filter == "5d0"
            and app.screen is app.dashboard
            and isinstance(app.focused, SequencesTable)
        )
        await pilot.press("slash", "escape")

        burst(app, "slash", "5", "d", "0", "enter")  # the burst that drained a live engine
        await until(
            pilot, lambda: app.dashboard.state.filter == "5d0" and isinstance(app.focused, SequencesTable), "enter"
        )
        await pilot.pause(0.5)  # and anything that would come after it
        assert app.dashboard.state.filter == "5d0" and app.screen is app.dashboard and engine_state(server) == "running"

        burst(app, "slash", "escape", "slash", "a", "b", "enter", "question_mark")  # after enter: keys again
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), "? after the filter's enter")
        await until(pilot, lambda: app.dashboard.state.filter == "ab", "the filter text")


@pytest.mark.anyio
async def test_tabs_layout_slash_types_into_the_filter_too(server: Engine):
    app = live_app(server)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.dashboard.source.current is not None, "a frame")
        burst(app, "slash", "q", "d", "enter")  # q and d are keys, but not after /
        await until(pilot, lambda: not app.is_running or isinstance(app.focused, SequencesTable), "enter")
        await pilot.pause(0.5)
        assert app.is_running and app.screen is app.dashboard and app.dashboard.state.filter == "qd"
        assert "filter: qd" in str(app.query_one(SequencesPanel).border_subtitle)
        assert engine_state(server) == "running"


# ---- destructive dialogs: Cancel has the focus, `y` confirms ------------------------------------
@pytest.mark.anyio
async def test_destructive_dialogs_start_on_cancel_and_enter_does_nothing(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await busy(pilot, app)
        assert (victim := app.dashboard.state.selected_seq)
        for key, screen in (("d", DrainScreen), ("e", ConfirmScreen), ("E", ConfirmScreen)):
            await pilot.press(key)
            assert isinstance(app.screen, screen), key
            assert isinstance(app.focused, Button) and app.focused.id == "no", f"{key}: focus on {app.focused}"
            await pilot.press("enter")  # on Cancel: the dialog closes, nothing happens
            assert app.screen is app.dashboard, key
        burst(app, "d", "enter", "e", "enter")  # enter typed before each dialog is even drawn
        await pilot.pause(1.0)
        await until(pilot, lambda: app.screen is app.dashboard, "enter on Cancel to close each dialog")
        with server.client() as c:
            frame = c.stats()
            assert frame["engine"]["state"] == "running"
            history = c.history()
        evictions = [e for e in [*history["events"], *frame["events"]] if e["kind"] in ("evicted", "aborted")]
        assert not [e for e in evictions if e.get("seq_id") == victim or "operator" in (e.get("detail") or "")]


@pytest.mark.anyio
async def test_drain_dialog_has_kvctl_drain_defaults_and_y_drains(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await busy(pilot, app)
        await pilot.press("d")
        dialog = app.screen
        assert isinstance(dialog, DrainScreen)
        assert dialog.query_one("#drain-timeout", Input).value == ""  # no timeout, as `kvctl drain`
        assert dialog.query_one("#drain-abort", Checkbox).value is False

        dialog.query_one("#drain-abort", Checkbox).value = True  # abort needs a timeout, as in kvctl
        await pilot.press("y")
        assert app.screen is dialog
        assert "needs a timeout" in text(dialog.query_one("#drain-error"))
        dialog.query_one("#drain-abort", Checkbox).value = False

        dialog.set_focus(dialog.query_one("#drain-timeout", Input))
        await pilot.press("1", "2", "0", "enter")  # enter in the field moves on, it does not drain
        assert app.screen is dialog and engine_state(server) == "running"
        assert isinstance(app.focused, Checkbox)  # moved on to the abort box
        dialog.query_one("#drain-timeout", Input).value = ""
        await pilot.press("tab")  # tab moves on in a dialog too
        assert isinstance(app.focused, Button) and app.focused.id == "yes"
        await pilot.press("y")
        assert app.screen is app.dashboard

        def drain_info() -> dict | None:
            with server.client() as c:
                return c.stats()["server"]["drain"]

        await until(pilot, lambda: drain_info() is not None, "the engine to drain")
        assert drain_info()["timeout_s"] is None and drain_info()["abort_after"] is False
        assert engine_state(server) in ("draining", "drained")
        await pilot.press("r")
        assert isinstance(app.screen, ConfirmScreen) and app.focused.id == "no"
        await pilot.press("y")
        await until(pilot, lambda: engine_state(server) == "running", "the engine to resume")


@pytest.mark.anyio
async def test_enter_on_the_confirm_button_evicts_the_prefix_cache(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await busy(pilot, app)
        await pilot.press("E", "shift+tab")  # from Cancel back to the confirm button: enter confirms
        assert isinstance(app.screen, ConfirmScreen) and app.focused.id == "yes"
        await pilot.press("enter", "space")

        def evicted() -> bool:
            return any(
                e["kind"] == "evicted" and "cached prefix blocks" in e["detail"] for e in app.dashboard.source.events()
            )

        await until(pilot, evicted, "the prefix-cache eviction")


# ---- quit keys --------------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("key", ["q", "ctrl+c", "f10"])
async def test_quit_keys_end_the_app(server: Engine, key: str):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.dashboard.source.current is not None, "a frame")
        await pilot.press(key)
        assert await stopped(app), f"{key} did not quit"


@pytest.mark.anyio
@pytest.mark.parametrize("key", ["ctrl+c", "f10"])
async def test_ctrl_c_and_f10_quit_from_the_filter_and_dialogs(server: Engine, key: str):
    for opener, opened in (
        ("slash", lambda app: isinstance(app.focused, Input)),
        ("d", lambda app: app.dashboard.typing),
    ):
        app = live_app(server)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda app=app: app.dashboard.source.current is not None, "a frame")
            await pilot.press(opener)  # the filter box (whose own ctrl+c copies), the drain dialog
            assert opened(app)
            await pilot.press(key)
            assert await stopped(app), f"{key} did not quit after {opener}"
    assert engine_state(server) == "running"


# ---- j/k, enter for the details, the sort picker ----------------------------------------------
@pytest.mark.anyio
async def test_j_k_move_the_cursor_and_enter_opens_the_details(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        frame = await busy(pilot, app, min_seqs=3)
        table = app.query_one(SequencesTable)
        table.move_cursor(row=0)
        await pilot.press("j")
        assert table.cursor_row == 1
        await pilot.press("j", "j", "k")
        assert table.cursor_row == 2
        await pilot.pause(0.1)
        seq_id = order(app)[2]
        assert app.dashboard.state.selected_seq == seq_id  # the block map follows the cursor

        await pilot.press("enter")
        assert isinstance(app.screen, SequenceScreen)
        seq = next(s for s in frame["sequences"] if s["id"] == seq_id)
        detail = text(app.screen.query_one("#seq-detail"))
        assert seq_id in detail and seq_id in str(app.screen.query_one(".dialog").border_title)  # the whole id
        assert f"blocks ({len(seq['block_ids'])})" in detail
        assert block_ranges(seq["block_ids"]) in detail  # runs: [3, 4, 5, 9] → `3–5, 9`
        assert block_ranges([3, 4, 5, 9, 12, 13]) == "3–5, 9, 12–13" and block_ranges([]) == "none"
        assert f"prompt {seq['prompt_tokens']}" in detail and f"cached {seq['cached_tokens']}" in detail
        assert "admitted" in detail  # its own events, from the events the dashboard holds
        others = [s["id"] for s in frame["sequences"] if s["id"] != seq_id]
        assert not any(o in detail for o in others)
        await pilot.press("escape")
        assert app.screen is app.dashboard and isinstance(app.focused, SequencesTable)


@pytest.mark.anyio
async def test_sequence_keys_in_a_too_small_terminal_do_nothing():
    app = KvtopApp(ReplaySource(read_snapshot(SNAPSHOTS[0])))
    async with app.run_test(size=(50, 15)) as pilot:
        await pilot.press("G", "slash", "x", "enter", "j", "k", "enter")  # no table to filter or move in
        assert app.is_running and app.screen is app.dashboard and "too small" in text(app.query_one("#too-small"))


@pytest.mark.anyio
async def test_sort_picker_chooses_a_column_and_again_reverses(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        frame = await busy(pilot, app, min_seqs=3)
        by_id = {s["id"]: s for s in frame["sequences"]}
        await pilot.press("o")
        assert isinstance(app.screen, SortScreen)
        await pilot.press("escape")  # cancelled: nothing changes
        assert app.dashboard.state.sort == "age" and app.screen is app.dashboard

        await pilot.press("o", "k", "k", "k", "k", "k", "enter")  # age → prompt, five rows up
        assert app.dashboard.state.sort == "prompt"
        prompts = [by_id[i]["prompt_tokens"] for i in order(app)]
        assert prompts == sorted(prompts, reverse=True)
        assert "sort prompt ↓" in str(app.query_one(SequencesPanel).border_title)

        await pilot.press("o", "enter")  # the current column again: reversed
        prompts = [by_id[i]["prompt_tokens"] for i in order(app)]
        assert prompts == sorted(prompts)
        assert "sort prompt ↑" in str(app.query_one(SequencesPanel).border_title)

        await pilot.press("o", *"jjjjjj", "enter")  # prompt → ttft, six rows down
        assert app.dashboard.state.sort == "ttft"


@pytest.mark.anyio
async def test_help_and_footer_show_the_new_keys(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.dashboard.source.current is not None, "a frame")
        footer = {b.binding.key for b in app.active_bindings.values() if b.binding.show}
        assert {"q", "slash", "enter", "o", "d"} <= footer
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        helped = {key_label(b.key): b.tooltip for _, group in app.screen.groups for b in group}
        assert {"q", "ctrl+c f10", "j", "k", "enter", "o", "/"} <= helped.keys()
        assert "jump" not in " ".join(helped.values())  # live: no replay keys
        assert all("y confirms" in helped[key] for key in "deEr")


# ---- markup in filter text and in ids (issue #11) -----------------------------------------------
@pytest.mark.anyio
async def test_filter_text_that_looks_like_markup(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await busy(pilot, app)
        await pilot.press("slash", "left_square_bracket", "slash", "enter")
        await pilot.pause(0.3)
        assert app.is_running and app.dashboard.state.filter == "[/"
        assert app.query_one(SequencesTable).row_count == 0
        await pilot.press("space")  # live again: frames keep drawing with the filter on
        await pilot.pause(0.6)
        assert app.is_running
        assert "filter: [/" in app.query_one(SequencesPanel).border_subtitle.replace("\\[", "[")


def markup_snapshot(tmp_path: Path) -> Path:
    """A recorded incident whose busiest sequence is renamed `[/x]` everywhere."""
    snap = read_snapshot(SNAPSHOTS[0])
    old = max(snap.frames[-1]["sequences"], key=lambda s: s["num_blocks"])["id"]
    swap = lambda s: "[/x]" if s == old else s  # noqa: E731
    frames = [{**f, "sequences": [{**s, "id": swap(s["id"])} for s in f["sequences"]]} for f in snap.frames]
    evs = [{**e, "seq_id": swap(e.get("seq_id"))} for e in snap.events]
    return write_snapshot(tmp_path / "m.kvsnap", model="tiny", config={}, reason="[b]x[/", frames=frames, events=evs)


@pytest.mark.anyio
@pytest.mark.slow  # 3 s of Pilot: the full suite's, not the fast lane's
async def test_replayed_sequence_id_with_markup(tmp_path: Path):
    path = markup_snapshot(tmp_path)
    app = KvtopApp(ReplaySource(read_snapshot(path)))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("G")
        await until(pilot, lambda: "[/x]" in order(app), "the last frame drawn")
        table = app.query_one(SequencesTable)
        table.move_cursor(row=order(app).index("[/x]"))
        await until(pilot, lambda: app.dashboard.state.selected_seq == "[/x]", "the selection")
        # the map highlights its blocks and names the selected id under it, as text, never as markup
        assert "[/x]" in app.query_one(BlockMap).border_subtitle.replace("\\[", "[")
        await pilot.press("enter")
        assert isinstance(app.screen, SequenceScreen)
        assert "id  [/x]" in text(app.screen.query_one("#seq-detail"))
        await pilot.press("escape")
        # the evict dialog names the id (replay has no evict key: the same dialog, pushed as `e` does)
        app.push_screen(ConfirmScreen("Evict sequence [/x]?", "Sequence [/x] (running) loses its blocks.", "Evict"))
        await pilot.pause(0.2)
        assert "Sequence [/x] (running)" in text(app.screen.query_one(".dialog-body"))
        await pilot.press("n")
        await pilot.press("slash", "left_square_bracket", "slash", "x", "enter")
        await until(pilot, lambda: order(app) == ["[/x]"], "the filtered table")
        assert app.is_running
        await pilot.press("t", "left_square_bracket", "slash", "enter")  # jump to "[/": refused, quoted
        await pilot.pause(0.2)
        assert "cannot read '[/' as a time" in text(app.screen.query_one("#jump-error"))
        await pilot.press("escape")
        assert app.screen is app.dashboard and app.is_running


@pytest.mark.anyio
async def test_a_frame_that_lands_while_the_details_open_does_not_crash(tmp_path: Path):
    """Enter, then a frame before the detail screen is built (frames every 0.3 s made this a crash)."""
    app = KvtopApp(ReplaySource(read_snapshot(markup_snapshot(tmp_path))))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("G")
        await pilot.pause(0.2)
        app.push_screen(SequenceScreen("[/x]", app.dashboard.view()))
        app.dashboard.redraw()  # the frame lands in the same tick: the screen is on the stack, not yet composed
        await pilot.pause(0.2)
        assert isinstance(app.screen, SequenceScreen) and app.is_running
        assert "id  [/x]" in text(app.screen.query_one("#seq-detail"))  # drawn from the newest frame


# ---- in a real terminal: the keys arrive as one read, as from tmux send-keys ------------------
def exits_cleanly(term: Terminal, timeout: float = 20.0) -> None:
    """kvtop ends with status 0 and no traceback (its output drained meanwhile)."""
    deadline = time.monotonic() + timeout
    while not (done := os.waitpid(term.pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        with contextlib.suppress(AssertionError):
            term.read_until("\x00", timeout=0.3)
    os.close(term.fd)
    assert done[0], "kvtop did not exit"
    assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0, f"exit status {done[1]}"
    assert b"Traceback" not in term.output and b"MarkupError" not in term.output


def test_terminal_type_ahead_does_not_drain_and_ctrl_c_quits(server: Engine):
    term = Terminal(["--socket", str(server.socket), "--interval", "0.2"], base_env(TERM="xterm-256color"))
    term.read_until("● live")
    term.press("/5d0\r?")  # one write: kvtop reads all six keys at once; after enter, ? is a key again
    term.read_until("kvtop keys")
    assert b"Drain the engine?" not in term.output and engine_state(server) == "running"
    term.press("?d")  # closes the help (a lone esc then d would read as alt+d); d: the drain dialog
    term.read_until("Drain the engine?")
    term.press("\r")  # enter on Cancel
    time.sleep(1.0)
    assert engine_state(server) == "running"
    term.press("\x03")  # ctrl+c
    exits_cleanly(term)


@pytest.mark.integration  # a real terminal (a pty)
def test_terminal_replay_of_a_markup_id_and_f10_quits(tmp_path: Path):
    path = markup_snapshot(tmp_path)
    term = Terminal(["--replay", str(path)], base_env(TERM="xterm-256color"), size=(160, 48))
    term.read_until("Block map")
    term.press("G")
    term.read_until("[/x]")
    term.press("/[/\r?")  # filter by "[/", then the help: still alive after drawing it
    term.read_until("kvtop keys")
    term.press("\x1b[21~")  # F10
    exits_cleanly(term)


# ---- a dialog answers once, whatever a burst of keys queues behind its answer -------------------
@pytest.mark.anyio
async def test_a_burst_of_enters_in_the_sort_picker_sorts_once_and_kvtop_stays():
    """Enter three times in one read: the option list posts its choice three times. The first closes
    the picker; the others used to pop the dashboard itself (ScreenStackError: kvtop gone)."""
    app = KvtopApp(ReplaySource(read_snapshot(SNAPSHOTS[0])))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("G", "o")
        state = app.dashboard.state
        assert isinstance(app.screen, SortScreen) and (state.sort, state.sort_reverse) == ("age", True)
        burst(app, "enter", "enter", "enter")
        await pilot.pause(0.5)
        assert app.is_running and app.screen is app.dashboard
        assert (state.sort, state.sort_reverse) == ("age", False)  # the current column once: reversed once


@pytest.mark.anyio
async def test_a_burst_of_enters_in_the_jump_dialog_jumps_once_and_kvtop_stays():
    """`t`, a time, enter twice in one read: the field submits twice; one jump, the dashboard stays."""
    app = KvtopApp(ReplaySource(read_snapshot(SNAPSHOTS[0])))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("t")
        assert isinstance(app.screen, JumpScreen)
        burst(app, "1", "enter", "enter", "enter")
        await pilot.pause(0.5)
        assert app.is_running and app.screen is app.dashboard
        assert app.dashboard.replay.position <= 1.0  # at the frame at or before 1 s, where it was sent


@pytest.mark.anyio
@pytest.mark.slow  # 9 s of Pilot: the full suite's, not the fast lane's
async def test_keys_while_resizes_rebuild_the_layout_do_not_crash():
    """A terminal dragged between sizes while keys arrive: each resize that changes the layout (tabs,
    overview, wide) rebuilds the sequences panel, and a key checked before its filter box exists
    used to raise NoMatches (kvtop gone)."""
    app = KvtopApp(ReplaySource(read_snapshot(SNAPSHOTS[-1])))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("G")
        for w, h in [(120, 40), (60, 18), (80, 24), (160, 48), (60, 18), (120, 40)]:
            await pilot.resize_terminal(w, h)
            await pilot.press("j", "k", "o", "enter", "slash", "x", "escape")
        await pilot.pause(0.3)
        assert app.is_running and app.screen is app.dashboard


FOOTER_KEYS = {"Filter", "Sort", "Help", "Jump"}


@pytest.mark.anyio
@pytest.mark.slow  # 3 s of Pilot: the full suite's, not the fast lane's
async def test_keys_and_frames_in_the_middle_of_a_rebuild_wait_for_it(monkeypatch):
    """The rebuild a resize starts, held open (0.3 s with no panels, then 0.3 s with a sequences
    panel in the DOM before its table and filter box): the panels' keys (cursor, details, filter,
    sort, zoom, tab) and the frames replay plays meanwhile must not reach a panel that is not
    there yet. They used to raise NoMatches (kvtop gone, seen on a loaded CI machine)."""
    from kvtop.dashboard.widgets.dashboard import Dashboard

    held = []  # the windows open now
    opened = []  # every window opened so far: on a busy machine one can open and close between two polls

    def slow(original):
        async def wrapper(self, *args, **kwargs):
            held.append(self)
            opened.append(self)
            await asyncio.sleep(0.3)
            held.remove(self)
            return await original(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(Dashboard, "mount_all", slow(Dashboard.mount_all))
    monkeypatch.setattr(SequencesPanel, "mount_composed_widgets", slow(SequencesPanel.mount_composed_widgets))
    app = KvtopApp(ReplaySource(read_snapshot(SNAPSHOTS[-1])))
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("G")  # the last frame: sequences in the table
        for size in [(80, 24), (160, 48)]:  # wide → tabs → wide
            before = len(opened)
            await pilot.resize_terminal(*size)
            await until(pilot, lambda n=before: len(opened) > n, "the rebuild to start", timeout=60)
            while held or app.query_one(Dashboard).rebuilding:  # both windows, and between them
                await pilot.press("j", "k", "enter", "z", "Z", "O", "1", "right", "slash", "escape", "G")
            await until(pilot, lambda: "Sequences (" in str(app.query_one(SequencesPanel).border_title), "a redraw")
            assert app.is_running and app.screen is app.dashboard
            assert app.query_one(SequencesTable).row_count > 0
            # the keys come back in the footer (it recomposes after the panels, later on a loaded machine)
            await until(
                pilot, lambda: {k.description for k in app.query("FooterKey")} >= FOOTER_KEYS, "the footer's keys"
            )
