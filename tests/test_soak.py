"""Soak: 1,000 requests against a real server whose KV budget forces preemptions, mixing streaming
and not; 10 % of clients vanish mid-stream, 5 % are aborted through the control socket. Every kept
request completes with its full token count, every other one ends with an explicit reason, and
afterwards the engine holds nothing and its resident memory has stayed bounded."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.server_harness import start_server

N = 1000
RSS_GROWTH_BOUND_MIB = 150  # after a 100-request warm-up; the recorder rings and histograms are capped


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server(tiny_dir):
    # 40 blocks of 16 tokens (the tiny model's 512 B/token): 32 concurrent requests need ~3x that
    s = start_server(tiny_dir, "--kv-cache-memory", str(40 * 16 * 512), "--max-num-seqs", "32",
                     "--max-queue", "2000")  # fmt: skip
    yield s
    s.cleanup()


async def one(client: httpx.AsyncClient, control: httpx.AsyncClient, model: str, kind: str, rng: random.Random) -> dict:
    # a request evicted or left after its first tokens runs long enough for the eviction or the
    # disconnect to land while it runs, even on a busy machine
    max_tokens = rng.randint(64, 96) if kind in ("evict", "vanish") else rng.randint(8, 24)
    words = " ".join(
        rng.choice(["cache", "block", "token", "memory", "page", "batch"]) for _ in range(rng.randint(20, 70))
    )
    body = {"model": model, "prompt": words, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if kind == "plain":
        r = await client.post("/v1/completions", json=body)
        obj = r.json()
        return {"kind": kind, "status": r.status_code, "want": max_tokens,
                "got": obj["usage"]["completion_tokens"], "reason": obj["choices"][0]["finish_reason"]}  # fmt: skip
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    got, reason, seen, evicted = 0, None, 0, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            obj = json.loads(line[5:])
            if obj.get("usage"):
                got = obj["usage"]["completion_tokens"]
            for c in obj.get("choices") or []:
                seen += 1
                reason = c.get("finish_reason") or reason
            if kind == "vanish" and seen >= 2:
                return {"kind": kind, "status": r.status_code}  # closing the stream: the client is gone
            if kind == "evict" and seen == 1:
                ev = await control.post("/v1/evict", json={"seq_id": f"{obj['id']}-0"})
                assert ev.status_code in (200, 404), ev.text  # 404: it finished first
                evicted = ev.status_code == 200
    return {"kind": kind, "status": r.status_code, "want": max_tokens, "got": got, "reason": reason,
            "evicted": evicted}  # fmt: skip


async def soak(url: str, socket: str, model: str) -> list[dict]:
    rng = random.Random(0)
    kinds = ["vanish"] * (N // 10) + ["evict"] * (N // 20)
    kinds += ["stream" if i % 2 else "plain" for i in range(N - len(kinds))]
    rng.shuffle(kinds)
    sem = asyncio.Semaphore(48)
    limits = httpx.Limits(max_connections=64)
    transport = httpx.AsyncHTTPTransport(uds=socket)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client, \
            httpx.AsyncClient(base_url="http://kvtop", transport=transport, timeout=30) as control:  # fmt: skip

        async def run(i: int, kind: str) -> dict:
            async with sem:
                return await one(client, control, model, kind, random.Random(i))

        return await asyncio.gather(*(run(i, k) for i, k in enumerate(kinds)))


@pytest.mark.slow
def test_soak_thousand_requests_with_vanishing_and_evicted_clients(server):
    asyncio.run(_warm(server.url, server.model))
    rss_start = rss_mib(server.proc.pid)
    results = asyncio.run(soak(server.url, str(server.socket), server.model))
    frame = server.wait_idle(timeout=60)
    rss_end = rss_mib(server.proc.pid)

    assert len(results) == N
    kept = [r for r in results if r["kind"] in ("plain", "stream")]
    assert all(r["status"] == 200 for r in results)
    for r in kept:  # every kept request completes with its full token count
        assert (r["got"], r["reason"]) == (r["want"], "length"), r
    evicted = [r for r in results if r["kind"] == "evict"]
    # explicit either way: aborted, or done first — the socket's 404, or (its 200 queues the abort for
    # the next step) in the step that was running when it came
    assert all(r["reason"] in ("abort", "length") for r in evicted)
    assert all((r["reason"], r["got"]) == ("length", r["want"]) for r in evicted if not r["evicted"])
    assert sum(r["reason"] == "abort" for r in evicted) >= len(evicted) // 2
    # afterwards: no used block, nothing running or waiting, and the cache really was under pressure
    assert frame["kv"]["used"] == 0
    assert frame["scheduler"]["running"] == 0 and frame["scheduler"]["waiting"] == 0
    assert frame["scheduler"]["preemptions_total"] > 0
    # the server accounts for every request: finished or aborted (a vanished client's request is
    # aborted unless it finished before the disconnect was seen), none failed or lost
    aborted = frame["counters"]["requests_aborted"]
    assert frame["counters"]["requests_finished"] + aborted == N + 100
    assert frame["counters"]["requests_failed"] == 0
    assert aborted >= sum(r["reason"] == "abort" for r in evicted) + N // 20
    assert rss_end - rss_start < RSS_GROWTH_BOUND_MIB, (rss_start, rss_end)
    print(f"soak: rss {rss_start:.0f} -> {rss_end:.0f} MiB, preemptions {frame['scheduler']['preemptions_total']}, "
          f"aborted {aborted}")  # fmt: skip


async def _warm(url: str, model: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        body = {"model": model, "prompt": "cache block token", "max_tokens": 8, "temperature": 0}
        await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(100)))
