"""POST /v1/completions: text in, text out, streamed or whole (with `echo`, the prompt first)."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Request

from engine.outputs import RequestOutput
from engine.server.logprobs import completion_logprobs
from engine.server.openapi import COMPLETION_DOC
from engine.server.protocol import CompletionRequest
from engine.server.serving import Serving
from engine.server.streaming import EventStream, stream_job

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def completions_router(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/completions", **COMPLETION_DOC)
    async def completions(request: Request):
        req = await s.open(request, CompletionRequest)
        texts = s.prompts.split(req.prompt)
        # before tokenizing prompts that could never all be admitted
        s.check_capacity(len(texts) * req.n, "prompt" if len(texts) > 1 else "n")
        ids_list = await s.prompts.completion_ids(texts)
        max_tokens = min(
            s.prompts.max_tokens_for(ids, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, "prompt") for ids in ids_list
        )
        job = s.start("cmpl", ids_list, s.sampling(req, max_tokens, req.logprobs), max_tokens)
        echoes = [""] * len(job.ids)
        if req.echo:  # the prompt as sent, or decoded from its token ids
            echoes = [t if isinstance(t, str) else s.engine.decode(ids) for t, ids in zip(texts, ids_list, strict=True)]
            echoes = [echoes[i // job.n] for i in range(len(job.ids))]
        logprobs = None
        if req.logprobs is not None:
            logprobs = partial(completion_logprobs, k=req.logprobs, offset0=0, token_text=s.token_text)
        base = s.header(job, "text_completion")
        if req.stream:
            opening = [
                {"index": i, "text": echo, "logprobs": None, "finish_reason": None}
                for i, echo in enumerate(echoes)
                if echo
            ]
            return EventStream(stream_job(job, s.engine.decode, base, chunk, req, opening, logprobs))
        return await s.respond(request, job, base, partial(whole, echoes), logprobs)

    return router


def chunk(i: int, out: RequestOutput, delta: str, lp: dict | None) -> dict:
    return {"index": i, "text": delta, "logprobs": lp, "finish_reason": out.finish_reason}


def whole(echoes: list[str], i: int, out: RequestOutput, lp: dict | None) -> dict:
    return {"index": i, "text": echoes[i] + (out.text or ""), "logprobs": lp, "finish_reason": out.finish_reason}
