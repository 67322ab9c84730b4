"""Server-sent events that notice a client leaving, and the one loop both streaming APIs share.

`stream_job` turns a job's outputs into chunks: per output it asks the route for the choice
(text delta, log-probs, finish reason) and skips outputs that add nothing; it ends with the
usage chunk when asked and `[DONE]`. Leaving early (the client went away) aborts the job.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from functools import partial

import anyio
from fastapi.responses import StreamingResponse

from engine.outputs import RequestOutput
from engine.server.detokenize import IncrementalDetokenizer
from engine.server.jobs import Job


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


# (choice index, output, text delta, first token not yet described, tokens now described) -> choice or None
ChoiceFn = Callable[[int, RequestOutput, str, int, int], dict | None]


async def stream_job(
    job: Job, decode, base: dict, choice: ChoiceFn, include_usage: bool, opening: list[dict] = ()
) -> AsyncIterator[str]:
    detok = [IncrementalDetokenizer(decode, p.stop) for p in job.params]
    sent_tokens = [0] * len(job.ids)
    extra = {"usage": None} if include_usage else {}
    try:
        for first in opening:
            yield sse({**base, "choices": [first], **extra})
        async for out in job.outputs():
            i = job.index[out.request_id]
            delta = detok[i].update(out.token_ids, out.text if out.finished else None)
            start, end = sent_tokens[i], len(out.token_ids)
            sent_tokens[i] = end
            c = choice(i, out, delta, start, end)
            if c is not None:
                yield sse({**base, "choices": [c], **extra})
        if include_usage:
            yield sse({**base, "choices": [], "usage": job.usage()})
        yield sse("[DONE]")
    finally:
        job.abort("client disconnected")
