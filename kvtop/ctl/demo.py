"""`make demo`: serve the default model, drive a mixed load at it through the OpenAI API, watch it
in the kvtop dashboard, and stop the server cleanly.

On a terminal the dashboard takes the screen while the load runs in rounds behind it; quit it with
`q` and the demo prints what the KV cache did. Without a terminal (or with `--no-dashboard`) a
progress bar replaces the dashboard and the load runs once.

The point is what bounds concurrency: the KV cache. So the cache is sized small on purpose
(`DEMO_SERVE_ARGS`: 24 MiB, about 34 blocks of SmolLM2 in float32) against 12 clients: within the
first minute blocks run short, requests wait, running ones are preempted and recomputed, the
shared system prompt hits the prefix cache and finished requests' cached blocks are evicted. The
summary says so in plain words, with the diagnosis (kvtop.diagnosis) seen while it ran.

The load: the chats of `kvtop/ctl/data/demo_prompts.jsonl` (they share a system prompt, so the
prefix cache has something to find) mixed with free-form completions; a third of them stream.
While it runs, a progress bar shows requests done and the engine's own view from the control
socket (running, waiting, KV usage). Run `python -m kvtop.ctl.demo --help` for the knobs.
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtop.client import EngineClient, EngineUnavailable
from kvtop.ctl.openai_client import complete, stream
from kvtop.protocol.stats_math import percentile

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
# a KV cache that bounds concurrency (the product's point); `-- --kv-cache-memory 256MiB` to compare
DEMO_SERVE_ARGS = ["--kv-cache-memory", "24MiB", "--max-num-seqs", "16", "--max-model-len", "512"]
HISTORY_S = 6.0  # frames kept for the diagnosis's rates


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


@dataclass
class Watch:
    """What the engine did while the load ran, from its stats frames: peaks and diagnoses."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    findings: dict[str, tuple[str, int]] = field(default_factory=dict)  # kind -> (latest line, polls seen)
    history: deque = field(default_factory=lambda: deque(maxlen=64))

    def see(self, f: dict) -> None:
        from kvtop.diagnosis import diagnose

        s, kv = f["scheduler"], f["kv"]
        self.running, self.waiting = max(self.running, s["running"]), max(self.waiting, s["waiting"])
        self.kv_usage = max(self.kv_usage, kv["usage"], kv.get("peak_usage", 0.0))
        while self.history and self.history[0]["ts"] < f["ts"] - HISTORY_S:
            self.history.popleft()
        for line in diagnose(f, list(self.history)):
            kind = line.split(":", 1)[1].split("—")[0].strip() if ":" in line else line
            self.findings[kind] = (line, self.findings.get(kind, ("", 0))[1] + 1)
        self.history.append(f)

    async def follow(self, socket: Path, stop: Callable[[], bool], on_frame=None) -> None:
        with EngineClient(socket) as c:
            while not stop():
                with contextlib.suppress(EngineUnavailable):
                    f = await asyncio.to_thread(c.stats)
                    self.see(f)
                    if on_frame:
                        on_frame(f)
                await asyncio.sleep(0.25)


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
    answer = await (stream if job.stream else complete)(http, path, job.body)
    res = Result(job.kind, job.stream, answer.finish_reason, ttft=answer.ttft, e2e=answer.e2e or 0.0)
    res.error = answer.error
    if answer.error is None and not answer.usage:
        res.error = "the answer carried no usage"
    elif answer.usage:
        res.prompt_tokens = answer.usage["prompt_tokens"]
        res.completion_tokens = answer.usage["completion_tokens"]
        res.cached_tokens = (answer.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return res


async def drive(url: str, socket: Path, jobs: list[Job], concurrency: int) -> tuple[list[Result], float, Watch]:
    limit = asyncio.Semaphore(concurrency)
    results: list[Result] = []
    watch = Watch()
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

        def show(f: dict) -> None:
            s, kv = f["scheduler"], f["kv"]
            progress.update(task, engine=f"{s['running']} running, {s['waiting']} waiting, KV {kv['usage'] * 100:.0f} %"
                                         f" held, {s['preemptions_total']} preempted")  # fmt: skip

        t0 = time.perf_counter()
        done = False
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10)) as http:
            watcher = asyncio.create_task(watch.follow(socket, lambda: done, show))
            try:
                await asyncio.gather(*(one(http, job) for job in jobs))
            finally:
                done = True
                await watcher
        elapsed = time.perf_counter() - t0
    return results, elapsed, watch


def with_dashboard(url: str, socket: Path, jobs: list[Job], concurrency: int) -> tuple[list[Result], float, Watch]:
    """Run the load in rounds in a thread while kvtop owns the terminal; stop when it quits."""
    import threading

    stop = threading.Event()
    results: list[Result] = []
    watch = Watch()

    async def rounds() -> None:
        limit = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10)) as http:

            async def one(job: Job) -> None:
                async with limit:
                    if not stop.is_set():
                        results.append(await run_job(http, job))

            watcher = asyncio.create_task(watch.follow(socket, stop.is_set))
            while not stop.is_set():
                await asyncio.gather(*(one(job) for job in jobs))
            await watcher

    t0 = time.perf_counter()
    loader = threading.Thread(target=lambda: asyncio.run(rounds()), name="demo-load", daemon=True)
    loader.start()
    try:
        subprocess.run([sys.executable, "-m", "kvtop.dashboard.cli", "--socket", str(socket)], check=False)
    finally:
        stop.set()
        console.print("dashboard closed; letting the requests in flight finish…")
        loader.join(timeout=120)
    return results, time.perf_counter() - t0, watch


