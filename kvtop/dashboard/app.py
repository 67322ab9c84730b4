"""kvtop: the KV-cache dashboard, live over the engine's control socket, over any engine's
`/metrics`, replaying a snapshot, or over a fleet of engines (the fleet screen, Enter drills in).

The app owns the data source, the view state and the keys; it asks the source what it can do
(`controls`, `can_seek`), never its type. Frames are fetched by a thread
worker that a timer re-arms after each poll (so polls never overlap and the UI never waits);
panels draw from a `View` handed to them. Actions (drain, resume, evict, snapshot) ask for a
confirmation that says what will happen, then go through the EngineClient in a worker thread.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import ClassVar, cast

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.timer import Timer
from textual.widgets import Footer, Input

from kvtop import fmt
from kvtop.dashboard import partial
from kvtop.dashboard.actions import OperatorActions, ReplayActions, SequenceActions
from kvtop.dashboard.fleet_screen import FleetPoller, FleetScreen
from kvtop.dashboard.keys import (
    DASHBOARD_ACTIONS,
    FILTER_KEYS,
    FLEET_KEYS,
    LIVE_ACTIONS,
    LIVE_KEYS,
    RECORD_KEY,
    REPLAY_ACTIONS,
    REPLAY_KEYS,
    VIEW_KEYS,
)
from kvtop.dashboard.messages import FrameArrived, LayoutRebuilt, PollIdle, SequenceSelected, SourceLost
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.dashboard import Dashboard
from kvtop.dashboard.widgets.header import EngineHeader
from kvtop.dashboard.widgets.help import HelpScreen
from kvtop.dashboard.widgets.sequence_detail import SequenceScreen
from kvtop.dashboard.widgets.sequences import SequencesTable
from kvtop.dashboard.widgets.timeline import Timeline
from kvtop.dashboard.widgets.view import View, ViewState
from kvtop.sources import FrameSource, ReplaySource, SourceUnavailable
from kvtop.sources.metrics import MetricsSource


class KvtopApp(OperatorActions, SequenceActions, ReplayActions, App[int]):
    CSS_PATH = "kvtop.tcss"
    TITLE = "kvtop"
    ENABLE_COMMAND_PALETTE = False  # every command is a key; the footer needs the room
    BINDINGS: ClassVar[list[BindingType]] = [*VIEW_KEYS, *FILTER_KEYS, *LIVE_KEYS, *REPLAY_KEYS, *FLEET_KEYS]

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
        self.source: FrameSource | None = source
        self.fleet = fleet
        self.interval, self.engine = interval, engine
        self.readonly = readonly
        self.state = ViewState()
        self.paused = False
        self.poll_error: str | None = None  # a frame that could not be shown (not a lost engine)
        self._timer: Timer | None = None

    @property
    def replay(self) -> ReplaySource | None:
        return cast(ReplaySource, self.source) if self.source is not None and self.source.can_seek else None

    @property
    def base(self) -> Screen:
        """The dashboard's screen, under any dialog that is open (queries on `self` see the top one)."""
        return self.screen_stack[0]

    @property
    def can_act(self) -> bool:
        return self.source is not None and self.source.controls and not self.readonly

    @property
    def can_record(self) -> bool:
        """`s` writes the frames read so far on this side (an engine without controls, e.g. vLLM)."""
        return self.source is not None and self.source.can_record and not self.readonly

    @property
    def in_fleet(self) -> bool:
        """The fleet screen is shown (the dashboard under it neither polls nor takes keys)."""
        return bool(self.screen_stack) and isinstance(self.screen_stack[-1], FleetScreen)

    def compose(self) -> ComposeResult:
        yield EngineHeader(id="header")
        yield Dashboard(id="dashboard")
        if self.replay:
            yield Timeline(id="timeline")
        yield Footer()

    def on_mount(self) -> None:
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._hang_up)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        if self.replay:
            self.replay.poll()
        self.redraw()
        self._focus_sequences()
        if self.fleet is not None:
            self.install_screen(FleetScreen(self.fleet), name="fleet")  # kept: its sort and rows survive
            self.push_screen("fleet")
        else:
            self._schedule(0)

    def on_unmount(self) -> None:
        if self.source is not None:
            self.source.close()
        if self.fleet is not None:
            self.fleet.close()

    def _hang_up(self) -> None:
        """The terminal went away (a dropped SSH session): there is nothing left to draw on or to
        restore, and Textual's shutdown would wait forever on its writer to the dead terminal."""
        self.on_unmount()
        os._exit(0)

    # ---- the fleet: drill into one engine, and back ----------------------------------------
    def drill(self, url: str) -> None:
        """Enter on the fleet screen: the dashboard, on a fresh MetricsSource for `url`."""
        if self.source is not None:
            self.source.close()
        self.source = MetricsSource(url, interval=self.interval, engine=self.engine)
        self.state, self.poll_error, self.paused = ViewState(), None, False
        self.pop_screen()
        self.redraw()
        self._schedule(0)

    def action_fleet(self) -> None:
        """Escape on a dashboard opened from the fleet: back to the fleet (it polls again at once)."""
        if self._timer is not None:
            self._timer.stop()
        self.push_screen("fleet")

    # ---- polling ---------------------------------------------------------------------------
    def _schedule(self, delay: float) -> None:
        self._timer = self.set_timer(max(delay, 0.01), self._tick, name="poll")

    def _tick(self) -> None:
        if self.source is None or self.in_fleet:
            return  # the fleet screen is shown: drilling in starts polling again
        if self.paused and not self.replay:
            self._schedule(0.25)
        else:
            self._poll()

    @work(thread=True, exclusive=True, group="poll", exit_on_error=False)
    def _poll(self) -> None:
        src = self.source
        if src is None:
            return
        try:
            frame = src.poll()
            message: Message = PollIdle() if frame is None else FrameArrived(frame)
        except SourceUnavailable as exc:
            message = SourceLost(str(exc), src.disconnected_since or time.time(), src.next_delay())
        except Exception as exc:  # a bad frame must not kill polling: show it, try again
            message = SourceLost(f"{type(exc).__name__}: {exc}", time.time(), 1.0)
        if src is self.source:  # not when the fleet drilled into another engine (or went back) meanwhile
            self.post_message(message)

    @on(FrameArrived)
    def _frame(self) -> None:
        if not self.screen_stack:  # a poll that lands while the app closes: nothing to draw on
            return
        self.poll_error = None
        self._mark_stale(False)
        self.redraw()
        self._schedule(self.source.next_delay())

    @on(PollIdle)
    def _idle(self) -> None:
        if not self.screen_stack:
            return
        if self.replay:
            self.base.query_one(Timeline).show(self.replay)
        self._schedule(self.source.next_delay())

    @on(SourceLost)
    def _lost(self, message: SourceLost) -> None:
        if not self.screen_stack:
            return
        self.poll_error = message.error
        self._mark_stale(True)
        self.redraw()
        self._schedule(message.retry_in)

    def _mark_stale(self, stale: bool) -> None:
        """Grey the dashboard out while its source is lost. A frame can land before the dashboard is
        mounted (the first poll racing the first layout): then there is nothing to mark yet, and the
        poll goes on (a query_one here once ended the app with NoMatches)."""
        dashboards = self.base.query(Dashboard)
        if dashboards:
            dashboards.first().set_class(stale, "-stale")

    @on(LayoutRebuilt)
    def _rebuilt(self) -> None:
        self.call_after_refresh(self.redraw)
        self.call_after_refresh(self._focus_sequences)

    def _focus_sequences(self) -> None:
        """With every panel on screen, ↑/↓ move through the sequences (tab moves focus on)."""
        tables = self.base.query(SequencesTable) if self.screen_stack else None
        if tables and self.base.query_one(Dashboard).mode in ("wide", "overview"):
            tables.first().focus()

    # ---- drawing ---------------------------------------------------------------------------
    def view(self) -> View | None:
        frame = self.source.current if self.source is not None else None
        if frame is None:
            return None
        return View(frame, self.source.history(), self.source.events(), self.state)

    def status(self) -> Text:
        src = self.source
        if src is None:
            return Text("… pick an engine on the fleet screen", "italic")
        if (replay := self.replay) is not None:
            meta = replay.snapshot.meta
            return Text.assemble(
                ("◆ replay ", "bold cyan"),
                str(replay.snapshot.path),
                f" · recorded {time.strftime('%Y-%m-%d %H:%M', time.localtime(meta.get('created') or 0))}",
                f" · frame {replay.index + 1}/{len(replay.frames)}",
            )
        ro = " · readonly" if self.readonly and src.controls else ""
        if src.kind == "metrics" and src.current is not None:
            ro += f" · {partial.engine_label(src.current)} via /metrics, no controls"
        if self.fleet is not None:
            ro += " · esc: back to the fleet"
        if src.disconnected_since is not None:
            ago = fmt.duration(time.time() - src.disconnected_since)
            return Text.assemble(
                (f"✖ disconnected since {fmt.clock(src.disconnected_since)} ({ago})", "bold red"),
                f" · next try in {src.next_delay():.1f}s · {src.last_error}",
            )
        if self.poll_error:
            return Text.assemble(("⚠ cannot show the engine's frame: ", "bold red"), self.poll_error)
        if src.current is None:
            return Text(f"… connecting to {src.path}", "italic")
        if self.paused:
            return Text.assemble(("⏸ paused", "bold yellow"), f" (space resumes) · {src.path}{ro}")
        return Text.assemble(("● live ", "bold green"), f"{src.path} · every {src.interval:g}s{ro}")

    @property
    def rebuilding(self) -> bool:
        """A resize is rebuilding the dashboard: its panels are in the DOM before their children."""
        dashboards = self.base.query(Dashboard) if self.screen_stack else None
        return bool(dashboards) and dashboards.first().rebuilding

    def redraw(self) -> None:
        if not self.screen_stack or self.rebuilding:  # closing, or mid-rebuild (LayoutRebuilt redraws)
            return
        header = self.base.query(EngineHeader)
        if not header:  # a frame that lands before the dashboard is mounted: the next one draws
            return
        view = self.view()
        header.first().unreachable_since = getattr(self.source, "disconnected_since", None)
        header.first().show(view, self.status())
        if self.replay:
            self.base.query_one(Timeline).show(self.replay)
        if view is None:
            return
        for panel in self.base.query(".panel"):
            partial.draw(panel, view)
        if isinstance(self.screen, SequenceScreen):
            self.screen.show(view)

    def _redraw_one(self, kind: type) -> None:
        view = self.view()
        if view is not None and self.screen_stack and not self.rebuilding:
            for w in self.base.query(kind):
                partial.draw(w, view)

    # ---- keys: which exist in this mode ----------------------------------------------------
    @property
    def typing(self) -> bool:
        """A dialog or a text box (the filter) has the keyboard: its keys are not the app's."""
        if not self.screen_stack:  # shutting down: the footer may still ask, no key can come
            return True
        return isinstance(self.screen, ModalScreen) or isinstance(self.focused, Input)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "quit_now":  # ctrl+c, F10: from anywhere
            return True
        if action in DASHBOARD_ACTIONS and action != "quit" and self.rebuilding:
            return False  # a resize is rebuilding the panels these keys act on (a few ms)
        if action == "filter_done":
            return self.filtering
        if action == "fleet":  # escape: back to the fleet, unless a dialog or the filter has it
            return self.fleet is not None and not self.in_fleet and not self.typing and not self.filtering
        if action in DASHBOARD_ACTIONS and self.in_fleet:
            return False  # the fleet screen's own keys answer there
        if action == "snapshot" and self.can_record:
            return not self.typing
        if action in LIVE_ACTIONS and not self.can_act:
            return False
        if action in REPLAY_ACTIONS and self.replay is None:
            return False
        # no dashboard key fires while typing: `/5d0⏎` is filter text, and a priority key (`/`,
        # ←/→) must not steal a dialog's or the filter box's keys (tab still moves the focus)
        return action not in DASHBOARD_ACTIONS or not self.typing

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

    def action_help(self) -> None:
        view_keys = [b for b in VIEW_KEYS if not b.action.startswith("tab(")]
        view_keys.append(Binding("1,2,3,4,5", "tab", "Tabs", tooltip="small terminals: show tab 1–5"))
        groups = [("View", view_keys)]
        if self.can_act:
            groups.append(("Actions (each asks first)", LIVE_KEYS))
        elif self.can_record:
            groups.append(("Record", [RECORD_KEY]))
        if self.replay:
            groups.append(("Replay", REPLAY_KEYS))
        if self.fleet is not None:
            groups.append(("Fleet", FLEET_KEYS))
        kind = self.source.kind if self.source is not None else "fleet"
        mode = {"replay": "replay", "metrics": "live over /metrics, no controls"}.get(kind, "live")
        mode += ", read-only" if self.readonly and self.source is not None and self.source.controls else ""
        self.push_screen(HelpScreen(groups, mode))

    def action_pause(self) -> None:
        if self.replay:
            self.replay.toggle()
            self.base.query_one(Timeline).show(self.replay)
            if self._timer is not None:  # start playing now, not at the next idle tick
                self._timer.stop()
            self._schedule(0)
        else:
            self.paused = not self.paused
            self.base.query_one(EngineHeader).show(self.view(), self.status())

    def action_zoom(self, direction: int) -> None:
        self.base.query_one(BlockMap).zoom(direction)

    def action_latency_range(self) -> None:
        self.state.latency_all = not self.state.latency_all
        self.redraw()

    def action_verbose_events(self) -> None:
        self.state.verbose_events = not self.state.verbose_events
        self.redraw()

    def action_tab(self, index: int) -> None:
        self.base.query_one(Dashboard).show_tab(index)

    @on(SequenceSelected)
    def _selected(self, message: SequenceSelected) -> None:
        """The sequences table moved its cursor (it set `state.selected_seq` as it did): the map follows."""
        self._redraw_one(BlockMap)
