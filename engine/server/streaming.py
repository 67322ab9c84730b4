"""Server-sent events that notice a client leaving, and the one loop both streaming APIs share.

`stream_job` turns a job's outputs into chunks: per output it finds the text delta and (when
asked) the log-probs of the tokens behind it, skips outputs that add nothing, and asks the route
to shape the choice; it ends with the usage chunk when asked and `[DONE]`. Leaving early (the
client went away) aborts the job.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial

import anyio
from fastapi.responses import StreamingResponse

from engine.outputs import RequestOutput
from engine.server.detokenize import IncrementalDetokenizer, TokenCursor
from engine.server.jobs import Job
from engine.server.protocol import _SamplingRequest


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


# (choice index, its output, the text delta, the delta's log-probs or None) -> the choice in the API's shape
ChunkChoice = Callable[[int, RequestOutput, str, dict | None], dict]
# (an output, the delta's tokens as (index, text, offset) items) -> the log-probs in the API's shape
LogprobsFn = Callable[[RequestOutput, list[tuple[int, str, int]]], dict]


async def stream_job(
    job: Job,
    decode,
    base: dict,
    choice: ChunkChoice,
    req: _SamplingRequest,
    opening: Sequence[dict] = (),
    logprobs: LogprobsFn | None = None,
) -> AsyncIterator[str]:
    """With `stream_options.include_usage` every chunk carries `usage` (null, or with vLLM's
    `continuous_usage_stats` the usage so far) and a last chunk the totals; without it, none does."""
    detok = [IncrementalDetokenizer(decode, p.stop) for p in job.params]
    cursors = [TokenCursor(decode) for _ in job.ids]
    generated = [0] * len(job.ids)

    def chunk(c: dict) -> str:
        usage = {"usage": job.usage_so_far(generated) if req.continuous_usage else None} if req.include_usage else {}
        return sse({**base, "choices": [c], **usage})

    try:
        for first in opening:
            yield chunk(first)
        async for out in job.outputs():
            i = job.index[out.request_id]
            delta = detok[i].update(out.token_ids, out.text if out.finished else None)
            generated[i] = len(out.token_ids)
            lp = None
            if logprobs is not None:
                items = cursors[i].take(out.token_ids, detok[i].sent, out.finished)
                lp = logprobs(out, items) if items else None
            if delta or out.finished or lp is not None:
                yield chunk(choice(i, out, delta, lp))
        if req.include_usage:
            yield sse({**base, "choices": [], "usage": job.usage()})
        yield sse("[DONE]")
    finally:
        job.abort("client disconnected")
