"""The API's and the control socket's connections, guarded before the app sees a byte.

uvicorn's h11 protocol with what a server facing the network needs and uvicorn lacks: connection
limits, whole and per-client (`ConnectionLimits`, answered with OpenAI-style JSON 503s and
`Retry-After`, refused before anything is read); the API key checked on the request head, so a
client without it gets 401 and a closed connection before it can send a body; a deadline for a
request's head and another for its whole body (not renewed by each trickled byte); Nagle off.
`uvicorn_config` builds one server's settings around it. Logs that a flood would repeat line by
line are rate-limited (`QuietRepeats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import resource
import socket
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import unquote

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.runtime.log import log
from engine.server.errors import closing_response
from engine.server.protocol import APIError
from kvtop.protocol.config import ServerConfig

MAX_HEAD = 16 * 1024  # bytes: an unfinished request head bigger than this is a 400 (h11's buffer limit)
REPEAT_LOG_INTERVAL = 10.0  # seconds: what a flood of connections would log line by line, at most once per this


class ConnectionLimits:
    """One listening server's open connections, in all and per client address, and the refusals
    beyond them. A refused connection costs an accept, one write and a close, and refusals are
    logged as one summary line per REPEAT_LOG_INTERVAL seconds: a flood of connections cannot
    flood the log as well (uvicorn's own limit logged a line for each)."""

    def __init__(self, total: int, per_ip: int) -> None:
        self.total, self.per_ip = total, per_ip
        self.open = 0  # admitted and not yet closed (a refused connection, on its way out, is not counted)
        self.open_by_ip: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # by the limit that refused, since the last line
        self.logged_at = -math.inf
        self._pending_line: asyncio.TimerHandle | None = None
        self._refusals: dict[str, bytes] = {}

    def admit(self, ip: str | None) -> str | None:
        """Count a new connection in, or name the limit that refuses it (a Unix socket's
        connection has no `ip`). Each one counted in is `release`d when it closes."""
        if self.open >= self.total:
            return f"--max-connections {self.total}"
        if ip is not None:
            if self.open_by_ip[ip] >= self.per_ip:
                return f"--max-connections-per-ip {self.per_ip}"
            self.open_by_ip[ip] += 1
        self.open += 1
        return None

    def refusal(self, limit: str) -> bytes:
        """The 503 for `limit`, made once and written whole in one send: each refusal is cheap, so
        that a flood of them is too."""
        if limit not in self._refusals:
            self._refusals[limit] = closing_response(
                APIError(503, f"too many open connections (the server's {limit}): close idle ones, or retry later",
                         type="service_unavailable", code="too_many_connections", headers={"Retry-After": "1"})
            )  # fmt: skip
        return self._refusals[limit]

    def release(self, ip: str | None) -> None:
        self.open -= 1
        if ip is not None:
            self.open_by_ip[ip] -= 1
            if self.open_by_ip[ip] <= 0:
                del self.open_by_ip[ip]

    def note_refused(self, limit: str, aloop: asyncio.AbstractEventLoop) -> None:
        self.refused[limit] += 1
        if self._pending_line is None:
            wait = self.logged_at + REPEAT_LOG_INTERVAL - aloop.time()
            if wait <= 0:
                self.log_refused(aloop)
            else:
                self._pending_line = aloop.call_later(wait, self.log_refused, aloop)

    def log_refused(self, aloop: asyncio.AbstractEventLoop) -> None:
        self._pending_line = None
        count = sum(self.refused.values())
        if count:
            why = ", ".join(f"{n} over {limit}" for limit, n in self.refused.items())
            log(f"refused {count} connection{'s' if count > 1 else ''} with 503 ({why}); "
                f"at most one such line every {REPEAT_LOG_INTERVAL:g} s")  # fmt: skip
            self.refused.clear()
            self.logged_at = aloop.time()


_UNAUTHORIZED = closing_response(
    APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
             headers={"WWW-Authenticate": "Bearer"})
)  # fmt: skip


