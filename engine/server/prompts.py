"""From a request's prompt or messages to token ids, without blocking the event loop.

A prompt that could never fit is refused before it is tokenized: a token-id list longer than
what can be served (`min(max_model_len, KV tokens)` less the one token to generate), or a string
longer than the most characters that many tokens can stand for (`max_token_chars`: a bound read
once from the tokenizer, so that no prompt that fits is refused). What may fit is tokenized on a
worker thread, so `/health` and the other requests keep answering while a long prompt is encoded;
then the exact limits (`min(max_model_len, KV tokens)`, prompt + `max_tokens`) apply.
"""

from __future__ import annotations

import json
import math
from typing import Any

import anyio

from engine.errors import InvalidRequestError
from engine.server.protocol import APIError, ChatCompletionRequest

# How much shorter a normalizer can make a text: NFC and NFKC compose at most 4 code points into
# one (U+1F82 is alpha and three combining marks); these others never shorten it.
_COMPOSING = {"NFC": 4, "NFKC": 4}
_LENGTHENING = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
# pre-tokenizers that keep every character of the text (the others drop whitespace or delimiters)
_KEEPING = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def max_token_chars(tokenizer) -> int | None:
    """The most characters of prompt text one token can stand for, or None where this tokenizer
    gives no such bound. A token's text is at most its vocabulary string (in byte-level
    vocabularies one character per byte), so a prompt of L characters has at least L / longest
    tokens, provided nothing between the text and the vocabulary drops characters: no normalizer
    that strips them or replaces them by less (NFC/NFKC compose at most 4 into 1: counted), no
    pre-tokenizer that drops whitespace, no unknown token that swallows a run of characters."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # not a `tokenizers` tokenizer: nothing to read the bound from
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_characters(spec.get("pre_tokenizer")) or _unknown_spans(spec.get("model") or {}):
        return None
    return shrink * max(map(len, backend.get_vocab(with_added_tokens=True)))


def _normalizer_shrink(spec: dict | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factors = [_normalizer_shrink(part) for part in spec.get("normalizers", [])]
        return None if None in factors else math.prod(factors)
    if kind in _COMPOSING:
        return _COMPOSING[kind]
    if kind in _LENGTHENING:
        return 1
    if kind == "Replace" and "String" in spec.get("pattern", {}) and spec.get("content"):
        return math.ceil(len(spec["pattern"]["String"]) / len(spec["content"]))
    return None  # Strip, StripAccents, Precompiled, BertNormalizer, a regex Replace...: no bound


def _keeps_characters(spec: dict | None) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_keeps_characters(part) for part in spec.get("pretokenizers", []))
    return spec.get("type") in _KEEPING and spec.get("behavior") != "Removed"


def _unknown_spans(model: dict) -> bool:
    """Whether one unknown token can stand for a run of characters (a word, fused unknowns)."""
    if model.get("type") == "BPE":
        return bool(model.get("unk_token")) and bool(model.get("fuse_unk")) and not model.get("byte_fallback")
    if model.get("type") == "Unigram":
        return not model.get("byte_fallback")
    return True  # WordPiece, WordLevel: an unknown word is one token


class PromptBuilder:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.vocab = engine.spec.vocab_size
        self.max_model_len = engine.max_model_len
        self.kv_tokens = engine.kv.num_blocks * engine.kv.block_size
        self.max_prompt_tokens = engine.max_seq_len - 1  # one token of room left to generate
        self.token_chars = max_token_chars(self.tokenizer)
        self.max_chars = None if self.token_chars is None else self.max_prompt_tokens * self.token_chars

    # ---- cheap checks, before any tokenizing ---------------------------------------------
    def too_long(self, what: str, size: str, param: str) -> APIError:
        return APIError(
            400,
            f"{what} is {size}: it cannot fit in the {self.max_prompt_tokens} tokens a prompt may have "
            f"(max_model_len={self.max_model_len}, KV cache holds {self.kv_tokens} tokens)",
            param=param,
            code="context_length_exceeded",
        )

    def check_chars(self, chars: int, what: str, param: str) -> None:
        if self.max_chars is not None and chars > self.max_chars:
            size = (f"{chars} characters long, over the {self.max_chars} characters that {self.max_prompt_tokens} "
                    f"tokens of at most {self.token_chars} characters each can hold")  # fmt: skip
            raise self.too_long(what, size, param)

    def precheck(self, prompt: str | list[int], param: str) -> None:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, f"{param} is empty", param=param, code="invalid_value")
            self.check_chars(len(prompt), f"the {param}", param)
        elif len(prompt) > self.max_prompt_tokens:
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
        self.check_chars(chars, "the messages' text", "messages")
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
