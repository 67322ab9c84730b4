"""POST /v1/chat/completions: messages through the model's chat template, streamed or whole."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from engine.server.detokenize import TokenCursor
from engine.server.jobs import Job
from engine.server.logprobs import chat_logprobs
from engine.server.openapi import CHAT_DOC
from engine.server.protocol import ChatCompletionRequest
from engine.server.serving import Serving
from engine.server.streaming import EventStream, stream_job


def chat_router(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/chat/completions", **CHAT_DOC)
    async def chat_completions(request: Request):
        req = await s.read(request, ChatCompletionRequest)
        s.check_model(req.model)
        req.unsupported()
        s.check_capacity(req.n, "n")
        ids = await s.prompts.chat_ids(req)
        max_tokens = s.prompts.max_tokens_for(ids, req.wanted_max_tokens, None, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = s.sampling(req, max_tokens, k)
        job = Job(s.loop, f"chatcmpl-{uuid.uuid4().hex[:24]}", [ids], params, max_tokens == 0, s.stats)
        s.admit(job)
        base = {"id": job.base_id, "object": "chat.completion", "created": int(time.time()), "model": s.served,
                "system_fingerprint": s.fingerprint}  # fmt: skip
        if req.stream:
            return EventStream(stream(job, req, {**base, "object": "chat.completion.chunk"}, k))
        if not await job.run_to_end(request):
            return Response(status_code=499)
        s.check_errors(job)
        choices = []
        for i, rid in enumerate(job.ids):
            out = job.finished[rid]
            lp = None
            if k is not None:
                lp = chat_logprobs(out, TokenCursor(s.engine.decode).take(out.token_ids, len(out.text or ""), True),
                                   s.token_text)  # fmt: skip
            message = {"role": "assistant", "content": out.text or "", "refusal": None}
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": out.finish_reason})
        return {**base, "choices": choices, "usage": job.usage()}

    def stream(job: Job, req: ChatCompletionRequest, base: dict, k: int | None):
        cursors = [TokenCursor(s.engine.decode) for _ in job.ids]

        def choice(i: int, out: RequestOutput, delta: str, chars: int) -> dict | None:
            lp = None
            if k is not None:
                items = cursors[i].take(out.token_ids, chars, out.finished)
                lp = chat_logprobs(out, items, s.token_text) if items else None
            if not delta and not out.finished and lp is None:
                return None
            content = {"content": delta} if delta else {}
            return {"index": i, "delta": content, "logprobs": lp, "finish_reason": out.finish_reason}

        opening = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(len(job.ids))
        ]
        return stream_job(job, s.engine.decode, base, choice, req, opening)

    return router
