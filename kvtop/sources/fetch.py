"""One HTTP GET whose answer is bounded, whatever the server does: at most `max_bytes` of body and
`deadline_s` for the whole exchange (connecting, headers, body).

Pages are served by engines anyone may point kvtop at: a 2 GB page, or one sent a byte a second, must
cost a bounded amount of memory and time. httpx's timeouts are per read, so a byte a second never
trips them; the deadline here is the whole exchange's. A timer shuts the connection's socket down
at the deadline, which ends a read that is waiting, in the headers as in the body. The socket is
known from the connect (httpcore's `trace` extension), so the clients made here keep no connection
alive between requests: every request connects, and its socket is the one the timer watches.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from typing import Any

import httpx

MiB = 1024**2


class PageTooLarge(Exception):
    """The body is longer than the cap: refused without reading the rest."""


class PageTooSlow(Exception):
    """The whole answer did not arrive before the deadline."""


@dataclass
class Page:
    """An answer read whole within the limits."""

    status_code: int
    content: bytes
    encoding: str

    @property
    def text(self) -> str:
        return self.content.decode(self.encoding, errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


def client(timeout: float) -> httpx.Client:
    """A client for `fetch`: `timeout` per connect and per read, no connection kept alive (each
    request's socket is the one its deadline watches), no redirects, no compression asked for."""
    return httpx.Client(
        timeout=timeout,
        follow_redirects=False,
        limits=httpx.Limits(max_keepalive_connections=0),
        headers={"Accept-Encoding": "identity"},
    )


_IN_FLIGHT: set[_Deadline] = set()  # the exchanges under way, for cancel_in_flight


def cancel_in_flight() -> None:
    """End every exchange under way now, as its deadline would: for a Ctrl-C handler (`kvctl
    record`), which must not wait an hour for a page. It only shuts sockets, so it is safe wherever
    the signal lands (a finalizer included)."""
    for deadline in tuple(_IN_FLIGHT):
        deadline.expire()


class _Deadline:
    """Shuts the request's socket down when the time is up (from a timer thread), or when
    cancel_in_flight says so."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._sock: socket.socket | None = None
        self._lock = threading.RLock()  # cancel_in_flight may run in this thread, inside trace()
        self._timer = threading.Timer(seconds, self.expire)
        self._timer.daemon = True

    def trace(self, event: str, info: dict) -> None:
        """httpcore's trace hook: a connect (or TLS start) that completed hands over its stream."""
        stream = info.get("return_value") if event.endswith(".complete") else None
        sock = stream.get_extra_info("socket") if hasattr(stream, "get_extra_info") else None
        if isinstance(sock, socket.socket):
            with self._lock:
                self._sock = sock
                if self.expired:  # connected just as the time ran out
                    _shut(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            if self._sock is not None:
                _shut(self._sock)

    def __enter__(self) -> _Deadline:
        _IN_FLIGHT.add(self)
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        _IN_FLIGHT.discard(self)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes the read waiting on it, in whichever thread
    except OSError:  # already closed
        pass


def fetch(
    http: httpx.Client,
    url: str,
    *,
    max_bytes: int,
    deadline_s: float,
    what: str = "the page",
    params: dict | None = None,
) -> Page:
    """GET `url` through `http` (made by `client`): the whole answer, any status. PageTooLarge when
    the body passes `max_bytes` (a Content-Length that says so is refused before reading),
    PageTooSlow when the exchange passes `deadline_s`; httpx's errors (refused, per-read timeout,
    dropped) as they come. `what` names the page in the messages."""
    too_large = f"{what} is larger than {max_bytes / MiB:g} MiB"
    with _Deadline(deadline_s) as deadline:
        try:
            with http.stream("GET", url, params=params, extensions={"trace": deadline.trace}) as r:
                length = r.headers.get("content-length", "")
                if length.isdigit() and int(length) > max_bytes:
                    raise PageTooLarge(too_large)
                chunks, size = [], 0
                for chunk in r.iter_bytes():  # decoded: a compressed page is counted as it unpacks
                    size += len(chunk)
                    if size > max_bytes:
                        raise PageTooLarge(too_large)
                    chunks.append(chunk)
                if deadline.expired:  # the shutdown may read as a clean end of a body without a length
                    raise PageTooSlow(f"{what} did not arrive in {deadline_s:g} s")
                return Page(r.status_code, b"".join(chunks), r.encoding or "utf-8")
        except httpx.HTTPError:
            if deadline.expired:
                raise PageTooSlow(f"{what} did not arrive in {deadline_s:g} s") from None
            raise
