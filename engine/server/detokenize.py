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


class TokenTexts:
    """Each output token's share of the text, so log-probs describe exactly the returned text.

    Token j's text is what decoding the first j+1 tokens adds to decoding the first j (the
    tokenizer's spacing kept; a token ending inside a UTF-8 character adds nothing, the one
    completing it adds the character). Special tokens the text skips (`<|im_end|>`) add nothing.
    `within(n)` keeps the tokens that start inside the first n characters, the last one cut at n:
    a stop string's tokens and a final EOS are not part of the returned text, so not listed."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.text = ""
        self.ends: list[int] = []  # character offset where each token's text ends

    def update(self, token_ids: list[int]) -> None:
        for j in range(len(self.ends), len(token_ids)):
            full = self._decode(token_ids[: j + 1])
            stable = full.rstrip(REPLACEMENT)  # an incomplete character is not text yet
            if stable.startswith(self.text):
                self.text = stable
            self.ends.append(max(len(self.text), self.ends[-1] if self.ends else 0))

    def span(self, j: int) -> tuple[int, int]:
        return (self.ends[j - 1] if j else 0), self.ends[j]

    def released(self, start: int, chars: int) -> int:
        """How many tokens from `start` on end within the first `chars` characters."""
        end = start
        while end < len(self.ends) and self.ends[end] <= chars:
            end += 1
        return end

    def within(self, start: int, chars: int) -> list[tuple[int, str, int]]:
        """(token index, its text cut at `chars`, its offset) for tokens from `start` that begin before `chars`."""
        out = []
        for j in range(start, len(self.ends)):
            a, b = self.span(j)
            if a >= chars:
                break
            out.append((j, self.text[a : min(b, chars)], a))
        return out


class TokenCursor:
    """Which of a choice's tokens have been described so far, as its text is handed out."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.texts = TokenTexts(decode)
        self.done = 0

    def take(self, token_ids: list[int], chars: int, finished: bool) -> list[tuple[int, str, int]]:
        """The tokens not yet described whose text lies in the first `chars` characters handed out;
        until the choice finishes, only tokens whose whole text is out."""
        self.texts.update(token_ids)
        items = self.texts.within(self.done, chars)
        if not finished:
            items = [it for it in items if self.texts.ends[it[0]] <= chars]
        self.done += len(items)
        return items
