"""A real vLLM (the CPU build `make vllm` installs) serving SmolLM2-135M, for tests and recordings.

`make vllm` puts vLLM in its own venv under kvtop's cache (`$KVTOP_CACHE/venv-vllm`, default
`~/.cache/kvtop/venv-vllm`), so that a later run on the same machine reuses it; `KVTOP_VLLM_VENV`
names another one, and a checkout's `.venv-vllm` (where `make vllm` used to put it) is still found.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtop.protocol.paths import cache_dir
from tests.server_harness import peer_process

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 600  # about a minute alone on 2 cores; much more beside other work


def vllm_venv() -> Path | None:
    """The installed vLLM venv (its `.installed` stamp written by `make vllm`), or None."""
    candidates = [os.environ.get("KVTOP_VLLM_VENV"), cache_dir() / "venv-vllm", ROOT / ".venv-vllm"]
    for venv in candidates:
        if venv and (Path(venv) / ".installed").exists():
            return Path(venv)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path, *args: str, kv_space_gib: int = 1) -> Iterator[str]:
    """`python -m vllm.entrypoints.openai.api_server --enforce-eager` on `model_dir` (served as
    smollm2-135m) on a free port; yields its base URL once /health answers, stops it after.
    RuntimeError with the log's tail if it exits or does not come up."""
    venv = vllm_venv()
    if venv is None:
        raise RuntimeError("vLLM is not installed: run `make vllm`")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "VLLM_TARGET_DEVICE": "cpu"}
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "smollm2-135m", "--enforce-eager", "--max-model-len", "2048",
           "--host", "127.0.0.1", "--port", str(port), *args]  # fmt: skip
    with peer_process("vLLM", cmd, f"http://127.0.0.1:{port}", log, START_TIMEOUT_S, env=env, cwd=log.parent) as url:
        yield url


def samples(url: str) -> dict[str, float]:
    """vLLM's own /metrics, each sample name summed over its label sets (its truth, read without kvtop)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class Load:
    """`clients` threads sending completions (a ~200-token prompt, 64 tokens out, ignore_eos) until
    closed: three 128-token blocks a request by its end."""

    def __init__(self, url: str, clients: int = 4) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            self.client.completions.create(model="smollm2-135m", prompt=f"Tell me a long story, number {i}. " * 20,
                                           max_tokens=64, extra_body={"ignore_eos": True})  # fmt: skip

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)


class CounterLog:
    """A vLLM counter read straight from its /metrics every `every` seconds, in a thread: the
    truth a rate kvtop shows is checked against. `at(t)` is its value at time t (the last reading
    then), `still(t0, t1)` whether it held still from t0 to t1."""

    def __init__(self, url: str, name: str, every: float = 0.25) -> None:
        self.url, self.name, self.every = url, name, every
        self.readings: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            with contextlib.suppress(httpx.HTTPError):
                value = samples(self.url).get(self.name)
                if value is not None:
                    self.readings.append((time.time(), value))

    def at(self, t: float) -> float | None:
        before = [v for ts, v in self.readings if ts <= t]
        return before[-1] if before else None

    def still(self, t0: float, t1: float) -> bool:
        """Read at least once before t0 and after t1, and the same value all along."""
        inside = [v for ts, v in self.readings if t0 <= ts <= t1]
        start, end = self.at(t0), [v for ts, v in self.readings if ts > t1][:1]
        return start is not None and bool(end) and all(v == start for v in (*inside, *end))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def require_vllm() -> None:
    """Skip where vLLM's CPU build is not installed; fail in CI (CI=true), whose .ci/run installs it."""
    if vllm_venv() is None:
        why = "vLLM is not installed: run `make vllm` (it goes to $KVTOP_CACHE/venv-vllm)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; in CI (CI=true) these tests must run: .ci/run installs it")
        pytest.skip(why)
