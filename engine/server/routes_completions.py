"""POST /v1/completions: text in, text out, streamed or whole."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from engine.server.jobs import Job
from engine.server.protocol import CompletionRequest
from engine.server.serving import Serving
from engine.server.streaming import EventStream, stream_job

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def completions_router(s: Serving) -> APIRouter:
    router = APIRouter()

    def logprobs(out: RequestOutput, start: int, end: int, k: int, offset0: int) -> dict:
        toks = [s.token_text(t) for t in out.token_ids[start:end]]
        lps = list((out.logprobs or [])[start:end])
        offsets, pos = [], offset0
        for text in toks:
            offsets.append(pos)
            pos += len(text)
        return {
            "tokens": toks,
            "token_logprobs": lps,
            "top_logprobs": [{t: lp} for t, lp in zip(toks, lps, strict=False)] if k > 0 else None,
            "text_offset": offsets,
        }

    @router.post("/completions")
    async def completions(request: Request):
        req = await s.read(request, CompletionRequest)
        s.check_model(req.model)
        req.unsupported()
        texts = s.prompts.split(req.prompt)
        # before tokenizing prompts that could never all be admitted
        s.check_capacity(len(texts) * req.n, "prompt" if len(texts) > 1 else "n")
        ids_list = await s.prompts.completion_ids(texts)
        max_tokens = min(
            s.prompts.max_tokens_for(ids, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, "prompt") for ids in ids_list
        )
        job = Job(s.loop, f"cmpl-{uuid.uuid4().hex[:24]}", ids_list, s.sampling(req, max_tokens, req.logprobs))
        s.admit(job)
        base = {"id": job.base_id, "object": "text_completion", "created": int(time.time()), "model": s.served}
        if req.stream:
            return EventStream(stream(job, req, base))
        if not await job.run_to_end(request):
            return Response(status_code=499)
        s.check_errors(job)
        choices = []
        for i, rid in enumerate(job.ids):
            out = job.finished[rid]
            lp = logprobs(out, 0, len(out.token_ids), req.logprobs, 0) if req.logprobs is not None else None
            choices.append({"index": i, "text": out.text or "", "logprobs": lp, "finish_reason": out.finish_reason})
        return {**base, "choices": choices, "usage": job.usage(), "system_fingerprint": None}

    def stream(job: Job, req: CompletionRequest, base: dict):
        text_pos = [0] * len(job.ids)

        def choice(i: int, out: RequestOutput, delta: str, start: int, end: int) -> dict | None:
            lp = None
            if req.logprobs is not None and end > start:
                lp = logprobs(out, start, end, req.logprobs, text_pos[i])
            if not delta and not out.finished and lp is None:
                return None
            text_pos[i] += len(delta)
            return {"index": i, "text": delta, "logprobs": lp, "finish_reason": out.finish_reason}

        return stream_job(job, s.engine.decode, base, choice, req.include_usage)

    return router
