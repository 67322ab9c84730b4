"""The light install (issue #38): this checkout built into a wheel, the wheel installed into a fresh
venv with `pip install` (its dependencies from the package index pip is configured with), and
that venv used as an operator on a bastion host would use it.

What it must show: no torch (nor transformers, FastAPI, uvicorn, numpy) installed, under 60 MB added
to the venv; its `kvctl replay` opens a snapshot in a terminal; its `kvctl status` and `kvtop --url`
read a live `kvctl serve` started from the full venv (and `kvctl status` over the control socket
too: the typed frame on the wire); its `kvctl serve` says in one line what to install, exit 1.
The size and the install's time are printed (`pytest -s`), and documented in README.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server_harness import start_server
from tests.test_kvtop_terminal import Terminal

pytestmark = pytest.mark.integration  # builds a wheel and a venv (about a minute on two busy cores)

ROOT = Path(__file__).resolve().parent.parent
STORM = ROOT / "snapshots" / "preemption-storm.kvsnap"
MAX_INSTALL_BYTES = 60 * 1024**2
ENGINE_ONLY = ("torch", "transformers", "fastapi", "uvicorn", "triton", "numpy", "safetensors", "accelerate")
SKIP_COPY = shutil.ignore_patterns(".venv*", ".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache",
                                   ".ruff_cache", ".hypothesis", ".schemathesis")  # fmt: skip


@dataclass
class LightVenv:
    bin: Path
    added_bytes: int
    install_s: float
    packages: dict[str, str]

    def env(self) -> dict[str, str]:
        """This venv first on PATH, and nothing of the checkout's on the import path."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KVTOP_SOCKET")}
        return {**env, "PATH": f"{self.bin}{os.pathsep}{env.get('PATH', '')}", "TERM": "xterm"}

    def run(self, *argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin / argv[0]), *argv[1:]], capture_output=True, text=True, env=self.env(),
                              cwd=cwd, timeout=timeout)  # fmt: skip


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _pip(python: Path, *args: str, cwd: Path) -> None:
    subprocess.run([str(python), "-m", "pip", *args], check=True, cwd=cwd, timeout=900, capture_output=True,
                   text=True)  # fmt: skip


@pytest.fixture(scope="module")
def light(tmp_path_factory) -> LightVenv:
    """This checkout as a clean copy, its wheel, a fresh venv with the wheel installed."""
    tmp = tmp_path_factory.mktemp("light")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP_COPY)
    # --no-build-isolation: the build backend (setuptools) from this venv, not fetched again
    _pip(Path(sys.executable), "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(src),
         cwd=tmp)  # fmt: skip
    wheel = next((tmp / "dist").glob("kvtop-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    before = _tree_bytes(venv)
    t0 = time.monotonic()
    _pip(venv / "bin" / "python", "install", "-q", "--disable-pip-version-check", str(wheel), cwd=tmp)
    install_s = time.monotonic() - t0
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                            capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    packages = {p["name"].lower(): p["version"] for p in json.loads(listed.stdout)}
    result = LightVenv(venv / "bin", _tree_bytes(venv) - before, install_s, packages)
    print(f"\nlight install: {wheel.name} ({wheel.stat().st_size / 1024:.0f} KiB), "
          f"{result.added_bytes / 1024**2:.1f} MiB added to the venv in {install_s:.1f} s, "
          f"{len(packages)} packages")  # fmt: skip
    return result


def test_the_wheel_installs_no_torch_in_under_60_mb(light):
    assert "kvtop" in light.packages and "textual" in light.packages and "httpx" in light.packages
    assert [name for name in ENGINE_ONLY if name in light.packages] == []
    assert light.added_bytes < MAX_INSTALL_BYTES, f"the light install takes {light.added_bytes / 1024**2:.1f} MiB"
    where = light.run("python", "-c", "import kvtop.protocol, sys; print(kvtop.protocol.__file__)", cwd=light.bin)
    assert where.returncode == 0 and where.stdout.startswith(str(light.bin.parent)), where  # the venv's, not ours
    no_torch = light.run("python", "-c", "import torch", cwd=light.bin)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr


def test_its_kvctl_serve_says_what_to_install(light, tmp_path):
    done = light.run("kvctl", "serve", "--port", "0", "--socket", str(tmp_path / "s.sock"), cwd=tmp_path)
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert 'pip install "kvtop[engine]"' in lines[0] and "kvctl serve" in lines[0]


def test_its_kvctl_plan_answers_without_the_engine(light, tmp_path):
    done = light.run("kvctl", "plan", "llama3-8b", "--memory", "80GiB", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "131,072" in done.stdout  # Llama-3-8B's bf16 KV: 32 layers × 2 × 8 heads × 128 × 2 bytes per token


def test_its_kvctl_replay_opens_a_snapshot(light, tmp_path):
    term = Terminal(["replay", str(STORM)], light.env(), size=(120, 40), program=[str(light.bin / "kvctl")])
    term.read_until("Block map")
    term.read_until("KV cache")
    term.press("q")
    status = term.hang_up(timeout=60)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"exit status {status}"


def test_its_status_and_kvtop_read_a_live_engine_served_from_the_full_venv(light, tiny_dir, tmp_path):
    server = start_server(tiny_dir, "--kv-cache-memory", "512KiB", "--max-num-seqs", "8")
    try:
        with server.http() as http:  # a request, so there are tokens and latency to read
            r = http.post("/v1/completions", json={"model": str(tiny_dir), "prompt": "hello there", "max_tokens": 8})
            assert r.status_code == 200
        blocks = server.stats()["kv"]["num_blocks"]
        by_socket = light.run("kvctl", "status", "--json", "--socket", str(server.socket), cwd=tmp_path)
        assert by_socket.returncode == 0, by_socket.stderr
        frame = json.loads(by_socket.stdout)
        assert frame["kv"]["num_blocks"] == blocks and frame["engine"]["model"] == server.model
        by_url = light.run("kvctl", "status", "--json", "--url", f"{server.url}/metrics", cwd=tmp_path)
        assert by_url.returncode == 0, by_url.stderr
        partial = json.loads(by_url.stdout)
        assert partial["source"]["kind"] == "metrics" and partial["kv"]["num_blocks"] == blocks
        assert partial["prefix"]["query_tokens"] >= 2  # the request's prompt was looked up
        term = Terminal(["--url", f"{server.url}/metrics"], light.env(), size=(160, 48),
                        program=[str(light.bin / "kvtop")])  # fmt: skip
        term.read_until("KV cache")
        term.read_until("total")  # the block counts, read off /metrics
        term.press("q")
        status = term.hang_up(timeout=60)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"exit status {status}"
    finally:
        server.cleanup()
