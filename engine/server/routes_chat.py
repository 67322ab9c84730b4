"""POST /v1/chat/completions: messages through the model's chat template, streamed or whole."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from engine.server.jobs import Job
from engine.server.protocol import ChatCompletionRequest
from engine.server.serving import Serving
from engine.server.streaming import EventStream, stream_job


def chat_router(s: Serving) -> APIRouter:
    router = APIRouter()

    def logprobs(out: RequestOutput, start: int, end: int, k: int) -> dict:
        content = []
        for t, lp in zip(out.token_ids[start:end], (out.logprobs or [])[start:end], strict=False):
            text = s.token_text(t)
            entry = {"token": text, "logprob": lp, "bytes": list(text.encode())}
            content.append({**entry, "top_logprobs": [entry] if k > 0 else []})
        return {"content": content}

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        req = await s.read(request, ChatCompletionRequest)
        s.check_model(req.model)
        req.unsupported()
        s.check_capacity(req.n, "n")
        ids = await s.prompts.chat_ids(req)
        max_tokens = s.prompts.max_tokens_for(ids, req.wanted_max_tokens, None, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        job = Job(s.loop, f"chatcmpl-{uuid.uuid4().hex[:24]}", [ids], s.sampling(req, max_tokens, k))
        s.admit(job)
        base = {"id": job.base_id, "object": "chat.completion", "created": int(time.time()), "model": s.served}
        if req.stream:
            return EventStream(stream(job, req, {**base, "object": "chat.completion.chunk"}, k))
        if not await job.run_to_end(request):
            return Response(status_code=499)
        s.check_errors(job)
        choices = []
        for i, rid in enumerate(job.ids):
            out = job.finished[rid]
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": out.text or ""},
                    "logprobs": logprobs(out, 0, len(out.token_ids), k) if k is not None else None,
                    "finish_reason": out.finish_reason,
                }
            )
        return {**base, "choices": choices, "usage": job.usage(), "system_fingerprint": None}

    def stream(job: Job, req: ChatCompletionRequest, base: dict, k: int | None):
        def choice(i: int, out: RequestOutput, delta: str, start: int, end: int) -> dict | None:
            lp = logprobs(out, start, end, k) if k is not None and end > start else None
            if not delta and not out.finished and lp is None:
                return None
            content = {"content": delta} if delta else {}
            return {"index": i, "delta": content, "logprobs": lp, "finish_reason": out.finish_reason}

        opening = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(len(job.ids))
        ]
        return stream_job(job, s.engine.decode, base, choice, req.include_usage, opening)

    return router
