"""FormScreen: a modal form that submits on Enter or its `yes` button and cancels on `no`/escape."""

from __future__ import annotations

from typing import TypeVar

from textual.screen import ModalScreen
from textual.widgets import Button, Input

T = TypeVar("T")


class FormScreen(ModalScreen[T]):
    """Subclasses implement `_submit` (validate, then `self.dismiss(result)`)."""

    def _submit(self) -> None:
        raise NotImplementedError

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "yes":
            self._submit()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)
