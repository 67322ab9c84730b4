"""What every OpenAI route shares: the model check, sampling parameters, admission. (The API key
is checked before any route runs: app.py's protocol.)

`Serving` holds the per-server facts (the engine loop, the served name, the prompt builder) and
turns a validated request into an admitted `Job`, or an `APIError` a client can act on: 400 for
what can never be served, 429 for a full queue, 503 while draining.
"""

from __future__ import annotations

import hashlib
import math
import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response

from engine.drain import EngineState
from engine.errors import EngineDrainingError, InvalidRequestError
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.server.bodies import read_request
from engine.server.detokenize import TokenCursor
from engine.server.jobs import Job
from engine.server.loop import EngineLoop
from engine.server.prompts import PromptBuilder
from engine.server.protocol import APIError, _SamplingRequest
from engine.server.streaming import LogprobsFn
from engine.telemetry.metrics import RequestStats
from kvtop.protocol.version import __version__

# (choice index, its finished output, its log-probs or None) -> the choice in the API's shape
WholeChoice = Callable[[int, RequestOutput, dict | None], dict]


class Serving:
    def __init__(self, loop: EngineLoop, stats: RequestStats | None = None) -> None:
        self.loop = loop
        self.stats = stats  # per-request figures for /metrics
        self.engine = loop.engine
        self.tokenizer = self.engine.tokenizer
        self.served = self.engine.config.served_model_name or self.engine.config.model
        self.prompts = PromptBuilder(self.engine)
        self.capacity = self.engine.config.max_num_seqs + loop.config.max_queue
        # what would change the tokens for the same request: the weights, their dtype, the version
        digest = hashlib.sha256(f"{self.served}|{self.engine.model_path}|{self.engine.dtype}|{__version__}".encode())
        self.fingerprint = f"fp_{digest.hexdigest()[:10]}"

    async def read(self, request: Request, model: type):
        return await read_request(request, model, self.loop.config.max_request_body, self.loop.config.read_timeout)

    async def open(self, request: Request, model: type):
        """The request's body, read and validated, for the model served here, asking nothing unsupported."""
        req = await self.read(request, model)
        self.check_model(req.model)
        req.unsupported()
        return req

    def start(self, prefix: str, prompts: list[list[int]], params: list[SamplingParams], max_tokens: int) -> Job:
        """The admitted job of `prompts` × `n` choices; its id is `prefix-<random>`."""
        job = Job(self.loop, f"{prefix}-{uuid.uuid4().hex[:24]}", prompts, params, max_tokens == 0, self.stats)
        self.admit(job)
        return job

    def header(self, job: Job, obj: str) -> dict:
        """What every response (and every chunk) of the job opens with."""
        return {"id": job.base_id, "object": obj, "created": int(time.time()), "model": self.served,
                "system_fingerprint": self.fingerprint}  # fmt: skip

    async def respond(self, request: Request, job: Job, base: dict, choice: WholeChoice, logprobs: LogprobsFn | None):
        """The whole response once every choice has finished; a 499 if the client left first.
        `logprobs` (when asked for) describes the tokens of each choice's returned text."""
        if not await job.run_to_end(request):
            return Response(status_code=499)
        self.check_errors(job)
        choices = []
        for i, rid in enumerate(job.ids):
            out = job.finished[rid]
            lp = None
            if logprobs is not None:
                lp = logprobs(out, TokenCursor(self.engine.decode).take(out.token_ids, len(out.text or ""), True))
            choices.append(choice(i, out, lp))
        return {**base, "choices": choices, "usage": job.usage()}

    def check_model(self, model: str) -> None:
        if model != self.served:
            raise APIError(
                404, f"model {model[:200]!r} is not served here; this server serves {self.served!r}", param="model",
                code="model_not_found",
            )  # fmt: skip

    def sampling(self, req: _SamplingRequest, max_tokens: int, logprobs: int | None) -> list[SamplingParams]:
        """One SamplingParams per choice (seed + i for choice i). `top_p: 0` keeps only the most
        likely token, i.e. greedy; `max_tokens: 0` never reaches the engine (see `Job.empty`)."""
        top_p = 1.0 if req.top_p is None else req.top_p
        temperature = 1.0 if req.temperature is None else req.temperature
        try:
            return [
                SamplingParams(
                    max_tokens=max(max_tokens, 1),
                    temperature=0.0 if top_p == 0 else temperature,
                    top_p=top_p or 1.0,
                    top_k=-1 if not req.top_k else req.top_k,
                    min_p=req.min_p or 0.0,
                    seed=None if req.seed is None else req.seed + i,
                    stop=req.stop,
                    stop_token_ids=self.prompts.check_stop_token_ids(req.stop_token_ids),
                    ignore_eos=req.ignore_eos,
                    min_tokens=req.min_tokens,
                    repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    logprobs=logprobs,
                )
                for i in range(req.n)
            ]
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from None

    def check_capacity(self, count: int, param: str) -> None:
        """A request for more sequences than can ever be in flight is the client's to fix (400),
        not a full queue to retry later (429)."""
        if count > self.capacity:
            raise APIError(
                400,
                f"this request needs {count} sequences (prompts × n) but at most {self.capacity} can ever be in "
                f"flight (max_num_seqs {self.engine.config.max_num_seqs} + max_queue {self.loop.config.max_queue}): "
                "send fewer",
                param=param,
                code="too_many_sequences",
            )

    def admit(self, job: Job) -> None:
        loop = self.loop
        self.check_capacity(len(job.ids), "n")
        if job.empty:  # max_tokens 0: nothing to generate, nothing to queue
            job.finish_empty()
            return
        state = self.engine.state
        if state is not EngineState.RUNNING:
            loop.note_rejected("draining", state.value)
            raise self.draining(f"the engine is {state}: it admits no new requests until resumed; retry later")
        if loop.inflight + len(job.ids) > self.capacity:
            loop.note_rejected("queue_full", f"{loop.inflight} requests in flight, limit {self.capacity}")
            raise APIError(
                429,
                f"the queue is full ({loop.inflight} requests in flight, at most {self.capacity}): retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        try:
            job.submit()
        except EngineDrainingError as exc:
            raise self.draining(str(exc)) from None
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from None

    def draining(self, message: str) -> APIError:
        return APIError(503, message, type="service_unavailable", code="engine_draining",
                        headers={"Retry-After": str(self.retry_after())})  # fmt: skip

    def retry_after(self) -> int:
        info = self.engine.drain_state.info
        if info and info.deadline:
            return max(1, math.ceil(info.deadline - time.time()))
        return 10

    @staticmethod
    def check_errors(job: Job) -> None:
        if any(o.finish_reason == "error" for o in job.finished.values()):
            raise APIError(500, "the engine failed while generating; see the server log", type="server_error")

    def token_text(self, t: int) -> str:
        return self.tokenizer.decode([t])
