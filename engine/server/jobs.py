"""One HTTP request's engine requests: `len(prompts) × n` choices fed through one asyncio queue.

The engine thread puts each request's outputs on the job's queue (loop.py); the route reads them
back in order. A client that goes away aborts the job's unfinished requests, so their KV blocks
are freed at the next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request

from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.server.loop import EngineLoop
from engine.telemetry.metrics import RequestStats


class Job:
    """The engine requests behind one HTTP request: `len(prompts) × n` choices, one queue."""

    def __init__(
        self,
        loop: EngineLoop,
        base_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        empty: bool = False,
        stats: RequestStats | None = None,
    ) -> None:
        self.loop = loop
        self.empty = empty  # max_tokens 0: every choice ends at once with no tokens
        self.stats = stats  # vLLM's per-request figures, observed as outputs come (metrics.py)
        self.max_tokens = 0 if empty else params[0].max_tokens
        self._started: set[str] = set()
        self.base_id = base_id
        self.n = len(params)
        self.prompts = prompts
        self.ids = [f"{base_id}-{i}" for i in range(len(prompts) * self.n)]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.params = [params[i % self.n] for i in range(len(self.ids))]
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished: dict[str, RequestOutput] = {}

    def prompt_of(self, i: int) -> list[int]:
        return self.prompts[i // self.n]

    def submit(self) -> None:
        requests = [(rid, self.prompt_of(i), self.params[i]) for i, rid in enumerate(self.ids)]
        self.loop.submit(requests, self.queue.put_nowait)

    def finish_empty(self) -> None:
        for i, rid in enumerate(self.ids):
            prompt = self.prompt_of(i)
            out = RequestOutput(rid, None, prompt, [], text="", finished=True, finish_reason="length",
                                logprobs=[] if self.params[i].logprobs is not None else None)  # fmt: skip
            self.queue.put_nowait(out)

    def usage_so_far(self, generated: list[int]) -> dict:
        """vLLM's continuous_usage_stats: the prompt and the tokens generated up to this chunk."""
        prompt = sum(len(p) for p in self.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": sum(generated), "total_tokens": prompt + sum(generated)}

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        while len(self.finished) < len(self.ids):
            out = await self.queue.get()
            if self.stats is not None:
                self._observe(out)
            if out.finished:
                self.finished[out.request_id] = out
            yield out
        if self.stats is not None:
            for p in range(len(self.prompts)):
                group = [self.finished[rid] for rid in self.ids[p * self.n : (p + 1) * self.n]]
                self.stats.group_finished(self.n, max(len(o.token_ids) for o in group))

    def _observe(self, out: RequestOutput) -> None:
        prompt = len(self.prompt_of(self.index[out.request_id]))
        if out.token_ids and out.request_id not in self._started:
            self._started.add(out.request_id)
            self.stats.first_token(prompt)
        if out.finished:
            self.stats.finished(prompt, len(out.token_ids), self.max_tokens, out.metrics)

    async def collect(self) -> None:
        async for _ in self.outputs():
            pass

    async def run_to_end(self, request: Request) -> bool:
        """Wait for every choice; False when the client went away first (its requests aborted)."""
        collect = asyncio.ensure_future(self.collect())
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not collect.done():
                collect.cancel()
                self.abort("client disconnected")
            gone.cancel()
        return collect.done() and not collect.cancelled()

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


async def until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
