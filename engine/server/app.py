"""`kvctl serve`: one engine, two uvicorn servers (TCP for the OpenAI API and /metrics, a Unix
socket for stats and control) in one event loop, and the signals an operator sends.

- SIGTERM / SIGINT: drain — stop admitting, let requests in flight finish for up to
  `drain_timeout` seconds, abort what is left — then exit 0. A second one aborts what is left
  at once (streams end with finish reason `abort` and `[DONE]`) and exits; a third one exits
  without waiting.
- SIGUSR1: write a snapshot into `snapshot_dir`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import resource
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.config import EngineConfig, context_limit_warning, format_bytes
from engine.log import log
from engine.model.packed_linear import prefill_copy_note
from engine.openmp import release_thread_pool
from engine.server.config import ServerConfig
from engine.server.errors import closing_response
from engine.server.protocol import APIError
from engine.server.sockets import bind_tcp, bind_unix, check_socket, resolve_socket
from engine.warmup import warm_up


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: this process handles signals once for both."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


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


def _uvicorn_config(
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


def startup_summary(
    engine, config: ServerConfig, api_url: str, socket_path: Path, warmed: tuple[int, int, float] | str
) -> str:
    kv = engine.kv
    cap = kv.num_blocks * kv.block_size
    name = engine.config.served_model_name or engine.config.model
    spec = engine.spec
    auto = ", ".join(config.snapshot_on) if config.snapshot_on else "off"
    lines = [
        f"kvtop serve: model {name} ({spec.model_type}, {spec.num_layers} layers) on {engine.device}, "
        f"{str(engine.dtype).removeprefix('torch.')}, attention {engine.attention_backend}",
        f"  KV cache  {kv.kv_cache_dtype}: {kv.bytes_per_token} B/token, {kv.num_blocks} blocks × {kv.block_size} "
        f"= {cap} tokens in {format_bytes(kv.total_bytes)}; max_model_len {engine.max_model_len}, "
        f"max_num_seqs {engine.config.max_num_seqs}, queue {config.max_queue}",
        *([f"  warning   {w}"] if (w := context_limit_warning(engine.max_model_len, cap)) else []),
        *(
            [f"  weights   {note}"]
            if (note := prefill_copy_note(engine.weights_bytes, engine.prefill_copy_bytes))
            else []
        ),
        f"  OpenAI    {api_url}/v1  (completions, chat/completions, models)"
        + ("  API key required" if config.api_key else ""),
        f"  metrics   {api_url}/metrics    health {api_url}/health",
        f"  control   {socket_path}  (kvctl status | drain | evict | snapshot; kvtop)",
        f"  recorder  a frame every {config.stats_interval:g} s for {config.history:g} s; "
        f"auto snapshots: {auto} → {config.snapshot_dir}",
        f"  warm-up   {warm_up_line(warmed)}",
    ]
    return "\n".join(lines)


def serve(engine_config: EngineConfig, config: ServerConfig, log_level: str = "warning") -> int:
    """Run until drained by a signal; returns the exit code."""
    from engine.llm_engine import LLMEngine

    socket_path = resolve_socket(config.socket)
    check_socket(socket_path)  # fail before spending seconds on the model
    _raise_open_files_limit(2 * config.max_connections + 1024)
    tcp = bind_tcp(config.host, config.port)
    try:
        engine = LLMEngine(engine_config, quiet=True)
        warmed = _warm_up(engine) if config.warmup else "off (--no-warmup)"
        release_thread_pool()  # the engine thread steps from here on: its OpenMP team must be the only one
        uds = bind_unix(socket_path)
    except BaseException:
        tcp.close()
        raise
    port = tcp.getsockname()[1]
    host = f"[{config.host}]" if ":" in config.host else config.host
    api_url = f"http://{host}:{port}"
    try:
        return asyncio.run(_serve(engine, config, tcp, uds, socket_path, api_url, log_level, warmed))
    finally:
        with contextlib.suppress(OSError):
            if socket_path.is_socket():
                socket_path.unlink()


def _raise_open_files_limit(wanted: int) -> None:
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


class _QuietRepeats(logging.Filter):
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


class _Signals:
    """The signals an operator sends while serving: the first SIGTERM or SIGINT drains and exits
    when drained; a second aborts what is left (every stream ends with finish reason `abort` and
    `[DONE]`, every other request gets its answer) and exits; a third exits without waiting for
    anything. SIGUSR1 writes a snapshot."""

    HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    ABORT_GRACE = 2.0  # seconds the engine thread has to finish the aborted requests itself

    def __init__(self, loop, config: ServerConfig, servers: tuple, stopping: asyncio.Event) -> None:
        self.loop = loop
        self.config = config
        self.servers = servers
        self.stopping = stopping
        self.received = 0  # SIGTERMs and SIGINTs so far
        self.tasks: list[asyncio.Task] = []  # held, so that the watchers are not collected

    def install(self, aloop: asyncio.AbstractEventLoop) -> None:
        aloop.add_signal_handler(signal.SIGTERM, self.on_terminate, aloop, "SIGTERM")
        aloop.add_signal_handler(signal.SIGINT, self.on_terminate, aloop, "SIGINT")
        aloop.add_signal_handler(signal.SIGUSR1, self.on_usr1)

    def remove(self, aloop: asyncio.AbstractEventLoop) -> None:
        for sig in self.HANDLED:
            aloop.remove_signal_handler(sig)

    def exit_now(self) -> None:
        self.stopping.set()
        for s in self.servers:
            s.should_exit = True

    async def exit_when_drained(self) -> None:
        while self.loop.engine.state != "drained" or self.loop.inflight:
            await asyncio.sleep(0.05)
        log("drained; exiting")
        self.exit_now()

    async def exit_when_aborted(self) -> None:
        """Exit once the aborted requests have reached their handlers, so that each answers (a
        stream's last chunk says `abort`, then `[DONE]`) before uvicorn closes the connections;
        requests the engine thread has not ended within ABORT_GRACE (a long step) end here."""
        deadline = time.monotonic() + self.ABORT_GRACE
        while self.loop.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.loop.end_unfinished("abort", "server exiting")
        self.exit_now()

    def on_terminate(self, aloop: asyncio.AbstractEventLoop, signame: str) -> None:
        self.received += 1
        if self.received == 1:
            log(f"{signame}: draining (up to {self.config.drain_timeout:g} s), then exiting")
            self.loop.drain(self.config.drain_timeout, abort_after=True)
            self.tasks.append(aloop.create_task(self.exit_when_drained()))
        elif self.received == 2:
            log(f"{signame} again: aborting what is left and exiting")
            self.loop.abort_all("server exiting")
            self.tasks.append(aloop.create_task(self.exit_when_aborted()))
        else:
            log(f"{signame} a third time: exiting without waiting for anything")
            for s in self.servers:
                s.force_exit = True
            self.exit_now()

    def on_usr1(self) -> None:
        def write() -> None:
            try:
                log(f"SIGUSR1: snapshot written to {self.loop.snapshot(reason='sigusr1')}")
            except Exception as exc:
                log(f"SIGUSR1: snapshot failed: {exc}")

        threading.Thread(target=write, name="kvtop-snapshot", daemon=True).start()


def _warm_up(engine) -> tuple[int, int, float] | str:
    """The warm-up's figures, or why there are none: it only saves time, so a failure is one line
    in the summary and the server starts anyway (a request that fails the same way gets its error)."""
    try:
        return warm_up(engine) or "skipped (the engine already held sequences)"
    except Exception as exc:
        return f"failed, serving without it ({type(exc).__name__}: {exc})"


def warm_up_line(warmed: tuple[int, int, float] | str) -> str:
    if isinstance(warmed, str):
        return warmed
    tokens, rows, seconds = warmed
    return f"a prefill of {tokens} tokens ({rows} × {tokens // rows}) and a decode step of {rows} in {seconds:.1f} s"


async def _serve(
    engine, config: ServerConfig, tcp, uds, socket_path: Path, api_url: str, log_level: str,
    warmed: tuple[int, int, float] | str,
) -> int:  # fmt: skip
    from engine.server.api import PUBLIC_PATHS, build_api
    from engine.server.control import build_control
    from engine.server.loop import EngineLoop
    from engine.server.metrics import make_registry

    aloop = asyncio.get_running_loop()
    loop = EngineLoop(engine, config)
    loop.addresses = {"api": api_url, "metrics": f"{api_url}/metrics", "socket": str(socket_path)}
    stopping = asyncio.Event()
    per_ip = config.connections_per_ip(engine.config.max_num_seqs)
    api = build_api(loop, make_registry(loop))
    api_server = _Server(_uvicorn_config(api, log_level, config, per_ip, config.api_key, PUBLIC_PATHS))
    ctl_server = _Server(_uvicorn_config(build_control(loop, stopping), log_level, config))
    logging.getLogger("uvicorn.error").addFilter(_QuietRepeats())  # after the configs: they set up its logging
    loop.start(aloop)
    signals = _Signals(loop, config, (api_server, ctl_server), stopping)
    signals.install(aloop)
    print(startup_summary(engine, config, api_url, socket_path, warmed), flush=True)
    t0 = time.time()
    try:
        await asyncio.gather(api_server.serve(sockets=[tcp]), ctl_server.serve(sockets=[uds]))
    finally:
        stopping.set()
        loop.stop()
        signals.remove(aloop)
    log(f"served for {time.time() - t0:.0f} s; bye")
    return 0


if __name__ == "__main__":  # python -m engine.server.app: same as `kvctl serve` with defaults
    sys.exit(serve(EngineConfig(), ServerConfig()))
