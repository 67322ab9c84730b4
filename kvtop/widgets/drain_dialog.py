"""The drain confirmation: what draining does, a timeout field, and whether to abort after it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Checkbox, Input, Label, Static

from kvtop.widgets.form_dialog import FormScreen


@dataclass
class DrainRequest:
    timeout_s: float | None
    abort_after: bool


class DrainScreen(FormScreen[DrainRequest | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, in_flight: int, timeout_s: float = 60.0) -> None:
        super().__init__(classes="dialog-screen")
        self.in_flight = in_flight
        self.timeout_s = timeout_s

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog") as box:
            box.border_title = "Drain the engine?"
            yield Static(
                "The engine stops admitting requests: new ones get 503 with Retry-After.\n"
                f"The {self.in_flight} request(s) in flight keep running until they finish.\n"
                "After the timeout, those still running are aborted (finish reason `abort`)\n"
                "if the box below is ticked; otherwise they carry on. `r` resumes admission.",
                classes="dialog-body",
            )
            with Horizontal(classes="dialog-row"):
                yield Label("timeout (s, blank = none) ")
                yield Input(str(int(self.timeout_s)), id="drain-timeout", type="number")
            yield Checkbox("abort what is left after the timeout", value=False, id="drain-abort")
            yield Static("", id="drain-error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Drain (enter)", variant="error", id="yes")
                yield Button("Cancel (esc)", id="no")

    def on_mount(self) -> None:
        self.query_one("#drain-timeout", Input).focus()

    def _submit(self) -> None:
        text = self.query_one("#drain-timeout", Input).value.strip()
        try:
            timeout = float(text) if text else None
            if timeout is not None and timeout <= 0:
                raise ValueError
        except ValueError:
            self.query_one("#drain-error", Static).update(f"timeout must be a positive number of seconds, not {text!r}")
            return
        self.dismiss(DrainRequest(timeout, self.query_one("#drain-abort", Checkbox).value))
