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
import traceback
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
from engine.model.loader import log
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.server.bodies import parse_json_body, read_body
from engine.server.config import DEFAULT_MAX_REQUEST_BODY, DEFAULT_READ_TIMEOUT
from engine.server.detokenize import IncrementalDetokenizer
from engine.server.loop import EngineLoop
from engine.server.metrics import CONTENT_TYPE, render_metrics
from engine.server.prompts import PromptBuilder
from engine.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingRequest,
    validate,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
PARSE_INLINE_BYTES = 64 * 1024  # bigger bodies are parsed on a worker thread


def error_response(status: int, body: dict, headers: dict | None = None) -> Response:
    """JSON with non-ASCII escaped: an error that quotes a client's bytes can always be encoded."""
    return Response(json.dumps(body), status_code=status, media_type="application/json", headers=headers)


# ---- errors ------------------------------------------------------------------------------
def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body; nothing a client sends can cause a 5xx."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query")]
        param = ".".join(loc) or None
        msg = f"{param}: {err.get('msg', 'invalid request')}" if param else err.get("msg", "invalid request")
        return error_response(400, APIError(400, msg, param=param, code="invalid_value").body())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        body = APIError(exc.status_code, msg, type=kind, code=kind).body()
        return error_response(exc.status_code, body, getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log(f"{request.method} {request.url.path} failed:\n{''.join(traceback.format_exception(exc))}")
        body = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body()
        return error_response(500, body)


async def read_request(
    request: Request, model: type, limit: int = DEFAULT_MAX_REQUEST_BODY, timeout: float = DEFAULT_READ_TIMEOUT
):
    """The body, bounded in size and time (bodies.py), parsed and validated into `model`."""
    raw = await read_body(request, limit, timeout)
    if len(raw) > PARSE_INLINE_BYTES:  # megabytes of JSON take a while to parse, walk and validate
        return await anyio.to_thread.run_sync(lambda: validate(model, parse_json_body(raw)))
    return validate(model, parse_json_body(raw))


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
    prompts = PromptBuilder(engine)
    capacity = engine.config.max_num_seqs + loop.config.max_queue

    async def read(request: Request, model: type):
        return await read_request(request, model, loop.config.max_request_body, loop.config.read_timeout)

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
                404, f"model {model[:200]!r} is not served here; this server serves {served!r}", param="model",
                code="model_not_found",
            )  # fmt: skip

    def sampling(req: _SamplingRequest, max_tokens: int, logprobs: int | None) -> list[SamplingParams]:
        try:
            return [
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=-1 if not req.top_k else req.top_k,
                    min_p=req.min_p or 0.0,
                    seed=None if req.seed is None else req.seed + i,
                    stop=req.stop,
                    stop_token_ids=prompts.check_stop_token_ids(req.stop_token_ids),
                    ignore_eos=req.ignore_eos,
                    min_tokens=req.min_tokens,
                    repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    logprobs=logprobs,
                )
                for i in range(req.n)
            ]
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from None

    def check_capacity(count: int, param: str) -> None:
        """A request for more sequences than can ever be in flight is the client's to fix (400),
        not a full queue to retry later (429)."""
        if count > capacity:
            raise APIError(
                400,
                f"this request needs {count} sequences (prompts × n) but at most {capacity} can ever be in flight "
                f"(max_num_seqs {engine.config.max_num_seqs} + max_queue {loop.config.max_queue}): send fewer",
                param=param,
                code="too_many_sequences",
            )

    def admit(job: Job) -> None:
        check_capacity(len(job.ids), "n")
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
        limit = capacity
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
        req = await read(request, CompletionRequest)
        check_model(req.model)
        req.unsupported()
        texts = prompts.split(req.prompt)
        # before tokenizing prompts that could never all be admitted
        check_capacity(len(texts) * req.n, "prompt" if len(texts) > 1 else "n")
        ids_list = await prompts.completion_ids(texts)
        max_tokens = min(
            prompts.max_tokens_for(ids, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, "prompt") for ids in ids_list
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
    def chat_logprobs(out: RequestOutput, start: int, end: int, k: int) -> dict:
        content = []
        for t, lp in zip(out.token_ids[start:end], (out.logprobs or [])[start:end], strict=False):
            s = token_text(t)
            entry = {"token": s, "logprob": lp, "bytes": list(s.encode())}
            content.append({**entry, "top_logprobs": [entry] if k > 0 else []})
        return {"content": content}

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req = await read(request, ChatCompletionRequest)
        check_model(req.model)
        req.unsupported()
        check_capacity(req.n, "n")
        ids = await prompts.chat_ids(req)
        max_tokens = prompts.max_tokens_for(ids, req.wanted_max_tokens, None, "messages")
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
            "max_model_len": engine.max_seq_len,  # min(max_model_len, KV capacity): what a request can use
        }
        return {"object": "list", "data": [card]}

    app.include_router(v1)

    @app.api_route("/health", methods=["GET", "HEAD"])
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
