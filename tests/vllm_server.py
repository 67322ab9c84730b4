"""A real vLLM (the CPU build `make vllm` installs) serving SmolLM2-135M, for tests and recordings.

`make vllm` puts vLLM in its own venv under kvtop's cache (`$KVTOP_CACHE/venv-vllm`, default
`~/.cache/kvtop/venv-vllm`), so that a later run on the same machine reuses it; `KVTOP_VLLM_VENV`
names another one, and a checkout's `.venv-vllm` (where `make vllm` used to put it) is still found.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from kvtop.protocol.paths import cache_dir

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
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(2)
    raise RuntimeError(f"vLLM did not start in {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
