"""A real `kvctl serve` subprocess for tests: start it, find it, talk to it, stop it.

The server binds port 0 (any free port) and reports its address on the control socket, so
tests never race for a fixed port. Sockets live in short /tmp dirs (the Unix path limit is
~107 bytes). Every server is stopped in teardown, SIGKILL if SIGTERM does not do it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

KVCTL = [sys.executable, "-m", "kvtop.ctl.cli"]
API_KEY = "test-key-123"


def kvctl(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*KVCTL, *args], capture_output=True, text=True, timeout=timeout, **kw)


def short_tmpdir(prefix: str = "kvt") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@dataclass
class Server:
    proc: subprocess.Popen
    tmp: Path
    socket: Path
    model: str
    api_key: str | None
    url: str = ""
    snapshot_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.snapshot_dir = self.tmp / "snaps"

    @property
    def log(self) -> str:
        return (self.tmp / "server.log").read_text(errors="replace")

    def openai(self, **kw):
        import openai

        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 60)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", **kw)

    def http(self, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 60), **kw)

    def control(self):
        from kvtop.client import EngineClient

        return EngineClient(self.socket)

    def stats(self) -> dict:
        with self.control() as c:
            return c.stats()

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> dict:
        """Poll stats frames until `predicate(frame)`; returns that frame."""
        deadline = time.monotonic() + timeout
        frame = {}
        while time.monotonic() < deadline:
            frame = self.stats()
            if predicate(frame):
                return frame
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; last frame engine={frame.get('engine')} "
                             f"scheduler={frame.get('scheduler')}")  # fmt: skip

    def wait_idle(self, timeout: float = 30.0) -> dict:
        return self.wait_for(
            lambda f: f["kv"]["used"] == 0 and not f["sequences"] and f["server"]["in_flight"] == 0,
            timeout,
            "no request in flight and no used block",
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def cleanup(self) -> None:
        self.stop(timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)


def start_server(model: str | Path, *args: str, api_key: str | None = None, env: dict | None = None,
                 timeout: float = 180.0, socket_path: Path | None = None, tmp: Path | None = None,
                 pass_socket: bool = True) -> Server:  # fmt: skip
    """Start `kvctl serve`; with `pass_socket=False` the server finds its socket path itself
    (KVTOP_SOCKET / XDG_RUNTIME_DIR in `env`) and `socket_path` says where that is."""
    tmp = tmp or short_tmpdir()
    sock = socket_path or tmp / "s" / "engine.sock"
    cmd = [*KVCTL, "serve", "--model", str(model), "--dtype", "float32", "--port", "0",
           *(["--socket", str(sock)] if pass_socket else []), "--snapshot-dir", str(tmp / "snaps"), *args]  # fmt: skip
    full_env = {**os.environ, **(env or {})}
    full_env.pop("KVTOP_API_KEY", None)
    if "KVTOP_SOCKET" not in (env or {}):
        full_env.pop("KVTOP_SOCKET", None)
    if api_key:
        full_env["KVTOP_API_KEY"] = api_key
    with open(tmp / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    server = Server(proc, tmp, sock, str(model), api_key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvctl serve exited with {proc.returncode}:\n{server.log}")
        if sock.exists():
            with contextlib.suppress(Exception), server.control() as c:
                server.url = c.healthz()["api"]
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    return server
        time.sleep(0.1)
    server.cleanup()
    raise RuntimeError(f"kvctl serve did not come up in {timeout:g} s:\n{server.log}")


@contextlib.contextmanager
def peer_process(name: str, cmd: list[str], url: str, log: Path, start_timeout: float, **popen) -> Iterator[str]:
    """A peer's server (vLLM, llama.cpp) started with `cmd`, its output in `log`: yields `url` once its
    /health answers 200, and stops it after (SIGTERM, then SIGKILL past 30 s). RuntimeError with the
    log's tail if it exits or does not come up within `start_timeout` seconds."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **popen)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start in {start_timeout:g} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stale_socket(path: Path) -> None:
    """Leave a socket file behind with nobody listening, as a killed engine does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
