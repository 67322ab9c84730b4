"""The drain confirmation: what draining does, a timeout field, and whether to abort after it.

Its defaults are `kvctl drain`'s: no timeout (blank), nothing aborted. Cancel has the focus; `y`
(or the Drain button) drains, enter in the timeout field only moves on, and ticking "abort"
needs a timeout, as `kvctl drain --abort-after` needs `--timeout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import Button, Checkbox, Input, Label, Static

from kvtop.dashboard.widgets.form_dialog import FormScreen


@dataclass
class DrainRequest:
    timeout_s: float | None
    abort_after: bool


class DrainScreen(FormScreen[DrainRequest | None]):
    AUTO_FOCUS = "#no"
    SUBMIT_ON_ENTER = False
    # priority: `y` and `n` mean yes and no even in the timeout field, which takes numbers only
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "confirm", "Drain", priority=True),
        Binding("n", "cancel", "Cancel", priority=True),
        Binding("escape", "cancel", "Cancel"),
    ]

    def __init__(self, in_flight: int, timeout_s: float | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self.in_flight = in_flight
        self.timeout_s = timeout_s

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog") as box:
            box.border_title = "Drain the engine?"
            yield Static(
                "The engine stops admitting requests: new ones get 503 with Retry-After.\n"
                f"The {self.in_flight} request(s) in flight keep running until they finish.\n"
                "With a timeout and the box below ticked, those still running then are\n"
                "aborted (finish reason `abort`); otherwise they carry on. `r` resumes admission.",
                classes="dialog-body",
            )
            with Horizontal(classes="dialog-row"):
                yield Label("timeout (s, blank = none) ")
                default = "" if self.timeout_s is None else f"{self.timeout_s:g}"
                yield Input(default, id="drain-timeout", type="number")
            yield Checkbox("abort what is left after the timeout", value=False, id="drain-abort")
            yield Static("", id="drain-error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Drain (y)", variant="error", id="yes")
                yield Button("Cancel (n / esc)", id="no")

    def _submit(self) -> None:
        text = self.query_one("#drain-timeout", Input).value.strip()
        abort = self.query_one("#drain-abort", Checkbox).value
        error = self.query_one("#drain-error", Static)
        try:
            timeout = float(text) if text else None
            if timeout is not None and timeout <= 0:
                raise ValueError
        except ValueError:
            error.update(Content(f"timeout must be a positive number of seconds, not {text!r}"))
            return
        if abort and timeout is None:
            error.update("aborting what is left needs a timeout: fill it in, or untick the box")
            return
        self.dismiss(DrainRequest(timeout, abort))
