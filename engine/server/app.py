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
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import uvicorn

from engine.drain import EngineState
from engine.model.packed_linear import weights_note
from engine.runtime.devices import kv_budget_note
from engine.runtime.log import log
from engine.runtime.openmp import release_thread_pool
from engine.runtime.warmup import warm_up
from engine.server.connections import QuietRepeats, raise_open_files_limit, uvicorn_config
from engine.server.sockets import bind_tcp, bind_unix, check_socket
from kvtop.protocol.config import EngineConfig, ServerConfig, format_bytes
from kvtop.protocol.sockets import resolve_socket


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: this process handles signals once for both."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def context_limit_warning(max_model_len: int, kv_tokens: int) -> str | None:
    """One line for an operator when the KV cache cannot hold a single sequence of `max_model_len`
    tokens: then the real limit is the cache, and a long request would only fail later."""
    if kv_tokens >= max_model_len:
        return None
    return (
        f"max_model_len {max_model_len} but the KV cache holds {kv_tokens} tokens: requests are limited to "
        f"{kv_tokens} tokens (prompt + output; /v1/models says so) — raise --kv-cache-memory or lower --max-model-len"
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
        f"= {cap} tokens in {format_bytes(kv.total_bytes)}{kv_budget_note(engine.config, engine.device, engine.kv_budget)}; "
        f"max_model_len {engine.max_model_len}, "
        f"max_num_seqs {engine.config.max_num_seqs}, queue {config.max_queue}",
        *([f"  warning   {w}"] if (w := context_limit_warning(engine.max_model_len, cap)) else []),
        f"  weights   {weights_note(engine.weights_format, engine.weights_bytes, engine.prefill_copy_bytes)}",
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
    raise_open_files_limit(2 * config.max_connections + 1024)
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
        while self.loop.engine.state is not EngineState.DRAINED or self.loop.inflight:
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
    from engine.server.exposition import make_registry
    from engine.server.loop import EngineLoop

    aloop = asyncio.get_running_loop()
    loop = EngineLoop(engine, config)
    loop.addresses = {"api": api_url, "metrics": f"{api_url}/metrics", "socket": str(socket_path)}
    stopping = asyncio.Event()
    per_ip = config.connections_per_ip(engine.config.max_num_seqs)
    api = build_api(loop, make_registry(loop))
    api_server = _Server(uvicorn_config(api, log_level, config, per_ip, config.api_key, PUBLIC_PATHS))
    ctl_server = _Server(uvicorn_config(build_control(loop, stopping), log_level, config))
    logging.getLogger("uvicorn.error").addFilter(QuietRepeats())  # after the configs: they set up its logging
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
