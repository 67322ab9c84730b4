"""kvtop: the KV-cache dashboard, live over the engine's control socket or replaying a snapshot.

The app owns the data source, the view state and the keys. Frames are fetched by a thread
worker that a timer re-arms after each poll (so polls never overlap and the UI never waits);
panels draw from a `View` handed to them. Actions (drain, resume, evict, snapshot) ask for a
confirmation that says what will happen, then go through the EngineClient in a worker thread.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, ClassVar

import typer
from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import ModalScreen, Screen
from textual.timer import Timer
from textual.widgets import Footer, Input

from kvtop.dashboard.actions import OperatorActions, SequenceActions
from kvtop.dashboard.keys import (
    DASHBOARD_ACTIONS,
    FILTER_KEYS,
    LIVE_ACTIONS,
    LIVE_KEYS,
    REPLAY_ACTIONS,
    REPLAY_KEYS,
    VIEW_KEYS,
)
from kvtop.dashboard.messages import FrameArrived, LayoutRebuilt, PollIdle, SequenceSelected, SourceLost
from kvtop.dashboard.widgets import fmt
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.dashboard import Dashboard
from kvtop.dashboard.widgets.header import EngineHeader
from kvtop.dashboard.widgets.help import HelpScreen
from kvtop.dashboard.widgets.jump_dialog import JumpScreen
from kvtop.dashboard.widgets.sequence_detail import SequenceScreen
from kvtop.dashboard.widgets.sequences import SequencesTable
from kvtop.dashboard.widgets.timeline import Timeline
from kvtop.dashboard.widgets.view import View, ViewState
from kvtop.sources import FrameSource, LiveSource, ReplaySource, SourceUnavailable


class KvtopApp(OperatorActions, SequenceActions, App[int]):
    CSS_PATH = "kvtop.tcss"
    TITLE = "kvtop"
    ENABLE_COMMAND_PALETTE = False  # every command is a key; the footer needs the room
    BINDINGS: ClassVar[list[BindingType]] = [*VIEW_KEYS, *FILTER_KEYS, *LIVE_KEYS, *REPLAY_KEYS]

    def __init__(self, source: FrameSource, readonly: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.source = source
        self.readonly = readonly
        self.state = ViewState()
        self.paused = False
        self.poll_error: str | None = None  # a frame that could not be shown (not a lost engine)
        self._timer: Timer | None = None

    @property
    def replay(self) -> ReplaySource | None:
        return self.source if isinstance(self.source, ReplaySource) else None

    @property
    def base(self) -> Screen:
        """The dashboard's screen, under any dialog that is open (queries on `self` see the top one)."""
        return self.screen_stack[0]

    @property
    def can_act(self) -> bool:
        return self.source.supports_actions and not self.readonly

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
            self.source.poll()
        self.redraw()
        self._focus_sequences()
        self._schedule(0)

    def on_unmount(self) -> None:
        self.source.close()

    def _hang_up(self) -> None:
        """The terminal went away (a dropped SSH session): there is nothing left to draw on or to
        restore, and Textual's shutdown would wait forever on its writer to the dead terminal."""
        self.source.close()
        os._exit(0)

    # ---- polling ---------------------------------------------------------------------------
    def _schedule(self, delay: float) -> None:
        self._timer = self.set_timer(max(delay, 0.01), self._tick, name="poll")

    def _tick(self) -> None:
        if self.paused and not self.replay:
            self._schedule(0.25)
        else:
            self._poll()

    @work(thread=True, exclusive=True, group="poll", exit_on_error=False)
    def _poll(self) -> None:
        try:
            frame = self.source.poll()
        except SourceUnavailable as exc:
            src = self.source
            since = src.disconnected_since if isinstance(src, LiveSource) else time.time()
            self.post_message(SourceLost(str(exc), since or time.time(), src.next_delay()))
            return
        except Exception as exc:  # a bad frame must not kill polling: show it, try again
            self.post_message(SourceLost(f"{type(exc).__name__}: {exc}", time.time(), 1.0))
            return
        self.post_message(PollIdle() if frame is None else FrameArrived(frame))

    @on(FrameArrived)
    def _frame(self) -> None:
        if not self.screen_stack:  # a poll that lands while the app closes: nothing to draw on
            return
        self.poll_error = None
        self.base.query_one(Dashboard).remove_class("-stale")
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
        self.base.query_one(Dashboard).add_class("-stale")
        self.redraw()
        self._schedule(message.retry_in)

    @on(LayoutRebuilt)
    def _rebuilt(self) -> None:
        self.call_after_refresh(self.redraw)
        self.call_after_refresh(self._focus_sequences)

    def _focus_sequences(self) -> None:
        """With every panel on screen, ↑/↓ move through the sequences (tab moves focus on)."""
        if self.screen_stack and self.base.query_one(Dashboard).mode in ("wide", "overview"):
            self.base.query_one(SequencesTable).focus()

    # ---- drawing ---------------------------------------------------------------------------
    def view(self) -> View | None:
        frame = self.source.current
        if frame is None:
            return None
        return View(frame, self.source.history(), self.source.events(), self.state)

    def status(self) -> Text:
        src = self.source
        if isinstance(src, ReplaySource):
            meta = src.snapshot.meta
            return Text.assemble(
                ("◆ replay ", "bold cyan"),
                str(src.snapshot.path),
                f" · recorded {time.strftime('%Y-%m-%d %H:%M', time.localtime(meta.get('created') or 0))}",
                f" · frame {src.index + 1}/{len(src.frames)}",
            )
        assert isinstance(src, LiveSource)
        ro = " · readonly" if self.readonly else ""
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

    def redraw(self) -> None:
        if not self.screen_stack:  # a message that lands while the app closes: nothing to draw on
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
            panel.show(view)  # type: ignore[attr-defined]
        if isinstance(self.screen, SequenceScreen):
            self.screen.show(view)

    def _redraw_one(self, kind: type) -> None:
        view = self.view()
        if view is not None and self.screen_stack:
            for w in self.base.query(kind):
                w.show(view)

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
        if action == "filter_done":
            return self.filtering
        if action in LIVE_ACTIONS and not self.can_act:
            return False
        if action in REPLAY_ACTIONS and self.replay is None:
            return False
        # no dashboard key fires while typing: `/5d0⏎` is filter text, and a priority key (`/`,
        # ←/→) must not steal a dialog's or the filter box's keys (tab still moves the focus)
        return action not in DASHBOARD_ACTIONS or not self.typing

    async def action_quit_now(self) -> None:
        await self.action_quit()

    def action_help(self) -> None:
        view_keys = [b for b in VIEW_KEYS if not b.action.startswith("tab(")]
        view_keys.append(Binding("1,2,3,4,5", "tab", "Tabs", tooltip="small terminals: show tab 1–5"))
        groups = [("View", view_keys)]
        if self.can_act:
            groups.append(("Actions (each asks first)", LIVE_KEYS))
        if self.replay:
            groups.append(("Replay", REPLAY_KEYS))
        mode = "replay" if self.replay else "live, read-only" if self.readonly else "live"
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
        if message.seq_id != self.state.selected_seq:
            self.state.selected_seq = message.seq_id
            self._redraw_one(BlockMap)

    # ---- replay ----------------------------------------------------------------------------
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


