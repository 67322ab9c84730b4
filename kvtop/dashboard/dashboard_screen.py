"""The dashboard's screen: the panels over one source, which it polls, draws and answers keys for.

`DashboardScreen` owns its source, the view state (`ViewState`: what the operator chose, kept
across layout rebuilds) and its widgets: the header, the panels (`widgets/dashboard.py`) and the
footer. A timer starts a `@work(thread=True, exclusive=True)` poll; the worker posts
`FrameArrived`, `PollIdle` or `SourceLost` to the screen, whose handler redraws and re-arms the
timer with the source's `next_delay()`, so polls never overlap and the UI never waits on the
socket. It stops polling while another full screen (the fleet) is over it, not under a dialog.

It answers the keys every mode has: the view's and the sequences table's (filter, `j`/`k`, details,
sort; notifications never read sequence ids as markup). Its two kinds add their mode's keys and
status line: `LiveDashboard` (live_screen.py) and `ReplayDashboard` (replay_screen.py).
"""

from __future__ import annotations

import time
from typing import ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Input

from kvtop.dashboard import partial
from kvtop.dashboard.keys import DASHBOARD_ACTIONS, FILTER_KEYS, QUIT_NOW, VIEW_KEYS
from kvtop.dashboard.messages import (
    FilterChanged,
    FrameArrived,
    LayoutRebuilt,
    PollIdle,
    SequenceOpened,
    SequenceSelected,
    SortChosen,
    SourceLost,
)
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.dashboard import Dashboard
from kvtop.dashboard.widgets.header import EngineHeader
from kvtop.dashboard.widgets.help import HelpScreen
from kvtop.dashboard.widgets.sequence_detail import SequenceScreen
from kvtop.dashboard.widgets.sequences import COLUMNS, SequencesPanel, SequencesTable
from kvtop.dashboard.widgets.sort_picker import SortScreen
from kvtop.dashboard.widgets.view import View, ViewState
from kvtop.sources import FrameSource, SourceUnavailable


