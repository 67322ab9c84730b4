"""Reading and parsing request bodies safely: a size limit, a read timeout, a nesting limit.

What a careless or hostile client can send must end as a 4xx, never as a 5xx, a hang, or a
process that grows by the size of the body:

- `read_body`: refuses a declared `Content-Length` over the limit before reading a byte (413),
  counts bytes as they stream in so a chunked upload cannot pass it either (413), and answers
  408 when the client stops sending for `timeout` seconds.
- `parse_json_body`: JSON that is nested deeper than `MAX_DEPTH`, or holds a lone UTF-16
  surrogate (`"\\ud800"`, or the raw bytes of one) anywhere, is a 400 — the first would take
  the parser down with RecursionError, the second the tokenizer with UnicodeEncodeError.

Shared by the OpenAI routes and the control socket (both answer with `APIError`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anyio
from starlette.requests import Request

from engine.server.protocol import APIError, validate

MAX_DEPTH = 64  # no OpenAI request nests deeper than ~6; a parser's stack is not a resource to offer
CLOSE = {"Connection": "close"}  # the rest of the body is not read: the connection cannot be reused


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than {limit} bytes (the server's --max-request-body)",
        code="request_too_large",
        headers=CLOSE,
    )


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body, at most `limit` bytes, each chunk arriving within `timeout` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), timeout)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive: nothing received for {timeout:g} s",
                code="request_timeout",
                headers=CLOSE,
            ) from None
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_body(raw: bytes) -> Any:
    """The body as JSON, or a 400 that says what is wrong with it (run it off the event loop
    for big bodies: parsing and the walk are linear in the body's size)."""
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object", code="invalid_json")

    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        text = raw.decode("utf-8", "surrogatepass")  # a surrogate encoded raw is caught by the walk
        body = json.loads(text, parse_constant=no_constants)
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not UTF-8 text", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    check_tree(body)
    return body


def check_tree(body: Any) -> None:
    """Walk the parsed body without recursion: depth within MAX_DEPTH, every string (key or
    value) encodable as UTF-8."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node, where, param=where or None)
            continue
        if not isinstance(node, dict | list):
            continue
        if depth >= MAX_DEPTH:
            raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
        if isinstance(node, dict):
            for key, value in node.items():
                _check_text(key, f"a key in {where or 'the body'}", param=where or None)
                stack.append((value, f"{where}.{key}" if where else key, depth + 1))
        else:
            stack.extend((value, f"{where}[{i}]", depth + 1) for i, value in enumerate(node))


def _check_text(text: str, where: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(
            400,
            f"{where or 'the body'}: contains a lone UTF-16 surrogate ({text[exc.start]!r} at character "
            f"{exc.start}), which is not text: send valid Unicode",
            param=param,
            code="invalid_value",
        ) from None


PARSE_INLINE_BYTES = 64 * 1024  # bigger bodies are parsed on a worker thread


async def read_request(request: Request, model: type, limit: int, timeout: float):
    """The body, bounded in size and time, parsed and validated into `model` (protocol.py)."""
    raw = await read_body(request, limit, timeout)
    if len(raw) > PARSE_INLINE_BYTES:  # megabytes of JSON take a while to parse, walk and validate
        return await anyio.to_thread.run_sync(lambda: validate(model, parse_json_body(raw)))
    return validate(model, parse_json_body(raw))
