"""`ReplayDashboard`: the dashboard over a recording (a source that `can_seek`, a `ReplaySource`).

Besides the view's keys it has the timeline under the panels and the replay's keys: play/pause,
step, skip, start, end, speed, jump to a time, and what-if (this recording under another
configuration). A recording has no engine to act on: no live action exists here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, cast

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType

from kvtop.dashboard.dashboard_screen import DashboardScreen
from kvtop.dashboard.keys import LIVE_ACTIONS, REPLAY_KEYS
from kvtop.dashboard.widgets.jump_dialog import JumpScreen
from kvtop.dashboard.widgets.timeline import Timeline
from kvtop.dashboard.widgets.whatif_dialog import WhatifScreen
from kvtop.sources import ReplaySource


class ReplayDashboard(DashboardScreen):
    BINDINGS: ClassVar[list[BindingType]] = REPLAY_KEYS

    def __init__(self, replay: ReplaySource) -> None:
        super().__init__(replay)

    @property
    def replay(self) -> ReplaySource:
        """The source, as what it is here."""
        return cast(ReplaySource, self.source)

    def compose_mode(self) -> ComposeResult:
        yield Timeline(id="timeline")

    def on_mount(self) -> None:  # before DashboardScreen.on_mount draws (Textual calls both)
        self.replay.poll()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in LIVE_ACTIONS:
            return False  # a recording: no engine to act on
        return super().check_action(action, parameters)

    def show_position(self) -> None:
        timelines = self.query(Timeline)
        if timelines:
            timelines.first().show(self.replay)

    def status(self) -> Text:
        """The file's name first and its folder last: a long path cannot push the name out of sight."""
        meta, path = self.replay.snapshot.meta, Path(self.replay.snapshot.path)
        return Text.assemble(
            ("◆ replay ", "bold cyan"),
            path.name,
            f" · recorded {time.strftime('%Y-%m-%d %H:%M', time.localtime(meta.get('created') or 0))}",
            f" · frame {self.replay.index + 1}/{len(self.replay.frames)}",
            (f" · in {path.parent}" if str(path.parent) != "." else "", "dim"),
        )

    def help_groups(self) -> tuple[str, list[tuple[str, list[Binding]]]]:
        return "replay", [("Replay", REPLAY_KEYS)]

    # ---- the replay's keys -----------------------------------------------------------------
    def action_pause(self) -> None:
        self.replay.toggle()
        self.show_position()
        self.stop_polling()  # start playing now, not at the next idle tick
        self._schedule(0)

    def _moved(self, move: Callable[[ReplaySource], object]) -> None:
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
        def done(offset: float | None) -> None:
            if offset is not None:
                self._moved(lambda r: r.seek(offset))

        self.app.push_screen(JumpScreen(self.replay.end_ts - self.replay.start_ts), done)

    def action_whatif(self) -> None:
        path = getattr(self.replay.snapshot, "path", None)
        if path is not None:
            self.app.push_screen(WhatifScreen(Path(path)))
