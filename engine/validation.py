"""What a prompt must be to run: non-empty, token ids in the vocabulary, short enough to leave
room for one generated token. The engine and the HTTP server ask the same `PromptLimits`, so a
request is refused with the same words wherever it comes in."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    max_model_len: int
    kv_tokens: int  # tokens the whole KV cache holds

    @property
    def max_seq_len(self) -> int:
        """Prompt + output tokens one sequence may reach: min(max_model_len, the KV cache)."""
        return min(self.max_model_len, self.kv_tokens)

    def bad_token(self, token_ids: list[int]) -> object | None:
        """The first id that is not an integer in [0, vocab_size), or None."""
        return next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)

    def check(self, token_ids: list[int], what: str = "prompt") -> None:
        """Raise InvalidRequestError (its message says what fits) for a prompt that can never run."""
        self.check_ids(token_ids, what)
        self.check_length(token_ids, what)

    def check_ids(self, token_ids: list[int], what: str = "prompt") -> None:
        if not token_ids:
            raise InvalidRequestError(f"{what} is empty")
        bad = self.bad_token(token_ids)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")

    def check_length(self, token_ids: list[int], what: str = "prompt") -> None:
        if len(token_ids) >= self.max_seq_len:
            raise InvalidRequestError(
                f"the {what} has {len(token_ids)} tokens but at most {self.max_seq_len - 1} fit "
                f"(max_model_len={self.max_model_len}, KV cache holds {self.kv_tokens} tokens)"
            )
