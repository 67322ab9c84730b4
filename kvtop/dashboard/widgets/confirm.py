"""A confirmation for a destructive action: says exactly what will happen; `y` does it, `n`/esc not.

Cancel has the focus from the start (`AUTO_FOCUS`, so even a key typed before the dialog is drawn
finds it there): enter confirms only once the operator has moved to the confirm button. The title
and body hold sequence ids, which come from clients: they are plain text, never markup.
"""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import Button, Static

from kvtop.dashboard.widgets.dialog import Dialog


class ConfirmScreen(Dialog[bool]):
    AUTO_FOCUS = "#no"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, title: str, body: str, yes: str = "Yes") -> None:
        super().__init__(classes="dialog-screen")
        self.title_text, self.body, self.yes = title, body, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog") as box:
            box.border_title = Content(self.title_text)
            yield Static(Content(self.body), classes="dialog-body")
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.yes} (y)", variant="error", id="yes")
                yield Button("Cancel (n / esc)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