class _HeadCheckedConnection(h11.Connection):
    """h11's connection that shows each request head to `admit` before uvicorn sees it: a head
    refused (`admit` has answered and closed the connection) never becomes a task, and its body
    is never read."""

    def __init__(self, admit: Callable[[h11.Request], bool], max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self._admit = admit

    def next_event(self):
        event = super().next_event()
        if isinstance(event, h11.Request) and not self._admit(event):
            return h11.NEED_DATA  # uvicorn stops reading events; the connection is closing
        return event


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the limits it lacks, each answered with an OpenAI-style JSON
    error and the connection closed:

    - connections: beyond `limits` (in all, or from one client address) a new connection is
      answered 503 with Retry-After before a byte of it is read (uvicorn's own limit answered in
      plain text once the request had arrived, and logged every refusal);
    - time: a request's headers must be whole within `read_timeout` of its first byte (or of the
      connection), the whole request within `request_timeout`, and a body may not go silent for
      `read_timeout` (the app answers that one first, with its own 408): else 408. The whole-request
      deadline is what stops a client that sends a byte now and then from holding its connection
      for as long as it likes;
    - the API key (`api_key`, on every path but `public`): a request head without it is answered
      401 and the connection closed, before any task or route exists for it and without a byte
      of its body read (as a route dependency, the 401 left the connection open and uvicorn read
      the body and threw it away, gigabytes of it, as fast as the client sent them);
    - answered early (a 413, a 404, a `GET /health` sent with a body): the rest of the body is of
      no use, so the connection is closed, never read to its end.
    """

    read_timeout = 5.0
    request_timeout = 30.0
    limits: ConnectionLimits | None = None
    api_key: bytes | None = None
    public: frozenset[str] = frozenset()  # paths served without the key

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.api_key is not None:
            self.conn = _HeadCheckedConnection(self._authorized, self.config.h11_max_incomplete_event_size or MAX_HEAD)
        self._timer: asyncio.TimerHandle | None = None
        self._began: float | None = None  # when the request being received began (event-loop time)
        self._heard = 0.0  # when its latest bytes came
        self._admitted = False  # counted in `limits`, from `_ip`
        self._ip: str | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _no_delay(transport)
        ip = self.client[0] if self.client else None
        refused = self.limits.admit(ip) if self.limits else None
        if refused is not None:
            self.limits.note_refused(refused, self.loop)
            self._end(None, self.limits.refusal(refused))
            return
        self._admitted, self._ip = self.limits is not None, ip
        self._began = self.loop.time()
        self._watch()

    def data_received(self, data: bytes) -> None:
        now = self.loop.time()
        if self._began is None:  # the first bytes of the next request on a kept-alive connection
            self._began = now
        self._heard = now
        super().data_received(data)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._admitted:
            self.limits.release(self._ip)
            self._admitted = False
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """The server is exiting: a request still arriving will not be served, so it ends now
        rather than keep its handler waiting for a body past the graceful shutdown."""
        if self.conn.their_state is h11.SEND_BODY and self.conn.our_state is h11.SEND_RESPONSE:
            self._end(APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down"))
        else:
            super().shutdown()

    def _authorized(self, request: h11.Request) -> bool:
        path = unquote(request.target.partition(b"?")[0].decode("ascii"))  # as uvicorn routes it
        if path in self.public:
            return True
        auth = next((value for name, value in request.headers if name == b"authorization"), b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            return True
        self._end(None, _UNAUTHORIZED)
        return False

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _watch(self) -> None:
        """One timer for the request being received: its next deadline, or none once it is whole."""
        self._disarm()
        their = self.conn.their_state
        if self.transport.is_closing() or their not in (h11.IDLE, h11.SEND_BODY) or self._began is None:
            self._began = None
            return
        if their is h11.SEND_BODY and self.conn.our_state in (h11.DONE, h11.MUST_CLOSE):
            self._end(None)  # answered already: the rest of the body is of no use to anyone
            return
        if their is h11.IDLE:
            due = self._began + self.read_timeout
        else:  # a little after the app's own 408 for a silent body, which says more
            due = min(self._began + self.request_timeout, self._heard + self.read_timeout + 1.0)
        self._timer = self.loop.call_at(due, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        if self.conn.their_state is h11.IDLE:
            late = f"its headers did not arrive within {self.read_timeout:g} s (the server's --read-timeout)"
        elif self.loop.time() >= self._began + self.request_timeout:
            late = f"it did not arrive whole within {self.request_timeout:g} s (the server's --request-timeout)"
        else:
            late = f"its body went silent for {self.read_timeout:g} s (the server's --read-timeout)"
        self._end(APIError(408, f"the request timed out: {late}", code="request_timeout"))

    def _end(self, err: APIError | None, answer: bytes | None = None) -> None:
        """Close the connection, first answering `err` (or the prepared `answer`) if no response
        has begun. The handler of a request cut short reads a disconnect, and what it writes goes
        nowhere."""
        if (err is not None or answer) and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.write(answer or closing_response(err))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self._disarm()
        self.transport.close()


def _no_delay(transport) -> None:
    """Send each write at once (TCP_NODELAY). asyncio sets it only on sockets created with
    IPPROTO_TCP, and `socket.create_server` (bind_tcp) leaves the protocol 0: without this, Nagle
    held a response's second segment until the client's delayed ACK, +40 ms on every request of
    a kept-alive connection and on a stream's first chunk."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def uvicorn_config(
    app, log_level: str, config: ServerConfig | None = None, per_ip: int | None = None,
    api_key: str | None = None, public: frozenset[str] = frozenset(),
) -> uvicorn.Config:  # fmt: skip
    """One server's uvicorn settings: `per_ip` caps the connections from one client address;
    with `api_key`, every path but `public` needs it."""
    config = config or ServerConfig()
    limits = ConnectionLimits(config.max_connections, per_ip or config.max_connections)  # this server's own
    protocol = type("GuardedH11", (_GuardedH11,), {
        "read_timeout": config.read_timeout, "request_timeout": config.request_timeout, "limits": limits,
        "api_key": api_key.encode() if api_key else None, "public": public,
    })  # fmt: skip
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
        ws="none",
        http=protocol,
        timeout_keep_alive=5,  # an idle keep-alive connection is closed after this many seconds
        limit_concurrency=None,  # the protocol's ConnectionLimits: JSON 503s, refused before reading
        h11_max_incomplete_event_size=MAX_HEAD,
    )


def raise_open_files_limit(wanted: int) -> None:
    """Room for --max-connections on both servers: every connection is a file descriptor, and at
    a soft limit of 1,024 (a common default) accept() would fail before the limit could answer,
    and asyncio then stops accepting anyone for a second."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard)
        )


class QuietRepeats(logging.Filter):
    """uvicorn warns once per malformed request or unsupported upgrade, so a client sending either
    on many connections would flood the log: each such line is let through at most once every
    REPEAT_LOG_INTERVAL seconds, saying how many like it were held back."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: dict[str, float] = {}
        self.held: Counter[str] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        text, now = record.getMessage(), time.monotonic()
        if now - self.shown.get(text, -math.inf) < REPEAT_LOG_INTERVAL:
            self.held[text] += 1
            return False
        self.shown[text] = now
        if held := self.held.pop(text, 0):
            record.msg, record.args = f"{text} ({held} more like it not logged)", ()
        return True
