"""What `/openapi.json` says: the request bodies (protocol.py's models) and the response shapes.

The routes read their bodies themselves (bounded in size and time, bodies.py), so FastAPI does
not see the request models; `install_openapi` adds them to the document. The response models
here only document: the routes build plain dicts, and tests (schemathesis) check that what the
server sends matches what this document says.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from engine.server.protocol import ChatCompletionRequest, CompletionRequest


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


FinishReason = Literal["stop", "length", "abort"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str
    state: str


ERRORS = {"4XX": {"model": ErrorResponse, "description": "What the client must change (or retry after)"}}
# each server-sent event (`data:` holds a chunk as JSON, or `[DONE]`), as schemathesis reads events
SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
    "required": ["data"],
}
SSE = {"text/event-stream": {"schema": SSE_EVENT}}


def _doc(request: type[BaseModel], response: type[BaseModel]) -> dict:
    body = {"$ref": f"#/components/schemas/{request.__name__}"}
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
        "responses": {200: {"model": response, "content": SSE, "description": "JSON, or events with stream: true"},
                      **ERRORS},
    }  # fmt: skip


COMPLETION_DOC = _doc(CompletionRequest, CompletionResponse)
CHAT_DOC = _doc(ChatCompletionRequest, ChatCompletionResponse)
MODELS_DOC = {"responses": {200: {"model": ModelList}, **ERRORS}}
MODEL_DOC = {"responses": {200: {"model": ModelCard}, **ERRORS}}
HEALTH_DOC = {"responses": {200: {"model": Health}, 503: {"model": Health, "description": "Draining or down"}}}


def install_openapi(app: FastAPI, version: str, served: str) -> None:
    """`app.openapi()` with the request models added under components/schemas; `model` (in bodies
    and in /v1/models/{model_id}) is the one name served here, as the server accepts nothing else."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title="kvtop", version=version, routes=app.routes,
                             description="OpenAI-compatible completions and chat over a paged KV cache")  # fmt: skip
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatCompletionRequest):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            js["properties"]["model"] = {"type": "string", "enum": [served], "title": "Model"}
            components[model.__name__] = js
        for param in schema["paths"]["/v1/models/{model_id}"]["get"].get("parameters", []):
            param["schema"] = {"type": "string", "enum": [served]}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
