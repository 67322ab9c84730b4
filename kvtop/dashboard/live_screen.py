"""`LiveDashboard`: the dashboard over a live engine — our control socket, or any engine's `/metrics`.

Besides the view's keys it has pause, the operator's actions and, opened from the fleet screen,
escape back to it (`switch_source` is how the fleet hands it the engine drilled into). The actions, on a
source with the engine's controls and without `--readonly`: drain, resume, evict a sequence,
evict the prefix cache, snapshot. On an engine read through `/metrics`, which has no controls, `s`
records the frames kvtop has read into a .kvsnap itself (kvtop/sources/recorder.py). Each opens a
dialog that says exactly what will happen, with the numbers of the moment; destructive ones start
on Cancel and need `y`. If confirmed, the request goes through the source (`EngineClient`) in a
worker thread and a notification says how it went, never reading ids or errors as markup.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from rich.text import Text
from textual import work
from textual.binding import Binding, BindingType

from kvtop import fmt
from kvtop.dashboard import partial
from kvtop.dashboard.dashboard_screen import DashboardScreen
from kvtop.dashboard.keys import FILTER_KEYS, FLEET_KEYS, LIVE_ACTIONS, LIVE_KEYS, RECORD_KEY
from kvtop.dashboard.messages import ActionFinished
from kvtop.dashboard.widgets.confirm import ConfirmScreen
from kvtop.dashboard.widgets.drain_dialog import DrainRequest, DrainScreen
from kvtop.dashboard.widgets.header import EngineHeader
from kvtop.dashboard.widgets.snapshot_dialog import SnapshotScreen
from kvtop.dashboard.widgets.view import ViewState
from kvtop.sources import FrameSource

RECORD_BODY = (
    "kvtop writes the {frames} frames it has read from this engine's /metrics (the last\n"
    "minutes) to this file, in the engine's snapshot format (SQLite, .kvsnap). The\n"
    "engine is not asked anything. Replay it with `kvtop --replay FILE`."
)


class LiveDashboard(DashboardScreen):
    # Textual merges a subclass's bindings key by key, replacing the base's: escape lists the
    # filter's (DashboardScreen's) again, before the fleet's, as one key does in a single list
    BINDINGS: ClassVar[list[BindingType]] = [*LIVE_KEYS, *(b for b in FILTER_KEYS if b.key == "escape"), *FLEET_KEYS]

    def __init__(self, source: FrameSource | None, readonly: bool = False, from_fleet: bool = False) -> None:
        super().__init__(source)
        self.readonly = readonly
        self.from_fleet = from_fleet  # escape goes back to the fleet screen

    @property
    def can_act(self) -> bool:
        return self.source is not None and self.source.controls and not self.readonly

    @property
    def can_record(self) -> bool:
        """`s` writes the frames read so far on this side (an engine without controls, e.g. vLLM)."""
        return self.source is not None and self.source.can_record and not self.readonly

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "fleet":  # escape: back to the fleet, unless a dialog or the filter has it
            return self.from_fleet and not self.typing and not self.filtering
        if action in LIVE_ACTIONS and not self.can_act and not (action == "snapshot" and self.can_record):
            return False
        return super().check_action(action, parameters)

    # ---- the fleet: the engine drilled into, and back --------------------------------------
    def switch_source(self, source: FrameSource) -> None:
        """Show `source` from a fresh view (the last engine's source is closed)."""
        self.close()
        self.source = source
        self.state, self.poll_error, self.paused = ViewState(), None, False
        self.redraw()
        self._schedule(0)

    def action_fleet(self) -> None:
        """Escape on a dashboard opened from the fleet: back to the fleet (it polls again at once)."""
        self.stop_polling()
        self.app.push_screen("fleet")

    # ---- what it says ----------------------------------------------------------------------
    def status(self) -> Text:
        src = self.source
        if src is None:
            return Text("… pick an engine on the fleet screen", "italic")
        ro = " · readonly" if self.readonly and src.controls else ""
        if src.kind == "metrics" and src.current is not None:
            ro += f" · {partial.engine_label(src.current)} via /metrics, no controls"
        if self.from_fleet:
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

    def help_groups(self) -> tuple[str, list[tuple[str, list[Binding]]]]:
        groups: list[tuple[str, list[Binding]]] = []
        if self.can_act:
            groups.append(("Actions (each asks first)", LIVE_KEYS))
        elif self.can_record:
            groups.append(("Record", [RECORD_KEY]))
        if self.from_fleet:
            groups.append(("Fleet", FLEET_KEYS))
        kind = self.source.kind if self.source is not None else "fleet"
        mode = {"metrics": "live over /metrics, no controls"}.get(kind, "live")
        mode += ", read-only" if self.readonly and self.source is not None and self.source.controls else ""
        return mode, groups

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.query_one(EngineHeader).show(self.view(), self.status())

    # ---- the operator's actions ------------------------------------------------------------
    def action_drain(self) -> None:
        frame = self.source.current or {}
        in_flight = len(frame.get("sequences", []))

        def done(req: DrainRequest | None) -> None:
            if req is not None:
                self._act("drain", lambda s: s.drain(req.timeout_s, req.abort_after), "drain started")

        self.app.push_screen(DrainScreen(in_flight), done)

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
            self.app.push_screen(SnapshotScreen(str(path)), done)
            return
        frames = len(self.source.history())
        self.app.push_screen(SnapshotScreen(str(path), RECORD_BODY.format(frames=frames)), done)

    def _confirm(self, title: str, body: str, yes: str, then: Callable[[], None]) -> None:
        self.app.push_screen(ConfirmScreen(title, body, yes), lambda ok: then() if ok else None)

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
        if isinstance(result, dict) and result.get("applied") is False:  # an eviction the engine has not stepped to
            detail = f"{done.replace('evicted', 'eviction of')} queued: the engine applies it at its next step"
        self.post_message(ActionFinished(name, True, detail))

    def on_action_finished(self, message: ActionFinished) -> None:
        if message.ok:
            self.notify(message.detail, title=message.action, timeout=6, markup=False)
        else:
            self.notify(message.detail, title=f"{message.action} failed", severity="error", timeout=10, markup=False)