# Over 250 lines, for a reason: this is the one screen every mode shares, and its polling, drawing
# and keys all read the same `source` and `state`; split into classes, they would share them again.
class DashboardScreen(Screen):
    """The panels over `source` (None until the fleet screen drills into an engine)."""

    BINDINGS: ClassVar[list[BindingType]] = [*(b for b in VIEW_KEYS if b is not QUIT_NOW), *FILTER_KEYS]

    def __init__(self, source: FrameSource | None) -> None:
        super().__init__()
        self.source = source
        self.state = ViewState()
        self.paused = False  # live: the view is frozen, polls wait (a replay pauses its own clock)
        self.poll_error: str | None = None  # a frame that could not be shown (not a lost engine)
        self._timer: Timer | None = None

    def compose(self) -> ComposeResult:
        yield EngineHeader(id="header")
        yield Dashboard(id="dashboard")
        yield from self.compose_mode()
        yield Footer()

    def compose_mode(self) -> ComposeResult:
        """What this mode shows between the panels and the footer (a replay: its timeline)."""
        yield from ()

    def on_mount(self) -> None:
        self.redraw()
        self._focus_sequences()
        if self.source is not None:
            self._schedule(0)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()

    # ---- what this mode says and offers (LiveDashboard and ReplayDashboard) -------------------
    def status(self) -> Text:
        """The header's status line: where the frames come from, and how that is going."""
        raise NotImplementedError

    def help_groups(self) -> tuple[str, list[tuple[str, list[Binding]]]]:
        """The help screen's title for this mode and its groups after the view keys."""
        raise NotImplementedError

    def show_position(self) -> None:
        """Show where the source is, between frames (a replay: the timeline)."""

    # ---- polling ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """The app is shutting down: a poll or a message that lands now has nothing to draw on."""
        return not self.is_attached or not self.app.screen_stack

    @property
    def covered(self) -> bool:
        """Another full screen (the fleet) is over this one: it neither polls nor takes keys."""
        stack = self.app.screen_stack
        return self in stack and any(not s.is_modal for s in stack[stack.index(self) + 1 :])

    def _schedule(self, delay: float) -> None:
        self._timer = self.set_timer(max(delay, 0.01), self._tick, name="poll")

    def stop_polling(self) -> None:
        if self._timer is not None:
            self._timer.stop()

    def _tick(self) -> None:
        if self.source is None or self.covered:
            return  # the fleet screen is shown: drilling in starts polling again
        if self.paused:
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
        if self.closed:
            return
        self.poll_error = None
        self._mark_stale(False)
        self.redraw()
        self._schedule(self.source.next_delay())

    @on(PollIdle)
    def _idle(self) -> None:
        if self.closed:
            return
        self.show_position()
        self._schedule(self.source.next_delay())

    @on(SourceLost)
    def _lost(self, message: SourceLost) -> None:
        if self.closed:
            return
        self.poll_error = message.error
        self._mark_stale(True)
        self.redraw()
        self._schedule(message.retry_in)

    def _mark_stale(self, stale: bool) -> None:
        """Grey the dashboard out while its source is lost. A frame can land before the dashboard is
        mounted (the first poll racing the first layout): then there is nothing to mark yet, and the
        poll goes on (a query_one here once ended the app with NoMatches)."""
        dashboards = self.query(Dashboard)
        if dashboards:
            dashboards.first().set_class(stale, "-stale")

    @on(LayoutRebuilt)
    def _rebuilt(self) -> None:
        self.call_after_refresh(self.redraw)
        self.call_after_refresh(self._focus_sequences)

    def _focus_sequences(self) -> None:
        """With every panel on screen, ↑/↓ move through the sequences (tab moves focus on)."""
        tables = self.query(SequencesTable) if not self.closed else None
        if tables and self.query_one(Dashboard).mode in ("wide", "overview"):
            tables.first().focus()

    # ---- drawing ---------------------------------------------------------------------------
    def view(self) -> View | None:
        frame = self.source.current if self.source is not None else None
        if frame is None:
            return None
        return View(frame, self.source.history(), self.source.events(), self.state)

    @property
    def rebuilding(self) -> bool:
        """A resize is rebuilding the dashboard: its panels are in the DOM before their children."""
        dashboards = self.query(Dashboard) if not self.closed else None
        return bool(dashboards) and dashboards.first().rebuilding

    def redraw(self) -> None:
        if self.closed or self.rebuilding:  # closing, or mid-rebuild (LayoutRebuilt redraws)
            return
        header = self.query(EngineHeader)
        if not header:  # a frame that lands before the dashboard is mounted: the next one draws
            return
        view = self.view()
        header.first().unreachable_since = getattr(self.source, "disconnected_since", None)
        header.first().show(view, self.status())
        self.show_position()
        if view is None:
            return
        for panel in self.query(".panel"):
            partial.draw(panel, view)
        if isinstance(self.app.screen, SequenceScreen):
            self.app.screen.show(view)

    def _redraw_one(self, kind: type) -> None:
        view = self.view()
        if view is not None and not self.closed and not self.rebuilding:
            for w in self.query(kind):
                partial.draw(w, view)

    # ---- keys: which exist now -------------------------------------------------------------
    @property
    def typing(self) -> bool:
        """A dialog or a text box (the filter) has the keyboard: its keys are not the dashboard's."""
        if self.closed:  # shutting down: the footer may still ask, no key can come
            return True
        return self.app.screen is not self or isinstance(self.focused, Input)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in DASHBOARD_ACTIONS and action != "quit" and self.rebuilding:
            return False  # a resize is rebuilding the panels these keys act on (a few ms)
        if action == "filter_done":
            return self.filtering
        # no dashboard key fires while typing: `/5d0⏎` is filter text, and a priority key (`/`,
        # ←/→) must not steal the filter box's keys (tab still moves the focus)
        return action not in DASHBOARD_ACTIONS or not self.typing

    # ---- the view's keys -------------------------------------------------------------------
    async def action_quit(self) -> None:
        await self.app.action_quit()

    def action_help(self) -> None:
        view_keys = [b for b in VIEW_KEYS if not b.action.startswith("tab(")]
        view_keys.append(Binding("1,2,3,4,5", "tab", "Tabs", tooltip="small terminals: show tab 1–5"))
        mode, groups = self.help_groups()
        self.app.push_screen(HelpScreen([("View", view_keys), *groups], mode))

    def action_zoom(self, direction: int) -> None:
        self.query_one(BlockMap).zoom(direction)

    def action_latency_range(self) -> None:
        self.state.latency_all = not self.state.latency_all
        self.redraw()

    def action_verbose_events(self) -> None:
        self.state.verbose_events = not self.state.verbose_events
        self.redraw()

    def action_tab(self, index: int) -> None:
        self.query_one(Dashboard).show_tab(index)

    # ---- the sequences table's keys --------------------------------------------------------
    def _sequences(self) -> SequencesPanel | None:
        panels = self.query(SequencesPanel)
        return panels.first() if panels else None  # none in a too-small terminal

    @property
    def filtering(self) -> bool:
        """The filter box has the keyboard (enter and esc then close it)."""
        panel = self._sequences() if not self.closed and self.app.screen is self else None
        return panel is not None and panel.filtering

    def action_filter(self) -> None:
        """`/` (a priority key): the filter box has the keyboard before the next key is read."""
        if panel := self._sequences():
            self.query_one(Dashboard).show_tab(2)
            panel.open_filter()

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
        view = self.view()
        if view is None or not any(s.get("id") == message.seq_id for s in view.frame.get("sequences", [])):
            return
        self.app.push_screen(SequenceScreen(message.seq_id, view))

    def action_sort_pick(self) -> None:
        def done(column: str | None) -> None:
            if column is not None:
                self.on_sort_chosen(SortChosen(column))

        self.app.push_screen(SortScreen(self.state.sort, self.state.sort_reverse), done)

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

    @on(SequenceSelected)
    def _selected(self, message: SequenceSelected) -> None:
        """The sequences table moved its cursor (it set `state.selected_seq` as it did): the map follows."""
        self._redraw_one(BlockMap)
