"""`kvctl serve`: one engine, two uvicorn servers (TCP for the OpenAI API and /metrics, a Unix
socket for stats and control) in one event loop, and the signals an operator sends.

- SIGTERM / SIGINT: drain — stop admitting, let requests in flight finish for up to
  `drain_timeout` seconds, abort what is left — then exit 0. A second one exits at once.
- SIGUSR1: write a snapshot into `snapshot_dir`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.config import EngineConfig, context_limit_warning, format_bytes
from engine.log import log
from engine.model.packed_linear import prefill_copy_note
from engine.openmp import release_thread_pool
from engine.server.config import ServerConfig
from engine.server.sockets import bind_tcp, bind_unix, check_socket, resolve_socket
from engine.warmup import warm_up


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: this process handles signals once for both."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


_TIMEOUT_BODY = json.dumps(
    {"error": {"message": "the request did not arrive in time", "type": "invalid_request_error", "param": None,
               "code": "request_timeout"}}
).encode()  # fmt: skip
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    + f"content-length: {len(_TIMEOUT_BODY)}\r\n\r\n".encode()
    + _TIMEOUT_BODY
)


class _TimedH11(H11Protocol):
    """uvicorn's h11 protocol with the read timeouts it lacks: a request's headers must be whole
    within `read_timeout` seconds of their first byte (or of the connection), and its body may
    not go silent for longer (the app answers 408 first; this closes what it does not read).
    Without them, a client that sends half a request holds its connection forever."""

    read_timeout = 5.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _no_delay(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(progress=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _watch(self, progress: bool = False) -> None:
        state = self.conn.their_state
        if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
            self._cancel_read_timer()
        elif state is h11.SEND_BODY and progress:  # a body resets the clock with every chunk
            self._cancel_read_timer()
            self._read_timer = self.loop.call_later(self.read_timeout + 1.0, self._stalled)
        elif self._read_timer is None:  # headers: one deadline from the first byte
            self._read_timer = self.loop.call_later(self.read_timeout, self._stalled)

    def _stalled(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def _no_delay(transport) -> None:
    """Send each write at once (TCP_NODELAY). asyncio sets it only on sockets created with
    IPPROTO_TCP, and `socket.create_server` (bind_tcp) leaves the protocol 0: without this, Nagle
    held a response's second segment until the client's delayed ACK, +40 ms on every request of
    a kept-alive connection and on a stream's first chunk."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _uvicorn_config(app, log_level: str, config: ServerConfig | None = None) -> uvicorn.Config:
    config = config or ServerConfig()
    protocol = type("TimedH11", (_TimedH11,), {"read_timeout": config.read_timeout})
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
        ws="none",
        http=protocol,
        timeout_keep_alive=5,  # an idle keep-alive connection is closed after this many seconds
        limit_concurrency=config.max_connections,  # beyond it, new requests get 503
        h11_max_incomplete_event_size=16 * 1024,  # an unfinished request head bigger than this is a 400
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


class _Signals:
    """The signals an operator sends while serving: the first SIGTERM or SIGINT drains and exits
    when drained, a second aborts what is left and exits now; SIGUSR1 writes a snapshot."""

    HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, loop, config: ServerConfig, servers: tuple, stopping: asyncio.Event) -> None:
        self.loop = loop
        self.config = config
        self.servers = servers
        self.stopping = stopping
        self.terminating = False
        self.tasks: list[asyncio.Task] = []  # held, so that the drain watcher is not collected

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

    def on_terminate(self, aloop: asyncio.AbstractEventLoop, signame: str) -> None:
        engine = self.loop.engine
        if self.terminating:
            log(f"{signame} again: aborting what is left and exiting now")
            for request_id in list(engine.seqs):
                engine.abort(request_id, "server exiting")
            for s in self.servers:
                s.force_exit = True
            self.exit_now()
            return
        self.terminating = True
        log(f"{signame}: draining (up to {self.config.drain_timeout:g} s), then exiting")
        self.loop.drain(self.config.drain_timeout, abort_after=True)
        self.tasks.append(aloop.create_task(self.exit_when_drained()))

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
    from engine.server.api import build_api
    from engine.server.control import build_control
    from engine.server.loop import EngineLoop
    from engine.server.metrics import make_registry

    aloop = asyncio.get_running_loop()
    loop = EngineLoop(engine, config)
    loop.addresses = {"api": api_url, "metrics": f"{api_url}/metrics", "socket": str(socket_path)}
    stopping = asyncio.Event()
    api_server = _Server(_uvicorn_config(build_api(loop, make_registry(loop)), log_level, config))
    ctl_server = _Server(_uvicorn_config(build_control(loop, stopping), log_level, config))
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
