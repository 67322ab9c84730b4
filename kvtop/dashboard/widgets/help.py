"""`?`: every key the dashboard answers to in this mode, grouped, from the bindings themselves."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.widgets import Static

from kvtop.dashboard.widgets.dialog import Dialog

KEY_NAMES = {
    "question_mark": "?",
    "space": "space",
    "slash": "/",
    "left": "←",
    "right": "→",
    "left_square_bracket": "[",
    "right_square_bracket": "]",
    "plus": "+",
    "minus": "-",
    "escape": "esc",
}


def key_label(keys: str) -> str:
    return " ".join(KEY_NAMES.get(k.strip(), k.strip()) for k in keys.split(","))


def help_table(groups: list[tuple[str, list[Binding]]]) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(justify="right", style="bold")
    table.add_column()
    for title, bindings in groups:
        if not bindings:
            continue
        table.add_row("", Text(title, "bold underline"))
        for b in bindings:
            table.add_row(key_label(b.key), b.tooltip or b.description)
    return table


class HelpScreen(Dialog[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark", "dismiss_help", "Close")]

    def __init__(self, groups: list[tuple[str, list[Binding]]], mode: str) -> None:
        super().__init__(classes="dialog-screen")
        self.groups, self.mode = groups, mode

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog help") as box:
            box.border_title = f"kvtop keys ({self.mode})"
            box.border_subtitle = "esc / ? / q closes"
            yield Static(help_table(self.groups))

    def action_dismiss_help(self) -> None:
        self.dismiss(None)
