"""`make demo`: serve the default model, drive a mixed load at it through the OpenAI API, watch it
in the kvtop dashboard, and stop the server cleanly.

On a terminal the dashboard takes the screen while the load runs in rounds behind it; quit it with
`q` and the demo prints what the KV cache did. Without a terminal (or with `--no-dashboard`) a
progress bar replaces the dashboard and the load runs once.

The load: the chats of `kvtop/data/demo_prompts.jsonl` (they share a system prompt, so the
prefix cache has something to find) mixed with free-form completions; a third of them stream.
While it runs, a progress bar shows requests done and the engine's own view from the control
socket (running, waiting, KV usage). Run `python -m kvtop.demo --help` for the knobs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtop.client import EngineClient, EngineUnavailable

PROMPTS = Path(__file__).parent / "data" / "demo_prompts.jsonl"
FREE_PROMPTS = [
    "Write one sentence about the sea.",
    "List three uses of a paperclip:",
    "The recipe for a good cup of tea is",
    "In 1969, the first people to walk on the Moon",
    "A short poem about autumn leaves:",
    "Explain recursion to a child in one sentence.",
    "The difference between weather and climate is",
    "Three facts about octopuses:",
]
console = Console(stderr=True)


@dataclass
class Result:
    kind: str
    streamed: bool
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    error: str | None = None


@dataclass
class Job:
    kind: str  # chat | completion
    body: dict
    stream: bool = False
    results: list[Result] = field(default_factory=list)


def build_load(model: str, free: int, max_tokens: int, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for line in PROMPTS.read_text().splitlines():
        obj = json.loads(line)
        body = {
            "model": model,
            "messages": obj["messages"],
            "max_tokens": min(obj.get("max_tokens", max_tokens), max_tokens),
        }
        jobs.append(Job("chat", body))
    for i in range(free):
        prompt = FREE_PROMPTS[i % len(FREE_PROMPTS)]
        jobs.append(
            Job(
                "completion",
                {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7, "seed": i},
            )
        )
    rng.shuffle(jobs)
    for i, job in enumerate(jobs):
        job.stream = i % 3 == 0
        job.body["temperature"] = job.body.get("temperature", 0.0)
    return jobs


async def run_job(http: httpx.AsyncClient, job: Job) -> Result:
    path = "/v1/chat/completions" if job.kind == "chat" else "/v1/completions"
    res = Result(job.kind, job.stream)
    t0 = time.perf_counter()
    try:
        if not job.stream:
            r = await http.post(path, json=job.body)
            r.raise_for_status()
            body = r.json()
            usage, res.finish_reason = body["usage"], body["choices"][0]["finish_reason"]
        else:
            usage = None
            body = {**job.body, "stream": True, "stream_options": {"include_usage": True}}
            async with http.stream("POST", path, json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text and res.ttft is None:
                            res.ttft = time.perf_counter() - t0
                        res.finish_reason = choice.get("finish_reason") or res.finish_reason
        res.prompt_tokens = usage["prompt_tokens"]
        res.completion_tokens = usage["completion_tokens"]
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except (httpx.HTTPError, KeyError, TypeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.e2e = time.perf_counter() - t0
    return res


async def drive(url: str, socket: Path, jobs: list[Job], concurrency: int) -> tuple[list[Result], float, dict]:
    limit = asyncio.Semaphore(concurrency)
    results: list[Result] = []
    peak = {"kv_usage": 0.0, "running": 0, "waiting": 0}
    with Progress(
        TextColumn("[bold]load"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tokens]} tokens · engine: {task.fields[engine]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("load", total=len(jobs), tokens=0, engine="")

        async def one(http: httpx.AsyncClient, job: Job) -> None:
            async with limit:
                res = await run_job(http, job)
            results.append(res)
            progress.update(task, advance=1, tokens=sum(r.completion_tokens for r in results))

        async def watch() -> None:
            with EngineClient(socket) as c:
                while True:
                    with contextlib.suppress(EngineUnavailable):
                        f = await asyncio.to_thread(c.stats)
                        s, kv = f["scheduler"], f["kv"]
                        peak["kv_usage"] = max(peak["kv_usage"], kv["usage"])
                        peak["running"] = max(peak["running"], s["running"])
                        peak["waiting"] = max(peak["waiting"], s["waiting"])
                        progress.update(task, engine=f"{s['running']} running, {s['waiting']} waiting, "
                                                     f"KV {kv['usage'] * 100:.0f} % used, {kv['cached']} blocks cached")  # fmt: skip
                    await asyncio.sleep(0.5)

        t0 = time.perf_counter()
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10)) as http:
            watcher = asyncio.create_task(watch())
            try:
                await asyncio.gather(*(one(http, job) for job in jobs))
            finally:
                watcher.cancel()
        elapsed = time.perf_counter() - t0
    return results, elapsed, peak


def with_dashboard(url: str, socket: Path, jobs: list[Job], concurrency: int) -> tuple[list[Result], float, dict]:
    """Run the load in rounds in a thread while kvtop owns the terminal; stop when it quits."""
    import threading

    stop = threading.Event()
    results: list[Result] = []
    peak = {"kv_usage": 0.0, "running": 0, "waiting": 0}

    async def rounds() -> None:
        limit = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10)) as http:

            async def one(job: Job) -> None:
                async with limit:
                    if not stop.is_set():
                        results.append(await run_job(http, job))

            async def watch() -> None:
                with EngineClient(socket) as c:
                    while not stop.is_set():
                        with contextlib.suppress(EngineUnavailable):
                            f = await asyncio.to_thread(c.stats)
                            peak["running"] = max(peak["running"], f["scheduler"]["running"])
                            peak["waiting"] = max(peak["waiting"], f["scheduler"]["waiting"])
                        await asyncio.sleep(0.5)

            watcher = asyncio.create_task(watch())
            while not stop.is_set():
                await asyncio.gather(*(one(job) for job in jobs))
            watcher.cancel()

    t0 = time.perf_counter()
    loader = threading.Thread(target=lambda: asyncio.run(rounds()), name="demo-load", daemon=True)
    loader.start()
    try:
        subprocess.run([sys.executable, "-m", "kvtop.app", "--socket", str(socket)], check=False)
    finally:
        stop.set()
        console.print("dashboard closed; letting the requests in flight finish…")
        loader.join(timeout=120)
    with contextlib.suppress(EngineUnavailable), EngineClient(socket) as c:
        f = c.stats()
        peak["kv_usage"] = f["kv"]["peak_usage"]
    return results, time.perf_counter() - t0, peak


def _pct(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1000:.0f}" if values else "-"


def summary(results: list[Result], elapsed: float, peak: dict, frame: dict) -> Table:
    ok = [r for r in results if r.error is None]
    reasons: dict[str, int] = {}
    for r in ok:
        reasons[r.finish_reason or "?"] = reasons.get(r.finish_reason or "?", 0) + 1
    gen = sum(r.completion_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    e2es = [r.e2e for r in ok]
    t = Table(title="kvtop demo", show_header=False)
    t.add_row("requests", f"{len(ok)} ok ({', '.join(f'{k}: {v}' for k, v in sorted(reasons.items()))}), "
                          f"{len(results) - len(ok)} failed; {sum(r.streamed for r in ok)} streamed")  # fmt: skip
    t.add_row("tokens", f"{prompt} prompt ({cached} served from the prefix cache), {gen} generated in {elapsed:.1f} s")
    t.add_row("throughput", f"{gen / elapsed:.1f} generated tokens/s")
    t.add_row("TTFT ms P50/P95 (streams)", f"{_pct(ttfts, 50)} / {_pct(ttfts, 95)}")
    t.add_row("latency ms P50/P95", f"{_pct(e2es, 50)} / {_pct(e2es, 95)}")
    p = frame["prefix"]
    t.add_row(
        "prefix cache",
        f"{p['hit_rate'] * 100:.1f} % of prompt tokens hit, ≈{p['saved_prefill_s']:.2f} s of prefill saved",
    )
    t.add_row("KV cache", f"peak {max(peak['kv_usage'], frame['kv']['peak_usage']) * 100:.1f} % of "
                          f"{frame['kv']['num_blocks']} blocks; {frame['scheduler']['preemptions_total']} preemptions")  # fmt: skip
    t.add_row("concurrency", f"up to {peak['running']} running, {peak['waiting']} waiting")
    errors = [r.error for r in results if r.error]
    if errors:
        t.add_row("first error", errors[0])
    return t


def start_server(model: str, tmp: Path, serve_args: list[str]) -> tuple[subprocess.Popen, Path, Path]:
    socket, log = tmp / "engine.sock", tmp / "server.log"
    cmd = [sys.executable, "-m", "kvtop.cli", "serve", "--model", model, "--port", "0", "--socket", str(socket),
           "--snapshot-dir", str(tmp / "snapshots"), *serve_args]  # fmt: skip
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, socket, log


def wait_ready(proc: subprocess.Popen, socket: Path, log: Path, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    with console.status("[bold]starting kvctl serve (loading the model)…"):
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"kvctl serve exited with {proc.returncode}:\n{log.read_text()}")
            if socket.exists():
                with contextlib.suppress(EngineUnavailable), EngineClient(socket) as c:
                    return c.healthz()["api"]
            time.sleep(0.2)
    raise SystemExit(f"kvctl serve did not start in {timeout:.0f} s:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen, socket: Path) -> int:
    """Drain through the control socket, then SIGTERM: the way an operator stops it."""
    with contextlib.suppress(EngineUnavailable), EngineClient(socket) as c:
        c.drain(timeout_s=30, abort_after=True)
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtop.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--free", type=int, default=16, help="free-form completions besides the shared-prefix chats")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=None,
                    help="open kvtop on the live engine (default: when stdout is a terminal)")  # fmt: skip
    ap.add_argument("serve_args", nargs="*", help="more `kvctl serve` flags, after --")
    args = ap.parse_args(argv)
    dashboard = sys.stdout.isatty() and sys.stdin.isatty() if args.dashboard is None else args.dashboard
    tmp = Path(tempfile.mkdtemp(prefix="kvdemo", dir="/tmp"))
    proc, socket, log = start_server(args.model, tmp, args.serve_args)
    try:
        url = wait_ready(proc, socket, log)
        print(log.read_text().strip(), flush=True)
        print(flush=True)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        jobs = build_load(model, args.free, args.max_tokens)
        if dashboard:
            results, elapsed, peak = with_dashboard(url, socket, jobs, args.concurrency)
        else:
            results, elapsed, peak = asyncio.run(drive(url, socket, jobs, args.concurrency))
        with EngineClient(socket) as c:
            frame = c.stats()
        Console().print(summary(results, elapsed, peak, frame))
        failed = sum(r.error is not None for r in results)
    except KeyboardInterrupt:
        failed = 1
    finally:
        code = stop_server(proc, socket) if proc.poll() is None else proc.returncode
        console.print(f"server stopped (exit {code})" + ("" if code == 0 else f"; log: {log}"))
        if code == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed or code else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
