"""`make demo` without a terminal: the first screen a new user sees must show the KV cache
bounding concurrency (blocks short, waiting, preemptions, prefix hits and evictions), in words;
and the demo's OpenAI client (kvtop/ctl/openai_client.py, bench's too) counting a streamed and a
whole answer alike, a refusal as one line with the server's reason."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import httpx
import pytest

from kvtop.ctl import demo
from tests.server_harness import start_server


@pytest.mark.slow  # serves SmolLM2-135M and drives ~30 requests at it
def test_demo_summary_shows_the_kv_cache_bounding_concurrency():
    proc = subprocess.run(
        [sys.executable, "-m", "kvtop.ctl.demo", "--no-dashboard", "--free", "4", "--max-tokens", "32"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "warning" not in out  # the demo's own configuration is coherent
    assert re.search(r"28 ok \(.*\), 0 failed", out), out
    assert re.search(r"peak 100 % of \d+ blocks \(\d+ tokens\): blocks ran short", out), out
    preemptions = int(re.search(r"preemptions\W+(\d+) \(a running request's blocks taken back", out).group(1))
    assert preemptions > 0
    waiting = int(re.search(r"and (\d+) waiting for a slot or blocks", out).group(1))
    assert waiting > 0
    hit = re.search(r"(\d+) % of prompt tokens hit .*?; (\d+) cached blocks evicted to make room", out)
    assert hit and int(hit.group(1)) > 0 and int(hit.group(2)) > 0, out
    assert "diagnosis (seen)" in out and "KV" in out.split("diagnosis (seen)")[1]
    assert "the KV cache, not compute, bounded concurrency" in out
    assert "server stopped (exit 0)" in proc.stderr


@pytest.fixture(scope="module")
def tiny_server(tiny_dir):
    s = start_server(tiny_dir, "--kv-cache-memory", "4MiB")
    yield s
    s.cleanup()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_streamed_and_a_whole_answer_are_counted_alike(tiny_server, kind):
    """The demo's summary adds streamed and whole answers together: the same greedy request must
    count the same tokens and finish reason either way, and only the stream has a first-token time."""
    prompt = {"messages": [{"role": "user", "content": "Say hello"}]} if kind == "chat" else {"prompt": "Say hello"}
    body = {"model": tiny_server.model, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **prompt}

    async def both() -> list[demo.Result]:
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=60) as http:
            return [await demo.run_job(http, demo.Job(kind, body, stream=s)) for s in (True, False)]

    streamed, whole = asyncio.run(both())
    assert streamed.error is None and whole.error is None, (streamed.error, whole.error)
    assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.finish_reason) == (
        whole.prompt_tokens, whole.completion_tokens, whole.finish_reason,
    ) == (whole.prompt_tokens, 12, "length")  # fmt: skip
    assert streamed.ttft is not None and 0 < streamed.ttft <= streamed.e2e
    assert whole.ttft is None and whole.e2e > 0


def test_a_refused_request_is_one_line_with_the_servers_reason(tiny_server):
    body = {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}

    async def refused() -> list[demo.Result]:
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=60) as http:
            return [await demo.run_job(http, demo.Job("completion", body, stream=s)) for s in (True, False)]

    for res in asyncio.run(refused()):
        assert res.error is not None and res.error.startswith("HTTP 404: ") and "no-such-model" in res.error
        assert "\n" not in res.error and res.completion_tokens == 0
