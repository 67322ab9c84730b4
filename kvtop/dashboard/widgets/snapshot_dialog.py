"""The snapshot confirmation: what a snapshot holds and the file it is written to (editable)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Static

from kvtop.dashboard.widgets.form_dialog import FormScreen


class SnapshotScreen(FormScreen[str | None]):
    """Not destructive: the path field has the focus and enter writes the snapshot."""

    AUTO_FOCUS = "#snapshot-path"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    BODY = (
        "The engine writes its flight recorder (the last minutes of stats frames), its\n"
        "events, the sequences and the block table to this file (SQLite, .kvsnap),\n"
        "atomically. Nothing else changes. Replay it with `kvtop --replay FILE`."
    )

    def __init__(self, path: str, body: str = BODY) -> None:
        super().__init__(classes="dialog-screen")
        self.path, self.body = path, body  # body: what writes the file (kvtop itself for a /metrics engine)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog") as box:
            box.border_title = "Take a snapshot?"
            yield Static(self.body, classes="dialog-body")
            yield Input(self.path, id="snapshot-path")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Snapshot (enter)", variant="primary", id="yes")
                yield Button("Cancel (esc)", id="no")

    def _submit(self) -> None:
        path = self.query_one("#snapshot-path", Input).value.strip()
        self.dismiss(path or None)
