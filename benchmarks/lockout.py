"""Can clients without the API key lock everyone else out? Authenticated completions and /health
timed against one real `kvctl serve` with no attack, then while ~1,000 unauthenticated
connections each trickle a body byte every 2 s, side by side in one run (issue #40; goal: the
P50s during the attack within 2x of those without).

    .venv/bin/python benchmarks/lockout.py                   # smollm2-135m, the server's defaults
    .venv/bin/python benchmarks/lockout.py --mode headers    # the attack trickles its headers instead
    .venv/bin/python benchmarks/lockout.py -- --max-connections-per-ip 1024   # extra `kvctl serve` flags

The attacker is a process of its own, on loopback only, from 127.0.0.1: each of its --connections
sends `POST /v1/completions` without a key, declaring a 1 GB body, then one byte every --interval
seconds (`--mode headers`: the request line, then one header byte at a time), whatever the server
answers, until the server ends the connection; then it opens another after --interval. It never
holds more than --connections at once and stops itself after --attack-seconds. The measured client
comes from 127.0.0.2, as a user elsewhere would, and opens a new connection for every request, so
that a server that stops accepting shows. Against the code before issue #40 (--connections 1500,
over its 1,024): 16 of 20 /health and 5 of 8 completions answered 503. Figures: docs/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "lockout-bench-key"
CLIENT_ADDRESS = "127.0.0.2"  # the measured client; the attacker is 127.0.0.1
BODY_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000000000\r\n\r\n"
)


def raise_open_files_limit() -> int:
    """Up to the hard limit: the attacker holds ~1,000 sockets, the server as many (inherited)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---- the attacker (its own process) ------------------------------------------------------------
