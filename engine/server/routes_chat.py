"""POST /v1/chat/completions: messages through the model's chat template, streamed or whole."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Request

from engine.outputs import RequestOutput
from engine.server.logprobs import chat_logprobs
from engine.server.openapi import CHAT_DOC
from engine.server.protocol import ChatCompletionRequest
from engine.server.serving import Serving
from engine.server.streaming import EventStream, stream_job


def chat_router(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/chat/completions", **CHAT_DOC)
    async def chat_completions(request: Request):
        req = await s.open(request, ChatCompletionRequest)
        s.check_capacity(req.n, "n")
        ids = await s.prompts.chat_ids(req)
        max_tokens = s.prompts.max_tokens_for(ids, req.wanted_max_tokens, None, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        job = s.start("chatcmpl", [ids], s.sampling(req, max_tokens, k), max_tokens)
        logprobs = None if k is None else partial(chat_logprobs, token_text=s.token_text)
        if req.stream:
            opening = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(job.ids))
            ]
            base = s.header(job, "chat.completion.chunk")
            return EventStream(stream_job(job, s.engine.decode, base, chunk, req, opening, logprobs))
        return await s.respond(request, job, s.header(job, "chat.completion"), whole, logprobs)

    return router


def chunk(i: int, out: RequestOutput, delta: str, lp: dict | None) -> dict:
    content = {"content": delta} if delta else {}
    return {"index": i, "delta": content, "logprobs": lp, "finish_reason": out.finish_reason}


def whole(i: int, out: RequestOutput, lp: dict | None) -> dict:
    message = {"role": "assistant", "content": out.text or "", "refusal": None}
    return {"index": i, "message": message, "logprobs": lp, "finish_reason": out.finish_reason}