# ---- the command line -----------------------------------------------------------------------
cli = typer.Typer(
    name="kvtop",
    help="The KV-cache dashboard: watch a running engine live, or replay a snapshot.",
    add_completion=False,
    pretty_exceptions_enable=False,
)


@cli.command()
def run(
    socket: Annotated[
        str | None,
        typer.Option(
            "--socket", help="Control socket (default: $KVTOP_SOCKET, else $XDG_RUNTIME_DIR/kvtop-$UID/engine.sock)."
        ),
    ] = None,
    interval: Annotated[float, typer.Option("--interval", min=0.05, help="Seconds between polls.")] = 1.0,
    readonly: Annotated[
        bool, typer.Option("--readonly", help="No actions: drain, resume, evict and snapshot are removed.")
    ] = False,
    replay: Annotated[
        Path | None, typer.Option("--replay", help="Replay a .kvsnap snapshot instead of watching an engine.")
    ] = None,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", is_eager=True)] = False,
) -> None:
    """kvtop [--socket PATH] [--interval S] [--readonly] | kvtop --replay FILE"""
    if version:
        from kvtop import __version__

        print(f"kvtop {__version__}")
        raise typer.Exit()
    if replay is not None:
        from engine.snapshot import SnapshotError

        try:
            source: FrameSource = ReplaySource.open(replay)  # frames are read as they are shown
        except SnapshotError as exc:
            print(f"kvtop: {exc}", file=sys.stderr)
            raise typer.Exit(1) from None
    else:
        source = LiveSource(socket, interval)
    code = KvtopApp(source, readonly=readonly).run()
    raise typer.Exit(code or 0)


def main(argv: list[str] | None = None) -> None:
    """Entry point (`kvtop`, and `kvctl replay FILE` → main(["--replay", FILE]))."""
    try:
        code = cli(args=argv, prog_name="kvtop", standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except typer.TyperException as exc:  # usage errors: one line, not typer's boxed panel
        if exc.format_message():
            print(f"kvtop: {exc.format_message()} (see kvtop --help)", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except OSError as exc:  # the terminal went away mid-write
        print(f"kvtop: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
