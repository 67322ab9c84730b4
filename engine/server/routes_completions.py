"""POST /v1/completions: text in, text out, streamed or whole (with `echo`, the prompt first)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from engine.server.detokenize import TokenCursor
from engine.server.jobs import Job
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
        params = s.sampling(req, max_tokens, req.logprobs)
        job = Job(s.loop, f"cmpl-{uuid.uuid4().hex[:24]}", ids_list, params, max_tokens == 0, s.stats)
        s.admit(job)
        echoes = [""] * len(job.ids)
        if req.echo:  # the prompt as sent, or decoded from its token ids
            echoes = [t if isinstance(t, str) else s.engine.decode(ids) for t, ids in zip(texts, ids_list, strict=True)]
            echoes = [echoes[i // job.n] for i in range(len(job.ids))]
        base = {"id": job.base_id, "object": "text_completion", "created": int(time.time()), "model": s.served,
                "system_fingerprint": s.fingerprint}  # fmt: skip
        if req.stream:
            return EventStream(stream(job, req, base, echoes))
        if not await job.run_to_end(request):
            return Response(status_code=499)
        s.check_errors(job)
        choices = []
        for i, rid in enumerate(job.ids):
            out = job.finished[rid]
            lp = None
            if req.logprobs is not None:
                items = TokenCursor(s.engine.decode).take(out.token_ids, len(out.text or ""), True)
                lp = completion_logprobs(out, items, req.logprobs, 0, s.token_text)
            text = echoes[i] + (out.text or "")
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason})
        return {**base, "choices": choices, "usage": job.usage()}

    def stream(job: Job, req: CompletionRequest, base: dict, echoes: list[str]):
        cursors = [TokenCursor(s.engine.decode) for _ in job.ids]

        def choice(i: int, out: RequestOutput, delta: str, chars: int) -> dict | None:
            lp = None
            if req.logprobs is not None:
                items = cursors[i].take(out.token_ids, chars, out.finished)
                lp = completion_logprobs(out, items, req.logprobs, 0, s.token_text) if items else None
            if not delta and not out.finished and lp is None:
                return None
            return {"index": i, "text": delta, "logprobs": lp, "finish_reason": out.finish_reason}

        opening = [
            {"index": i, "text": echo, "logprobs": None, "finish_reason": None} for i, echo in enumerate(echoes) if echo
        ]
        return stream_job(job, s.engine.decode, base, choice, req, opening)

    return router
