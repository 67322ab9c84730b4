"""FormScreen: a modal form that submits on its `yes` button and cancels on `no`/escape.

Enter in a text field submits too (`SUBMIT_ON_ENTER`), except in forms for destructive actions,
which set it False: there enter in a field moves on to the next one, and only `y` or the
confirm button does the deed.
"""

from __future__ import annotations

from typing import ClassVar, TypeVar

from textual.widgets import Button, Input

from kvtop.dashboard.widgets.dialog import Dialog

T = TypeVar("T")


class FormScreen(Dialog[T]):
    """Subclasses implement `_submit` (validate, then `self.dismiss(result)`)."""

    SUBMIT_ON_ENTER: ClassVar[bool] = True

    def _submit(self) -> None:
        raise NotImplementedError

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if self.SUBMIT_ON_ENTER:
            self._submit()
        else:
            self.focus_next()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "yes":
            self._submit()
        else:
            self.dismiss(None)

    def action_confirm(self) -> None:
        self._submit()

    def action_cancel(self) -> None:
        self.dismiss(None)
