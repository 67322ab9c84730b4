"""Replay: jump to a time (`12.5`, `1:30`, `-5` from the end, `50%`)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Input, Static

from kvtop.dashboard.widgets.dialog import Dialog
from kvtop.sources import parse_offset


class JumpScreen(Dialog[float | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, length_s: float) -> None:
        super().__init__(classes="dialog-screen")
        self.length_s = length_s

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog") as box:
            box.border_title = "Jump to a time"
            yield Static(
                f"Seconds from the start (0 … {self.length_s:.1f}), m:ss, -N from the end, or N%.\n"
                "enter jumps, esc cancels.",
                classes="dialog-body",
            )
            yield Input(placeholder="e.g. 12.5", id="jump-to")
            yield Static("", id="jump-error", classes="dialog-error")

    def on_mount(self) -> None:
        self.query_one("#jump-to", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            self.dismiss(parse_offset(event.value, self.length_s))
        except ValueError as exc:
            self.query_one("#jump-error", Static).update(Content(str(exc)))  # it quotes what was typed

    def action_cancel(self) -> None:
        self.dismiss(None)
