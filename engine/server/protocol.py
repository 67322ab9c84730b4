"""The OpenAI request bodies as pydantic models, and OpenAI-style errors.

Validation is strict (a string is not a number, `1.5` is not an integer; `2.0` is 2, as JSON
does not tell them apart) so that a client bug shows as a 400 naming the parameter instead of a
quietly different request. `null` means "the default" for every optional field, as the OpenAI
spec allows. Fields this engine cannot honour are refused when set to anything but their neutral
value, never ignored. The models are also what `/openapi.json` documents.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from kvtop.protocol.config import EVICT_WAIT_S, MAX_DRAIN_TIMEOUT_S, MAX_EVICT_WAIT_S

MAX_N = 128
MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 64
SEED_RANGE = (-(2**63), 2**63 - 1)
MAX_INT = 2**31 - 1  # counts (tokens, top_k): any larger is a client bug, and must not reach torch as int64

# Parameters other servers accept that this engine does not implement: refused by name unless
# the value is one that asks for nothing (the neutral values listed). Checked on the raw body,
# since the models ignore unknown fields.
REFUSED_COMMON: dict[str, tuple] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0, 1),
    "early_stopping": (False,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "structured_outputs": (),
    "logits_processors": (),
    "bad_words": (),
    "allowed_token_ids": (),
    "prompt_logprobs": (),
    "truncate_prompt_tokens": (),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    "add_special_tokens": (),
    "priority": (0,),
    "kv_transfer_params": (),
}
REFUSED_CHAT: dict[str, tuple] = {
    "functions": (),
    "function_call": ("none",),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "n_best": (),
    "echo": (False,),
    "continue_final_message": (False,),
    "add_generation_prompt": (True,),
    "chat_template": (),
    "chat_template_kwargs": (),
    "documents": (),
}
REFUSED_COMPLETION: dict[str, tuple] = {"response_format": ({"type": "text"},)}


def refuse_unsupported(body: dict, refused: dict[str, tuple]) -> None:
    """A 400 naming the first parameter this engine would otherwise have to ignore."""
    for name, neutral in refused.items():
        if name not in body or body[name] is None:
            continue
        value = body[name]
        if any(type(value) is type(n) and value == n for n in neutral):
            continue
        allowed = " or ".join(repr(n) for n in neutral)
        hint = f": leave it unset{' or ' + allowed if neutral else ''}"
        raise APIError(400, f"{name} is not supported by this engine{hint}", param=name, code="unsupported_parameter")


class APIError(Exception):
    """An answer with an OpenAI error body: `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "is-instance", "literal"}


def _param(loc: tuple) -> str | None:
    """`('messages', 0, 'role')` → `messages[0].role`; stops at pydantic's union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def validate(model: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    refuse_unsupported(body, getattr(model, "refused", {}))
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param(err["loc"])
        kind = err["type"]
        if kind == "missing":
            code, msg = "missing_required_parameter", f"missing required parameter '{param}'"
        else:
            code = "invalid_type" if kind.endswith("_type") else "invalid_value"
            msg = err["msg"].removeprefix("Value error, ")
            msg = f"{param}: {msg}" if param else msg
        raise APIError(400, msg, param=param, code=code) from None


def _whole(v: Any) -> Any:
    """`2.0` is the integer 2 (JSON has one number type); `2.5` stays a float and is refused."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**64:
        return int(v)
    if isinstance(v, list):
        return [_whole(x) for x in v]
    return v


def _is_int_field(annotation: Any) -> bool:
    text = str(annotation)
    return re.search(r"\bint\b", text) is not None and "float" not in text and "Any" not in text


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`null` is the field's default; a whole float (`2.0`) in an integer field is that integer."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: _whole(v) if k in fields and _is_int_field(fields[k].annotation) else v
            for k, v in data.items()
            if v is not None
        }


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage so far in every chunk


class _SamplingRequest(_Strict):
    refused: ClassVar[dict[str, tuple]] = REFUSED_COMMON
    model: str
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT)  # 0: no tokens (with echo, the prompt alone)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)  # 0: only the most likely token
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)  # vLLM's extension; over the vocabulary: no top-k
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's
    min_tokens: int | None = Field(0, ge=0, le=MAX_INT)  # vLLM's: EOS and stop tokens are not sampled before this
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0)  # vLLM's (CTRL's): 1 is off
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)  # vLLM's
    n: int | None = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # vLLM's extension
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v):
        if v and any(not 0 <= t <= MAX_INT for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    def unsupported(self) -> None:
        """Refuse what the engine cannot do rather than ignore it."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by this engine: leave it unset or 0", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this engine", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "minItems": 1,
         "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}},
    ]
}  # fmt: skip


class CompletionRequest(_SamplingRequest):
    refused: ClassVar[dict[str, tuple]] = {**REFUSED_COMMON, **REFUSED_COMPLETION}
    prompt: Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        """str | list[str] | list[int] | list[list[int]], not empty."""
        msg = "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        if v is None:
            raise ValueError("is required")
        if isinstance(v, str):
            return v
        if not isinstance(v, list) or not v:
            raise ValueError(msg if not isinstance(v, list) else "must not be an empty list")
        if all(isinstance(x, str) for x in v):
            return v
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return v
        if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in v):
            return v
        raise ValueError(msg)

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported: this engine computes no prompt log-probs",
                           param="echo", code="unsupported_parameter")  # fmt: skip
        if self.suffix:
            raise APIError(400, "suffix is not supported by this engine", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by this engine", param="best_of")


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text or "" for p in self.content)


class ResponseFormat(_Strict):
    type: str


class ChatCompletionRequest(_SamplingRequest):
    refused: ClassVar[dict[str, tuple]] = {**REFUSED_COMMON, **REFUSED_CHAT}
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_INT)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> None:
        super().unsupported()
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type != "text":
                        raise APIError(
                            400,
                            f"content part type {part.type!r} is not supported: send text",
                            param=f"messages[{i}].content[{j}].type",
                        )
        if self.tools:
            raise APIError(400, "tools are not supported by this engine", param="tools")
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError(400, "only response_format type 'text' is supported", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class DrainRequest(_Strict):
    timeout_s: float | None = Field(None, ge=0, le=MAX_DRAIN_TIMEOUT_S)  # 0: the deadline is now
    abort_after: bool = False


class EvictRequest(_Strict):
    seq_id: str | None = None
    requeue: bool = False
    prefix_cache: bool = False
    blocks: int | None = Field(None, ge=1)
    # a sequence's eviction is applied at the engine's next step: how long to wait for it (200 once
    # applied, 202 while it is still queued)
    wait_s: float = Field(EVICT_WAIT_S, ge=0, le=MAX_EVICT_WAIT_S)


class SnapshotRequest(_Strict):
    path: str | None = None
    reason: str = Field("manual", min_length=1, max_length=200)
