"""The dashboard's actions, as mixins of `KvtopApp` (they need `source`, `state`, `base`,
`push_screen`).

`OperatorActions`, on a live engine: drain, resume, evict a sequence, evict the prefix cache,
snapshot (on an engine read through `/metrics`, which has no controls, `s` records the frames
kvtop has read into a .kvsnap itself: kvtop/sources/recorder.py). Each opens a dialog that says exactly what will happen, with the numbers of the moment;
destructive ones start on Cancel and need `y`. If confirmed, the request goes through
`EngineClient` in a worker thread and a notification says how it went.

`ReplayActions`, on a replay: step, skip, jump, speed, what-if.

`SequenceActions`, on the sequences table: filter, j/k, details, sort. Notifications never read
sequence ids or engine errors as markup.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from textual import work
from textual.screen import Screen

from kvtop import fmt
from kvtop.dashboard.messages import ActionFinished, FilterChanged, SequenceOpened, SortChosen
from kvtop.dashboard.widgets.confirm import ConfirmScreen
from kvtop.dashboard.widgets.dashboard import Dashboard
from kvtop.dashboard.widgets.drain_dialog import DrainRequest, DrainScreen
from kvtop.dashboard.widgets.jump_dialog import JumpScreen
from kvtop.dashboard.widgets.sequence_detail import SequenceScreen
from kvtop.dashboard.widgets.sequences import COLUMNS, SequencesPanel
from kvtop.dashboard.widgets.snapshot_dialog import SnapshotScreen
from kvtop.dashboard.widgets.sort_picker import SortScreen
from kvtop.dashboard.widgets.view import View, ViewState
from kvtop.dashboard.widgets.whatif_dialog import WhatifScreen
from kvtop.sources import FrameSource, ReplaySource

RECORD_BODY = (
    "kvtop writes the {frames} frames it has read from this engine's /metrics (the last\n"
    "minutes) to this file, in the engine's snapshot format (SQLite, .kvsnap). The\n"
    "engine is not asked anything. Replay it with `kvtop --replay FILE`."
)


class OperatorActions:
    source: FrameSource
    state: ViewState

    def action_drain(self) -> None:
        frame = self.source.current or {}
        in_flight = len(frame.get("sequences", []))

        def done(req: DrainRequest | None) -> None:
            if req is not None:
                self._act("drain", lambda s: s.drain(req.timeout_s, req.abort_after), "drain started")

        self.push_screen(DrainScreen(in_flight), done)

    def action_resume(self) -> None:
        self._confirm(
            "Resume the engine?",
            "The engine admits new requests again (draining or drained → running).\nNothing else changes.",
            "Resume",
            lambda: self._act("resume", lambda s: s.resume(), "engine resumed"),
        )

    def action_evict_sequence(self) -> None:
        seq_id = self.state.selected_seq
        seq = next((s for s in (self.source.current or {}).get("sequences", []) if s.get("id") == seq_id), None)
        if seq is None:
            self.notify("no sequence selected: pick one in the sequences table first", severity="warning", markup=False)
            return
        self._confirm(
            f"Evict sequence {seq_id}?",
            f"Sequence {seq_id} ({seq.get('state')}, {seq.get('prompt_tokens', 0)} prompt + "
            f"{seq.get('output_tokens', 0)} output tokens) loses its {seq.get('num_blocks', 0)} KV blocks "
            f"({fmt.size(seq.get('kv_bytes'))}).\nThe request ends now with finish reason `abort` "
            "(evicted by operator); its client gets what was generated so far.",
            "Evict",
            lambda: self._act("evict", lambda s: s.evict_sequence(seq_id), f"evicted {seq_id}"),
        )

    def action_evict_prefix(self) -> None:
        kv = (self.source.current or {}).get("kv", {})
        self._confirm(
            "Evict the free prefix cache?",
            f"The {kv.get('cached', 0)} cached blocks (free blocks holding reusable prompt prefixes) "
            "forget their prefixes and become plain free blocks.\nRunning sequences keep their blocks; "
            "later requests with those prefixes compute them again.",
            "Evict",
            lambda: self._act("evict", lambda s: s.evict_prefix_cache(), "prefix cache evicted"),
        )

    def action_snapshot(self) -> None:
        path = Path.cwd() / f"kvtop-{time.strftime('%Y%m%d-%H%M%S')}.kvsnap"

        def done(chosen: str | None) -> None:
            if not chosen:
                return
            target = str(Path(chosen).expanduser().resolve())
            if self.source.controls:
                self._act("snapshot", lambda s: s.snapshot(target, "operator (kvtop)"), "snapshot written")
            else:
                self._record(target)

        if self.source.controls:
            self.push_screen(SnapshotScreen(str(path)), done)
            return
        frames = len(self.source.history())
        self.push_screen(SnapshotScreen(str(path), RECORD_BODY.format(frames=frames)), done)

    def _confirm(self, title: str, body: str, yes: str, then: Callable[[], None]) -> None:
        self.push_screen(ConfirmScreen(title, body, yes), lambda ok: then() if ok else None)

    @work(thread=True, group="action", exit_on_error=False)
    def _record(self, target: str) -> None:
        """The frames kvtop holds (the last minutes it read), written on this side."""
        from kvtop.sources.recorder import record_frames, source_meta

        try:
            path = record_frames(self.source.history(), target, source_meta(self.source, "operator (kvtop)"))
        except Exception as exc:
            self.post_message(ActionFinished("snapshot", False, str(exc)))
            return
        self.post_message(ActionFinished("snapshot", True, f"{len(self.source.history())} frames recorded: {path}"))

    @work(thread=True, group="action", exit_on_error=False)
    def _act(self, name: str, call: Callable[[FrameSource], dict], done: str) -> None:
        assert self.source.controls, "an engine action on a source without controls"
        try:
            result = call(self.source)
        except Exception as exc:
            self.post_message(ActionFinished(name, False, str(exc)))
            return
        detail = f"{done}: {result['path']}" if isinstance(result, dict) and result.get("path") else done
        self.post_message(ActionFinished(name, True, detail))

    def on_action_finished(self, message: ActionFinished) -> None:
        if message.ok:
            self.notify(message.detail, title=message.action, timeout=6, markup=False)
        else:
            self.notify(message.detail, title=f"{message.action} failed", severity="error", timeout=10, markup=False)


class SequenceActions:
    state: ViewState
    base: Screen

    def _sequences(self) -> SequencesPanel | None:
        panels = self.base.query(SequencesPanel)
        return panels.first() if panels else None  # none in a too-small terminal

    def action_filter(self) -> None:
        """`/` (a priority key): the filter box has the keyboard before the next key is read."""
        if panel := self._sequences():
            self.base.query_one(Dashboard).show_tab(2)
            panel.open_filter()

    @property
    def filtering(self) -> bool:
        """The filter box has the keyboard (enter and esc then close it)."""
        panel = self._sequences() if self.screen_stack and self.screen is self.base else None
        return panel is not None and panel.filtering

    def action_filter_done(self, keep: bool) -> None:
        if panel := self._sequences():
            panel.close_filter(keep)

    def action_cursor(self, step: int) -> None:
        if panel := self._sequences():
            panel.move_cursor(step)

    def action_open_sequence(self) -> None:
        panel = self._sequences()
        seq_id = panel.table.cursor_id() if panel else None
        if seq_id is not None:
            self.on_sequence_opened(SequenceOpened(seq_id))

    def on_sequence_opened(self, message: SequenceOpened) -> None:
        view: View | None = self.view()
        if view is None or not any(s.get("id") == message.seq_id for s in view.frame.get("sequences", [])):
            return
        self.push_screen(SequenceScreen(message.seq_id, view))

    def action_sort_pick(self) -> None:
        def done(column: str | None) -> None:
            if column is not None:
                self.on_sort_chosen(SortChosen(column))

        self.push_screen(SortScreen(self.state.sort, self.state.sort_reverse), done)

    def action_sort_reverse(self) -> None:
        self.state.sort_reverse = not self.state.sort_reverse
        self._redraw_one(SequencesPanel)

    def on_sort_chosen(self, message: SortChosen) -> None:
        """A column picked with `o` or a header clicked: sort by it; the same column again reverses."""
        if message.column == self.state.sort:
            self.action_sort_reverse()
            return
        self.state.sort = message.column
        self.state.sort_reverse = message.column not in ("id", "state")
        self._redraw_one(SequencesPanel)
        self.notify(f"sequences sorted by {COLUMNS[message.column][0]}", timeout=1.5, markup=False)

    def on_filter_changed(self, message: FilterChanged) -> None:
        self.state.filter = message.text
        self._redraw_one(SequencesPanel)


class ReplayActions:
    """On a replay (a source that `can_seek`): step, skip, start, end, speed, jump, what-if."""

    replay: ReplaySource | None

    def _moved(self, move: Callable[[ReplaySource], object]) -> None:
        if self.replay:
            move(self.replay)
            self.redraw()

    def action_step(self, n: int) -> None:
        self._moved(lambda r: r.step(n))

    def action_skip(self, seconds: float) -> None:
        self._moved(lambda r: r.skip(seconds))

    def action_start(self) -> None:
        self._moved(ReplaySource.start)

    def action_end(self) -> None:
        self._moved(ReplaySource.end)

    def action_speed(self, direction: int) -> None:
        self._moved(lambda r: r.faster() if direction > 0 else r.slower())

    def action_jump(self) -> None:
        replay = self.replay
        if replay is None:
            return

        def done(offset: float | None) -> None:
            if offset is not None:
                self._moved(lambda r: r.seek(offset))

        self.push_screen(JumpScreen(replay.end_ts - replay.start_ts), done)

    def action_whatif(self) -> None:
        path = getattr(self.replay.snapshot, "path", None) if self.replay else None
        if path is not None:
            self.push_screen(WhatifScreen(Path(path)))