async def attack(port: int, connections: int, interval: float, seconds: float, mode: str) -> dict:
    aloop = asyncio.get_running_loop()
    stop = asyncio.Event()
    aloop.add_signal_handler(signal.SIGTERM, stop.set)
    aloop.call_later(seconds, stop.set)
    stats: Counter[str] = Counter()
    open_now = [0, 0]  # [now, most at once]

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Send on whatever the answer, until the server ends the connection (as a hostile client
        does: an answer that leaves the connection open leaves it to the client)."""
        writer.write(BODY_HEAD if mode == "body" else b"POST /v1/completions HTTP/1.1\r\n")
        answered = False
        while not stop.is_set():
            await writer.drain()
            try:
                data = await asyncio.wait_for(reader.read(4096), interval)
            except TimeoutError:
                writer.write(b"x" if mode == "body" else b"X")
                continue
            if not data:
                stats["closed" if answered else "closed without an answer"] += 1
                return
            if not answered:
                stats[f"answered {data[9:12].decode(errors='replace')}"] += 1
                answered = True

    async def one() -> None:
        await asyncio.sleep(random.uniform(0, interval))  # the connections start spread over one interval
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.1", 0))
            except OSError:
                stats["connect failed"] += 1
            else:
                stats["connections opened"] += 1
                open_now[0] += 1
                open_now[1] = max(open_now)
                try:
                    await trickle(reader, writer)
                except OSError:
                    stats["reset by the server"] += 1
                finally:
                    open_now[0] -= 1
                    writer.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    await asyncio.gather(*(one() for _ in range(connections)))
    return {**stats, "most open at once": open_now[1]}


# ---- the measured client ----------------------------------------------------------------------
def timed(client: httpx.Client, method: str, path: str, **kw) -> tuple[float, int]:
    t0 = time.perf_counter()
    try:
        status = client.request(method, path, **kw).status_code
    except httpx.HTTPError:
        status = 0
    return time.perf_counter() - t0, status


def measure(url: str, model: str, requests: int, probes: int) -> dict:
    """P50s of authenticated completions and of /health, each on a new connection."""
    transport = httpx.HTTPTransport(local_address=CLIENT_ADDRESS)
    headers = {"Authorization": f"Bearer {API_KEY}", "Connection": "close"}
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=url, transport=transport, headers=headers, timeout=60) as client:
        completions = [timed(client, "POST", "/v1/completions", json=body) for _ in range(requests)]
        health = [timed(client, "GET", "/health") for _ in range(probes)]

    def summary(samples: list[tuple[float, int]]) -> dict:
        ok = [s for s, status in samples if status == 200]
        failed = Counter(str(status or "error") for _, status in samples if status != 200)
        return {"p50_ms": statistics.median(ok) * 1000 if ok else float("nan"), "ok": len(ok),
                "of": len(samples), "failed": dict(failed)}  # fmt: skip

    return {"completion": summary(completions), "health": summary(health)}


# ---- one run ------------------------------------------------------------------------------------
def start_server(model: str, tmp: Path, extra: list[str]) -> tuple[subprocess.Popen, str, Path]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvtop.ctl.cli", "serve", "--model", model, "--port", str(port),
           "--socket", str(tmp / "s" / "engine.sock"), "--snapshot-dir", str(tmp / "snaps"), *extra]  # fmt: skip
    log_path = tmp / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "KVTOP_API_KEY": API_KEY})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, log_path
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"kvctl serve did not come up:\n{log_path.read_text()[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--connections", type=int, default=1000, help="attacking connections at once")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between an attacker's bytes")
    ap.add_argument("--mode", choices=("body", "headers"), default="body", help="what the attacker trickles")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of (no attack, attack)")
    ap.add_argument("--requests", type=int, default=8, help="authenticated completions per phase")
    ap.add_argument("--probes", type=int, default=30, help="/health requests per phase")
    ap.add_argument("--attack-seconds", type=float, default=300.0, help="the attacker stops itself after this")
    ap.add_argument(
        "--attacker-nice",
        type=int,
        default=0,
        help="the attacker's niceness: 19 leaves the server the CPU a remote attacker would not take",
    )
    ap.add_argument("--attacker", type=int, default=0, help=argparse.SUPPRESS)  # internal: be the attacker
    ap.add_argument("serve_args", nargs="*", help="extra `kvctl serve` flags, after --")
    args = ap.parse_args()
    fds = raise_open_files_limit()
    if args.attacker:
        stats = asyncio.run(attack(args.attacker, args.connections, args.interval, args.attack_seconds, args.mode))
        print(json.dumps(stats), flush=True)
        return
    if fds < args.connections + 64:
        raise SystemExit(f"open files limit {fds}: too low for {args.connections} connections (ulimit -Hn)")
    with tempfile.TemporaryDirectory(prefix="lockout", dir="/tmp") as tmp:
        os.chmod(tmp, 0o700)
        proc, url, log_path = start_server(args.model, Path(tmp), args.serve_args)
        try:
            run(args, proc, url, log_path)
        finally:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def run(args, proc: subprocess.Popen, url: str, log_path: Path) -> None:
    """--rounds of (no attack, attack), alternated: on a shared machine the minutes move the figures
    more than anything, and alternation compares the phases, not the minutes."""
    measure(url, args.model, 4, 4)  # warm: first requests, first connections
    rounds: list[dict] = []
    port = url.rsplit(":", 1)[1]
    cmd = ["nice", "-n", str(args.attacker_nice), sys.executable, __file__, "--attacker", port, "--connections",
           str(args.connections), "--interval", str(args.interval), "--mode", args.mode, "--attack-seconds",
           str(args.attack_seconds)]  # fmt: skip
    log_lines: list[str] = []
    for _ in range(args.rounds):
        quiet = measure(url, args.model, args.requests, args.probes)
        log_before = log_path.read_text(errors="replace").count("\n")
        attacker = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(2 * args.interval + 1)  # every attacking connection has started, most more than once
            cpu0 = (cpu_seconds(proc.pid), cpu_seconds(attacker.pid), time.monotonic())
            attacked = measure(url, args.model, args.requests, args.probes)
            cpu1 = (cpu_seconds(proc.pid), cpu_seconds(attacker.pid), time.monotonic())
        finally:
            attacker.send_signal(signal.SIGTERM)
            out = attacker.communicate(timeout=60)[0].strip()
        log_lines += log_path.read_text(errors="replace").splitlines()[log_before:]
        seconds = cpu1[2] - cpu0[2]
        rounds.append({"no attack": quiet, "under attack": attacked, "attack": json.loads(out or "{}"),
                       "cores": ((cpu1[0] - cpu0[0]) / seconds, (cpu1[1] - cpu0[1]) / seconds)})  # fmt: skip
    report(args, rounds, log_lines)


def report(args, rounds: list[dict], log_lines: list[str]) -> None:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")  # fmt: skip
    print(f"kvctl serve --model {args.model} {' '.join(args.serve_args)}  ({os.cpu_count()} CPUs: {cpu})")
    print(f"attack: {args.connections} unauthenticated connections from 127.0.0.1, {args.mode} trickled a byte "
          f"every {args.interval:g} s, reconnecting {args.interval:g} s after the server ends one; the attacker "
          f"at nice {args.attacker_nice}")  # fmt: skip
    print(
        f"{'round':>5}  {'completion P50 (8 tokens)':>34}  {'/health P50':>26}  cores during the attack   the attacker saw"
    )
    for i, r in enumerate(rounds, 1):
        cells = []
        for what in ("completion", "health"):
            a, b = r["no attack"][what]["p50_ms"], r["under attack"][what]["p50_ms"]
            cells.append(f"{a:>8.1f} → {b:>8.1f} ms {b / a:>5.2f}x")
        answers = {k: v for k, v in r["attack"].items() if k.startswith(("answered", "reset", "closed", "connect"))}
        print(f"{i:>5}  {cells[0]:>34}  {cells[1]:>26}  server {r['cores'][0]:.2f}, attacker {r['cores'][1]:.2f}"
              f"  {answers}")  # fmt: skip
    for what, label in (("completion", "completion"), ("health", "/health")):
        ratios = [r["under attack"][what]["p50_ms"] / r["no attack"][what]["p50_ms"] for r in rounds]
        failed: Counter[str] = Counter()
        for r in rounds:
            failed.update(r["under attack"][what]["failed"])
        ok = sum(r["under attack"][what]["ok"] for r in rounds), sum(r["under attack"][what]["of"] for r in rounds)
        print(f"{label}: median ratio {statistics.median(ratios):.2f}x over {len(rounds)} rounds; under attack "
              f"{ok[0]}/{ok[1]} answered 200" + (f", failed: {dict(failed)}" if failed else ""))  # fmt: skip
    print(f"server log during the attacks: {len(log_lines)} lines" + (f", e.g. {log_lines[-1]}" if log_lines else ""))


if __name__ == "__main__":
    main()
