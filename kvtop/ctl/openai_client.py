"""The one OpenAI client of kvctl bench and the demo: a completion or chat request sent over httpx,
streamed (timed chunk by chunk, as a user sees the text arrive) or whole.

A server that refuses, drops the connection or sends garbage gives an `Answer` with `error` set,
never an exception: a load generator counts failures, it does not stop at the first one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Answer:
    """What came back for one request; times in seconds from the moment it was sent."""

    ttft: float | None = None  # streamed: the first chunk that carried text
    itls: list[float] = field(default_factory=list)  # streamed: the gaps between chunks that carried text
    e2e: float | None = None  # the whole answer read
    chunks: int = 0  # streamed: chunks that carried text
    usage: dict | None = None  # the answer's `usage` (streamed: `stream_options.include_usage`)
    finish_reason: str | None = None
    error: str | None = None


def http_error(status: int, body: bytes) -> str:
    """`HTTP 429: <the OpenAI error's message>` (or the start of a body that is not one)."""
    text = body.decode(errors="replace")
    try:
        return f"HTTP {status}: {json.loads(text)['error']['message']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"HTTP {status}: {text[:200]}"


async def stream(http: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> Answer:
    """POST `body` with `stream: true` and read the server-sent events to `[DONE]`."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    answer = Answer()
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                answer.error = http_error(r.status_code, await r.aread())
                return answer
            async for line in r.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else None
                if data == "[DONE]":
                    break
                if data and _read_chunk(answer, json.loads(data)):
                    now = time.perf_counter()
                    if answer.ttft is None:
                        answer.ttft = now - start
                    else:
                        answer.itls.append(now - last)
                    last = now
                    answer.chunks += 1
        answer.e2e = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    return answer


def _read_chunk(answer: Answer, chunk: dict) -> bool:
    """Take a chunk's usage and finish reason; True when it carried text (a completion's `text`,
    a chat's `delta.content`)."""
    if chunk.get("usage"):
        answer.usage = chunk["usage"]
    text = False
    for choice in chunk.get("choices") or []:
        answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
        text = text or bool(choice.get("text") or (choice.get("delta") or {}).get("content"))
    return text


async def complete(http: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> Answer:
    """POST `body` and read the whole answer."""
    answer = Answer()
    start = time.perf_counter()
    try:
        r = await http.post(url, json=body, headers=headers)
        if r.status_code != 200:
            answer.error = http_error(r.status_code, r.content)
            return answer
        whole = r.json()
        answer.usage, answer.finish_reason = whole.get("usage"), whole["choices"][0]["finish_reason"]
        answer.e2e = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    return answer
