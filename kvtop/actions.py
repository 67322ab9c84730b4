"""The operator's actions on a live engine: drain, resume, evict a sequence, evict the prefix
cache, snapshot. Each opens a dialog that says exactly what will happen, with the numbers of the
moment; if confirmed, the request goes through `EngineClient` in a worker thread and a
notification says how it went. A mixin of `KvtopApp` (it needs `source`, `state`, `push_screen`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from textual import work

from kvtop.messages import ActionFinished
from kvtop.sources import FrameSource, LiveSource
from kvtop.widgets import fmt
from kvtop.widgets.confirm import ConfirmScreen
from kvtop.widgets.drain_dialog import DrainRequest, DrainScreen
from kvtop.widgets.snapshot_dialog import SnapshotScreen
from kvtop.widgets.view import ViewState


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
            self.notify("no sequence selected: pick one in the sequences table first", severity="warning")
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
            if chosen:
                target = str(Path(chosen).expanduser().resolve())
                self._act("snapshot", lambda s: s.snapshot(target, "operator (kvtop)"), "snapshot written")

        self.push_screen(SnapshotScreen(str(path)), done)

    def _confirm(self, title: str, body: str, yes: str, then: Callable[[], None]) -> None:
        self.push_screen(ConfirmScreen(title, body, yes), lambda ok: then() if ok else None)

    @work(thread=True, group="action", exit_on_error=False)
    def _act(self, name: str, call: Callable[[LiveSource], dict], done: str) -> None:
        assert isinstance(self.source, LiveSource)
        try:
            result = call(self.source)
        except Exception as exc:
            self.post_message(ActionFinished(name, False, str(exc)))
            return
        detail = f"{done}: {result['path']}" if isinstance(result, dict) and result.get("path") else done
        self.post_message(ActionFinished(name, True, detail))

    def on_action_finished(self, message: ActionFinished) -> None:
        if message.ok:
            self.notify(message.detail, title=message.action, timeout=6)
        else:
            self.notify(message.detail, title=f"{message.action} failed", severity="error", timeout=10)
