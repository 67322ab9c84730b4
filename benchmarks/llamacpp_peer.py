"""llama.cpp's own server as a benchmark peer (benchmarks/peers.py, benchmarks/quant.py).

`make llamacpp` builds `llama-server` from source (tests/llamacpp_server.py finds it and starts it);
it runs the GGUF file as it is, 2 threads, one slot per prompt (continuous batching). Every prompt is
sent at once to /completion as token ids, greedy, ignore_eos, no prompt cache, and the answers'
token ids come back.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.llamacpp_server import MISSING, llama_server, llama_server_running

__all__ = ["MISSING", "complete_all", "llama_server", "serving"]


@contextlib.contextmanager
def serving(gguf: Path, slots: int, tokens: int) -> Iterator[str]:
    """llama-server on `gguf` with `slots` slots of `tokens` tokens of context each (the longest prompt
    and its answer): yields its URL."""
    with llama_server_running(gguf, slots, slots * (tokens + 8)) as url:
        yield url


def complete_all(url: str, prompts: list[list[int]], out_lens: list[int]) -> list[list[int]]:
    """Every prompt at once (a connection each); the generated token ids of each, in order."""
    with (
        httpx.Client(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=len(prompts))) as client,
        ThreadPoolExecutor(len(prompts)) as pool,
    ):

        def complete(ids: list[int], tokens: int) -> list[int]:
            body = {"prompt": ids, "n_predict": tokens, "temperature": 0.0, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True}  # fmt: skip
            answer = client.post("/completion", json=body)
            answer.raise_for_status()
            return answer.json()["tokens"]

        return list(pool.map(complete, prompts, out_lens))