def _pct(values: list[float], q: int) -> str:
    return f"{percentile(values, q) * 1000:.0f}" if values else "-"


def summary(results: list[Result], elapsed: float, watch: Watch, frame: dict) -> Table:
    """The run in plain words: what the requests got, and what the KV cache did to them."""
    ok = [r for r in results if r.error is None]
    reasons: dict[str, int] = {}
    for r in ok:
        reasons[r.finish_reason or "?"] = reasons.get(r.finish_reason or "?", 0) + 1
    gen, prompt = sum(r.completion_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    ttfts, e2es = [r.ttft for r in ok if r.ttft is not None], [r.e2e for r in ok]
    kv, sched, p = frame["kv"], frame["scheduler"], frame["prefix"]
    peak = max(watch.kv_usage, kv["peak_usage"])
    preempted = sched["preemptions_total"]
    t = Table(title="kvtop demo", show_header=False)
    t.add_row("requests", f"{len(ok)} ok ({', '.join(f'{k}: {v}' for k, v in sorted(reasons.items()))}), "
                          f"{len(results) - len(ok)} failed; {sum(r.streamed for r in ok)} streamed")  # fmt: skip
    t.add_row("tokens", f"{prompt} prompt, {gen} generated in {elapsed:.1f} s ({gen / elapsed:.1f} tokens/s)")
    t.add_row("latency ms P50/P95", f"first token {_pct(ttfts, 50)} / {_pct(ttfts, 95)} (streams) · "
                                    f"whole request {_pct(e2es, 50)} / {_pct(e2es, 95)}")  # fmt: skip
    t.add_row("KV cache", f"peak {peak * 100:.0f} % of {kv['num_blocks']} blocks ({kv['num_blocks'] * kv['block_size']}"
                          f" tokens)" + (": blocks ran short" if peak >= 0.95 else ""))  # fmt: skip
    t.add_row("waiting", f"up to {watch.running} running at once and {watch.waiting} waiting for a slot or blocks")
    t.add_row("preemptions", f"{preempted} (a running request's blocks taken back, its KV recomputed later)"
              if preempted else "none: every running request kept its blocks")  # fmt: skip
    t.add_row("prefix cache", f"{p['hit_rate'] * 100:.0f} % of prompt tokens hit ({p['hit_tokens']} of "
                              f"{p['query_tokens']}, ≈{p['saved_prefill_s']:.1f} s of prefill saved); "
                              f"{p.get('evictions', 0)} cached blocks evicted to make room")  # fmt: skip
    seen = sorted(watch.findings.values(), key=lambda v: -v[1])
    t.add_row("diagnosis (seen)", "\n".join(line for line, _ in seen) if seen else "nothing stood out")
    if peak >= 0.95 and (preempted or watch.waiting):
        t.add_row("so", "the KV cache, not compute, bounded concurrency: more --kv-cache-memory (see `kvctl plan`) "
                        "or a quantized --kv-cache-dtype lets more requests run at once")  # fmt: skip
    errors = [r.error for r in results if r.error]
    if errors:
        t.add_row("first error", errors[0])
    return t


def start_server(model: str, tmp: Path, serve_args: list[str]) -> tuple[subprocess.Popen, Path, Path]:
    socket, log = tmp / "engine.sock", tmp / "server.log"
    cmd = [sys.executable, "-m", "kvtop.ctl.cli", "serve", "--model", model, "--port", "0", "--socket", str(socket),
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
    ap = argparse.ArgumentParser(prog="python -m kvtop.ctl.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--free", type=int, default=16, help="free-form completions besides the shared-prefix chats")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=None,
                    help="open kvtop on the live engine (default: when stdout is a terminal)")  # fmt: skip
    ap.add_argument(
        "serve_args", nargs="*", help=f"`kvctl serve` flags, after -- (default: {' '.join(DEMO_SERVE_ARGS)})"
    )
    args = ap.parse_args(argv)
    dashboard = sys.stdout.isatty() and sys.stdin.isatty() if args.dashboard is None else args.dashboard
    tmp = Path(tempfile.mkdtemp(prefix="kvdemo", dir="/tmp"))
    proc, socket, log = start_server(args.model, tmp, args.serve_args or DEMO_SERVE_ARGS)
    try:
        url = wait_ready(proc, socket, log)
        print(log.read_text().strip(), flush=True)
        print(flush=True)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        jobs = build_load(model, args.free, args.max_tokens)
        if dashboard:
            results, elapsed, watch = with_dashboard(url, socket, jobs, args.concurrency)
        else:
            results, elapsed, watch = asyncio.run(drive(url, socket, jobs, args.concurrency))
        with EngineClient(socket) as c:
            frame = c.stats()
        Console().print(summary(results, elapsed, watch, frame))
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
