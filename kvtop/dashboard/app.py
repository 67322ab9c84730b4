"""kvtop: the KV-cache dashboard, live over the engine's control socket, over any engine's
`/metrics`, replaying a snapshot, or over a fleet of engines (the fleet screen, Enter drills in).

The app holds what is app-wide: the dashboard's screen (its first screen: a `LiveDashboard`, or a
`ReplayDashboard` over a source that `can_seek`; the screen owns the source, its polling, the view
state and the keys), the fleet screen over it when there is a fleet, the one key that quits from
anywhere, and how the app ends (a hang-up, a crash).
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import ClassVar, cast

from textual.app import App
from textual.binding import BindingType

from kvtop.dashboard.dashboard_screen import DashboardScreen
from kvtop.dashboard.fleet_screen import FleetPoller, FleetScreen
from kvtop.dashboard.keys import QUIT_NOW
from kvtop.dashboard.live_screen import LiveDashboard
from kvtop.dashboard.replay_screen import ReplayDashboard
from kvtop.sources import FrameSource, ReplaySource
from kvtop.sources.metrics import MetricsSource


class KvtopApp(App[int]):
    CSS_PATH = "kvtop.tcss"
    TITLE = "kvtop"
    ENABLE_COMMAND_PALETTE = False  # every command is a key; the footer needs the room
    BINDINGS: ClassVar[list[BindingType]] = [QUIT_NOW]

    def __init__(
        self,
        source: FrameSource | None = None,
        readonly: bool = False,
        fleet: FleetPoller | None = None,
        interval: float = 1.0,
        engine: str | None = None,
        **kwargs,
    ) -> None:
        """One `source`, or a `fleet` (the fleet screen first; Enter opens a MetricsSource on a row's
        URL, every `interval` seconds, of engine kind `engine` or detected)."""
        super().__init__(**kwargs)
        if source is None and fleet is None:
            raise ValueError("a source or a fleet")
        self.fleet = fleet
        self.interval, self.engine = interval, engine
        self.dashboard: DashboardScreen = (
            ReplayDashboard(cast(ReplaySource, source))
            if source is not None and source.can_seek  # what the source can do, never its type
            else LiveDashboard(source, readonly=readonly, from_fleet=fleet is not None)
        )

    def get_default_screen(self) -> DashboardScreen:
        return self.dashboard

    def on_mount(self) -> None:
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._hang_up)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        if self.fleet is not None:
            self.install_screen(FleetScreen(self.fleet), name="fleet")  # kept: its sort and rows survive
            self.push_screen("fleet")

    def on_unmount(self) -> None:
        self.dashboard.close()
        if self.fleet is not None:
            self.fleet.close()

    def _hang_up(self) -> None:
        """The terminal went away (a dropped SSH session): there is nothing left to draw on or to
        restore, and Textual's shutdown would wait forever on its writer to the dead terminal."""
        self.on_unmount()
        os._exit(0)

    def drill(self, url: str) -> None:
        """Enter on the fleet screen: the dashboard, on a fresh MetricsSource for `url`."""
        self.pop_screen()
        self.dashboard.switch_source(MetricsSource(url, interval=self.interval, engine=self.engine))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "quit":  # Textual's ctrl+q: as `q`, on the dashboard and not while typing
            return self.screen is self.dashboard and not self.dashboard.typing
        return True

    # ---- a crash: Textual ends the app; the command says so in one line -----------------------
    def _handle_exception(self, error: Exception) -> None:
        """An exception no handler caught ends the app, as Textual does, but Textual's traceback
        (drawn over the terminal as the app closes) is dropped: `run` raises the exception once
        the terminal is restored, and `kvtop.entry.run_cli` prints one line and keeps the
        traceback in a file."""
        drawn = len(self._exit_renderables)
        super()._handle_exception(error)
        del self._exit_renderables[drawn:]

    def run(self, *args, **kwargs) -> int | None:
        """Textual's `run`; the exception that ended the app, if one did, is raised from here (its
        `return_code` is 1, but `run` returns the app's result, which a crash leaves None)."""
        result = super().run(*args, **kwargs)
        if self._exception is not None:
            raise self._exception
        return result

    async def action_quit_now(self) -> None:
        await self.action_quit()
