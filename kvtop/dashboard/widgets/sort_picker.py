"""`o`: pick the column to sort the sequences by from a short list (j/k or ↑/↓, enter), instead of
cycling through ten columns. Picking the current column again reverses the order."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from kvtop.dashboard.widgets.dialog import Dialog
from kvtop.dashboard.widgets.view import SORT_COLUMNS

SORT_HELP = {  # column key: what sorting by it answers
    "id": "id",
    "state": "state (running, waiting, swapped)",
    "prompt": "prompt tokens",
    "output": "output tokens so far",
    "cached": "prompt tokens from the prefix cache",
    "blocks": "KV blocks held",
    "kv": "KV bytes held",
    "age": "age (time in the engine)",
    "ttft": "time to first token",
    "itl": "mean inter-token latency",
}
assert tuple(SORT_HELP) == SORT_COLUMNS


class SortScreen(Dialog[str | None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,o", "cancel", "Cancel"),
        Binding("j", "move(1)", "Down", show=False),
        Binding("k", "move(-1)", "Up", show=False),
    ]

    def __init__(
        self, current: str, reverse: bool, choices: dict[str, str] = SORT_HELP, what: str = "sequences"
    ) -> None:
        super().__init__(classes="dialog-screen")
        self.current, self.reverse = current, reverse
        self.choices, self.what = choices, what  # the fleet screen sorts its engines with it too

    def compose(self) -> ComposeResult:
        arrow = "↓" if self.reverse else "↑"
        options = [
            Option(f"{self.choices[key]}{f'  (now, {arrow}: again reverses)' if key == self.current else ''}", id=key)
            for key in self.choices
        ]
        with Vertical(classes="dialog sort-picker") as box:
            box.border_title = f"Sort {self.what} by"
            box.border_subtitle = "enter picks · esc cancels"
            yield OptionList(*options, id="sort-options")

    def on_mount(self) -> None:
        picker = self.query_one(OptionList)
        picker.highlighted = picker.get_option_index(self.current)
        self.set_focus(picker)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_move(self, step: int) -> None:
        picker = self.query_one(OptionList)
        if step > 0:
            picker.action_cursor_down()
        else:
            picker.action_cursor_up()

    def action_cancel(self) -> None:
        self.dismiss(None)
