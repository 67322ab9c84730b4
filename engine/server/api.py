"""The OpenAI-compatible routes on the TCP port: completions, chat, models, health, metrics.

Each HTTP request becomes one engine request per prompt × `n`, sharing one asyncio queue that
the engine thread feeds (see loop.py). A client that goes away aborts its engine requests, so
their KV blocks are freed at the next step; a full queue or a draining engine answers at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.errors import EngineDrainingError, InvalidRequestError
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.server.detokenize import IncrementalDetokenizer
from engine.server.loop import EngineLoop
from engine.server.metrics import CONTENT_TYPE, render_metrics
from engine.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingRequest,
    parse_json,
    validate,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# ---- errors ------------------------------------------------------------------------------
def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body; nothing a client sends can cause a 5xx."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query")]
        param = ".".join(loc) or None
        msg = f"{param}: {err.get('msg', 'invalid request')}" if param else err.get("msg", "invalid request")
        return JSONResponse(APIError(400, msg, param=param, code="invalid_value").body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            APIError(exc.status_code, msg, type=kind, code=kind).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        body = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body()
        return JSONResponse(body, status_code=500)


async def read_request(request: Request, model: type):
    return validate(model, parse_json(await request.body()))


# ---- streaming that notices a client leaving --------------------------------------------
class EventStream(StreamingResponse):
    """StreamingResponse that always listens for the client going away (starlette only does so
    for ASGI < 2.4), so a request waiting in the queue is aborted at once, not at its first token."""

    def __init__(self, content) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:

            async def until_done(func) -> None:
                try:
                    await func()
                except OSError:  # the client is gone mid-send
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(until_done, partial(self.stream_response, send))
            await until_done(partial(self.listen_for_disconnect, receive))


def sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---- one HTTP request's engine requests -------------------------------------------------
class Job:
    """The engine requests behind one HTTP request: `len(prompts) × n` choices, one queue."""

    def __init__(self, loop: EngineLoop, base_id: str, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        self.loop = loop
        self.n = len(params)
        self.prompts = prompts
        self.ids = [f"{base_id}-{i}" for i in range(len(prompts) * self.n)]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.params = [params[i % self.n] for i in range(len(self.ids))]
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished: dict[str, RequestOutput] = {}

    def submit(self) -> None:
        requests = [(rid, self.prompts[i // self.n], self.params[i]) for i, rid in enumerate(self.ids)]
        self.loop.submit(requests, self.queue.put_nowait)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        while len(self.finished) < len(self.ids):
            out = await self.queue.get()
            if out.finished:
                self.finished[out.request_id] = out
            yield out

    async def collect(self) -> None:
        async for _ in self.outputs():
            pass

    def abort(self, detail: str) -> None:
        for rid in self.ids:
            if rid not in self.finished:
                self.loop.abort(rid, detail)

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(o.token_ids) for o in self.finished.values())
        cached = 0
        for p in range(len(self.prompts)):
            group = [self.finished.get(rid) for rid in self.ids[p * self.n : (p + 1) * self.n]]
            cached += max((o.cached_tokens for o in group if o is not None), default=0)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


# ---- the app -----------------------------------------------------------------------------
def build_api(loop: EngineLoop, registry) -> FastAPI:
    engine = loop.engine
    tokenizer = engine.tokenizer
    served = engine.config.served_model_name or engine.config.model
    created = int(engine.start_time)
    vocab = engine.spec.vocab_size
    kv_tokens = engine.kv.num_blocks * engine.kv.block_size

    app = FastAPI(title="kvtop", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    def require_key(request: Request) -> None:
        key = loop.config.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    # -- checks shared by both endpoints --
    def check_model(model: str) -> None:
        if model != served:
            raise APIError(
                404, f"model {model!r} is not served here; this server serves {served!r}", param="model",
                code="model_not_found",
            )  # fmt: skip

    def check_tokens(ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, f"{param} is empty", param=param, code="invalid_value")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)
        return ids

    def max_tokens_for(ids: list[int], asked: int | None, default: int | None, param: str) -> int:
        limit = engine.max_seq_len  # min(max_model_len, KV cache capacity)
        if len(ids) >= limit:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but at most {limit - 1} fit (max_model_len="
                f"{engine.max_model_len}, KV cache {kv_tokens} tokens)",
                param=param,
                code="context_length_exceeded",
            )
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

    def sampling(req: _SamplingRequest, max_tokens: int, logprobs: int | None) -> list[SamplingParams]:
        try:
            return [
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=-1 if not req.top_k else req.top_k,
                    seed=None if req.seed is None else req.seed + i,
                    stop=req.stop,
                    ignore_eos=req.ignore_eos,
                    logprobs=logprobs,
                )
                for i in range(req.n)
            ]
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from None

    def admit(job: Job) -> None:
        state = engine.state
        if state != "running":
            loop.note_rejected("draining", state)
            raise APIError(
                503,
                f"the engine is {state}: it admits no new requests until resumed; retry later",
                type="service_unavailable",
                code="engine_draining",
                headers={"Retry-After": str(_retry_after(loop))},
            )
        limit = engine.config.max_num_seqs + loop.config.max_queue
        if loop.inflight + len(job.ids) > limit:
            loop.note_rejected("queue_full", f"{loop.inflight} requests in flight, limit {limit}")
            raise APIError(
                429,
                f"the queue is full ({loop.inflight} requests in flight, at most {limit}): retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        try:
            job.submit()
        except EngineDrainingError as exc:
            raise APIError(503, str(exc), type="service_unavailable", code="engine_draining",
                           headers={"Retry-After": str(_retry_after(loop))}) from None  # fmt: skip
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from None

    async def run_to_end(job: Job, request: Request) -> bool:
        """Wait for every choice; False when the client went away first (its requests aborted)."""
        collect = asyncio.ensure_future(job.collect())
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not collect.done():
                collect.cancel()
                job.abort("client disconnected")
            gone.cancel()
        return collect.done() and not collect.cancelled()

    def check_errors(job: Job) -> None:
        if any(o.finish_reason == "error" for o in job.finished.values()):
            raise APIError(500, "the engine failed while generating; see the server log", type="server_error")

    def token_text(t: int) -> str:
        return tokenizer.decode([t])

    # -- completions --
    def completion_logprobs(out: RequestOutput, start: int, end: int, k: int, offset0: int) -> dict:
        toks = [token_text(t) for t in out.token_ids[start:end]]
        lps = list((out.logprobs or [])[start:end])
        offsets, pos = [], offset0
        for s in toks:
            offsets.append(pos)
            pos += len(s)
        return {
            "tokens": toks,
            "token_logprobs": lps,
            "top_logprobs": [{s: lp} for s, lp in zip(toks, lps, strict=False)] if k > 0 else None,
            "text_offset": offsets,
        }

    @v1.post("/completions")
    async def completions(request: Request):
        req = await read_request(request, CompletionRequest)
        check_model(req.model)
        req.unsupported()
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        ids_list = []
        for p in prompts:
            if isinstance(p, str) and not p:
                raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
            ids_list.append(check_tokens(engine.tokenize(p), "prompt"))
        max_tokens = min(
            max_tokens_for(ids, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, "prompt") for ids in ids_list
        )
        job = Job(loop, f"cmpl-{uuid.uuid4().hex[:24]}", ids_list, sampling(req, max_tokens, req.logprobs))
        admit(job)
        base = {
            "id": job.ids[0].rsplit("-", 1)[0],
            "object": "text_completion",
            "created": int(time.time()),
            "model": served,
        }
        if req.stream:
            return EventStream(stream_completion(job, req, base))
        if not await run_to_end(job, request):
            return Response(status_code=499)
        check_errors(job)
        choices = []
        for i, rid in enumerate(job.ids):
            out = job.finished[rid]
            lp = completion_logprobs(out, 0, len(out.token_ids), req.logprobs, 0) if req.logprobs is not None else None
            choices.append({"index": i, "text": out.text or "", "logprobs": lp, "finish_reason": out.finish_reason})
        return {**base, "choices": choices, "usage": job.usage(), "system_fingerprint": None}

    async def stream_completion(job: Job, req: CompletionRequest, base: dict) -> AsyncIterator[str]:
        detok = [IncrementalDetokenizer(engine.decode, p.stop) for p in job.params]
        sent_tokens = [0] * len(job.ids)
        text_pos = [0] * len(job.ids)
        extra = {"usage": None} if req.include_usage else {}
        try:
            async for out in job.outputs():
                i = job.index[out.request_id]
                delta = detok[i].update(out.token_ids, out.text if out.finished else None)
                lp = None
                if req.logprobs is not None and len(out.token_ids) > sent_tokens[i]:
                    lp = completion_logprobs(out, sent_tokens[i], len(out.token_ids), req.logprobs, text_pos[i])
                    sent_tokens[i] = len(out.token_ids)
                if not delta and not out.finished and lp is None:
                    continue
                text_pos[i] += len(delta)
                choice = {"index": i, "text": delta, "logprobs": lp, "finish_reason": out.finish_reason}
                yield sse({**base, "choices": [choice], **extra})
            if req.include_usage:
                yield sse({**base, "choices": [], "usage": job.usage()})
            yield sse("[DONE]")
        finally:
            job.abort("client disconnected")

    # -- chat --
    def chat_prompt(req: ChatCompletionRequest) -> list[int]:
        messages = []
        for m in req.messages:
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name:
                msg["name"] = m.name
            messages.append(msg)
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # no template, or the template refuses these messages
            if getattr(tokenizer, "chat_template", None) is None:
                raise APIError(400, "this model has no chat template: use /v1/completions", param="messages") from None
            raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        return check_tokens(tokenizer.encode(text, add_special_tokens=False), "messages")

    def chat_logprobs(out: RequestOutput, start: int, end: int, k: int) -> dict:
        content = []
        for t, lp in zip(out.token_ids[start:end], (out.logprobs or [])[start:end], strict=False):
            s = token_text(t)
            entry = {"token": s, "logprob": lp, "bytes": list(s.encode())}
            content.append({**entry, "top_logprobs": [entry] if k > 0 else []})
        return {"content": content}

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req = await read_request(request, ChatCompletionRequest)
        check_model(req.model)
        req.unsupported()
        ids = chat_prompt(req)
        max_tokens = max_tokens_for(ids, req.wanted_max_tokens, None, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        job = Job(loop, f"chatcmpl-{uuid.uuid4().hex[:24]}", [ids], sampling(req, max_tokens, k))
        admit(job)
        base = {
            "id": job.ids[0].rsplit("-", 1)[0],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": served,
        }
        if req.stream:
            return EventStream(stream_chat(job, req, {**base, "object": "chat.completion.chunk"}, k))
        if not await run_to_end(job, request):
            return Response(status_code=499)
        check_errors(job)
        choices = []
        for i, rid in enumerate(job.ids):
            out = job.finished[rid]
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": out.text or ""},
                    "logprobs": chat_logprobs(out, 0, len(out.token_ids), k) if k is not None else None,
                    "finish_reason": out.finish_reason,
                }
            )
        return {**base, "choices": choices, "usage": job.usage(), "system_fingerprint": None}

    async def stream_chat(job: Job, req: ChatCompletionRequest, base: dict, k: int | None) -> AsyncIterator[str]:
        detok = [IncrementalDetokenizer(engine.decode, p.stop) for p in job.params]
        sent_tokens = [0] * len(job.ids)
        extra = {"usage": None} if req.include_usage else {}
        try:
            for i in range(len(job.ids)):
                choice = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield sse({**base, "choices": [choice], **extra})
            async for out in job.outputs():
                i = job.index[out.request_id]
                delta = detok[i].update(out.token_ids, out.text if out.finished else None)
                lp = None
                if k is not None and len(out.token_ids) > sent_tokens[i]:
                    lp = chat_logprobs(out, sent_tokens[i], len(out.token_ids), k)
                    sent_tokens[i] = len(out.token_ids)
                if not delta and not out.finished and lp is None:
                    continue
                choice = {
                    "index": i,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": lp,
                    "finish_reason": out.finish_reason,
                }
                yield sse({**base, "choices": [choice], **extra})
            if req.include_usage:
                yield sse({**base, "choices": [], "usage": job.usage()})
            yield sse("[DONE]")
        finally:
            job.abort("client disconnected")

    @v1.get("/models")
    async def models():
        card = {
            "id": served,
            "object": "model",
            "created": created,
            "owned_by": "kvtop",
            "root": str(engine.model_path),
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    app.include_router(v1)

    @app.get("/health")
    async def health():
        state = engine.state
        ok = state == "running" and loop.running
        return JSONResponse({"status": "ok" if ok else state, "state": state}, status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics():  # sync: runs in the threadpool, a frame costs a little
        return Response(render_metrics(registry), media_type=CONTENT_TYPE)

    return app


def _retry_after(loop: EngineLoop) -> int:
    info = loop.drain_info
    if info and info.get("deadline"):
        return max(1, math.ceil(info["deadline"] - time.time()))
    return 10
