"""Streaming text: turn a growing list of output token ids into text deltas.

The text so far is the decode of all output ids (one decode per step, which keeps multi-token
characters and the tokenizer's spacing right). A delta is held back while the text ends in an
incomplete UTF-8 sequence (decoded as U+FFFD) or in what could be the start of a stop string,
so a client never sees bytes that later turn into something else. When the request finishes,
the engine's final text (stop string already cut) settles what is left.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | None = None) -> None:
        self._decode = decode
        self._stop = [s for s in stop or [] if s]
        self.sent = 0  # characters of text already handed out

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        held = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held

    def update(self, token_ids: list[int], final_text: str | None = None) -> str:
        """The new text since the last call. Pass `final_text` once the request has finished."""
        if final_text is not None:
            delta = final_text[self.sent :]
            self.sent = max(self.sent, len(final_text))
            return delta
        text = self._decode(token_ids)
        if text.endswith(REPLACEMENT):
            return ""
        end = len(text) - self._held_back(text)
        if end <= self.sent:
            return ""
        delta = text[self.sent : end]
        self.sent = end
        return delta
