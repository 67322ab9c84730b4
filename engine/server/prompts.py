"""From a request's prompt or messages to token ids, without blocking the event loop.

A prompt that could never fit is refused before it is tokenized: a string longer than
`max_model_len × CHARS_PER_TOKEN` characters (no tokenizer packs more characters than that into
a token of real text), or a token-id list longer than `max_model_len`. What may fit is tokenized
on a worker thread, so `/health` and the other requests keep answering while a long prompt is
encoded; then the exact limits (`min(max_model_len, KV tokens)`, prompt + `max_tokens`) apply.
"""

from __future__ import annotations

from typing import Any

import anyio

from engine.errors import InvalidRequestError
from engine.server.protocol import APIError, ChatCompletionRequest

CHARS_PER_TOKEN = 16


class PromptBuilder:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.vocab = engine.spec.vocab_size
        self.max_model_len = engine.max_model_len
        self.kv_tokens = engine.kv.num_blocks * engine.kv.block_size
        self.max_chars = engine.max_model_len * CHARS_PER_TOKEN

    # ---- cheap checks, before any tokenizing ---------------------------------------------
    def too_long(self, what: str, size: str, param: str) -> APIError:
        return APIError(
            400,
            f"{what} is {size}: it cannot fit in max_model_len={self.max_model_len} tokens",
            param=param,
            code="context_length_exceeded",
        )

    def precheck(self, prompt: str | list[int], param: str) -> None:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, f"{param} is empty", param=param, code="invalid_value")
            if len(prompt) > self.max_chars:
                raise self.too_long(f"the {param}", f"{len(prompt)} characters long", param)
        elif len(prompt) > self.max_model_len:
            raise self.too_long(f"the {param}", f"{len(prompt)} token ids long", param)

    @staticmethod
    def split(prompt: Any) -> list[str | list[int]]:
        """A completion's `prompt` (str | list[str] | list[int] | list[list[int]]) as a list of prompts."""
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [prompt]
        return list(prompt)

    # ---- tokenizing (on a worker thread) -------------------------------------------------
    async def completion_ids(self, prompts: list[str | list[int]]) -> list[list[int]]:
        for p in prompts:
            self.precheck(p, "prompt")
        if any(isinstance(p, str) for p in prompts):
            ids_list = await anyio.to_thread.run_sync(lambda: [self.engine.tokenize(p) for p in prompts])
        else:
            ids_list = [list(p) for p in prompts]
        return [self.check_tokens(ids, "prompt") for ids in ids_list]

    async def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        messages = []
        chars = 0
        for m in req.messages:
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            chars += len(msg["content"])
            if m.name:
                msg["name"] = m.name
            messages.append(msg)
        if chars > self.max_chars:
            raise self.too_long("the messages' text", f"{chars} characters long", "messages")
        ids = await anyio.to_thread.run_sync(self._chat_template, messages)
        return self.check_tokens(ids, "messages")

    def _chat_template(self, messages: list[dict]) -> list[int]:
        tokenizer = self.tokenizer
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # no template, or the template refuses these messages
            if getattr(tokenizer, "chat_template", None) is None:
                raise APIError(400, "this model has no chat template: use /v1/completions", param="messages") from None
            raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        return tokenizer.encode(text, add_special_tokens=False)

    # ---- exact limits, on token ids --------------------------------------------------------
    def check_tokens(self, ids: list[int], param: str) -> list[int]:
        try:
            self.engine.limits.check_ids(ids, param)  # the engine's own rules and words
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=param, code=None if ids else "invalid_value") from None
        return ids

    def check_stop_token_ids(self, ids: list[int] | None) -> list[int]:
        bad = next((t for t in ids or [] if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab})", param="stop_token_ids")
        return list(ids or [])

    def max_tokens_for(self, ids: list[int], asked: int | None, default: int | None, param: str) -> int:
        engine, kv_tokens = self.engine, self.kv_tokens
        limit = engine.max_seq_len  # min(max_model_len, KV cache capacity)
        try:
            engine.limits.check_length(ids)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        if asked is None:
            return default if default is not None else limit - len(ids)
        if len(ids) + asked > engine.max_model_len:
            raise APIError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({asked}) = {len(ids) + asked} exceeds max_model_len="
                f"{engine.max_model_len}: ask for at most {engine.max_model_len - len(ids)} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if len(ids) + asked > kv_tokens:
            raise APIError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({asked}) exceeds the KV cache ({kv_tokens} tokens): "
                f"ask for at most {kv_tokens - len(ids)} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return asked
