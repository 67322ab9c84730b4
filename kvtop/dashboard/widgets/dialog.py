"""Dialog: the base of kvtop's modal screens, which answers once.

Textual's `Screen.dismiss` runs the result callback and pops whatever screen is on top. Keys that
arrive in one terminal read (enter twice, a paste, tmux send-keys) can leave a second answer queued
for a dialog after its first one closed it: an option list or a button posts its message twice. That
second `dismiss` ran the callback again (a second drain or eviction) and popped the dashboard itself
(`ScreenStackError`, kvtop gone). Here only the dialog on top of the stack answers, and only once.
"""

from __future__ import annotations

from typing import TypeVar

from textual.await_complete import AwaitComplete
from textual.screen import ModalScreen

T = TypeVar("T")


class Dialog(ModalScreen[T]):
    _answered = False

    def dismiss(self, result: T | None = None) -> AwaitComplete:
        if self._answered or not self.is_active:
            return AwaitComplete.nothing()
        self._answered = True
        return super().dismiss(result)
