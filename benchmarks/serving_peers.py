"""`peers.py --serving`: one `kvctl bench` load against `kvctl serve`, then against vLLM's OpenAI server.

One server at a time, each started, warmed with 4 short requests, measured, then stopped (its whole
process tree). Both get the same prompts (kvctl bench's random dataset, same seed), streamed, greedy,
ignore_eos. Reported per server: TTFT and ITL P50/P99, output tok/s, and output tokens per CPU-second
of the server's process tree during the load.

`--rounds N` (N > 1): both servers up at once, idle but for the load sent to one of them, and the
load alternates between them — ours, vLLM, vLLM, ours, ... — round r with `--seed` + r for both, so
that each server meets the same prompts at nearly the same moment. One run of each server on this
machine moves by a third or more between starts; what alternation compares is the servers, not the
minutes. The table gives each server's median over its runs and the median of the per-round ratios;
the CPU-seconds the idle server used during the other's loads are reported (a server that spins while
idle would take the cores from the other).

    .venv/bin/python benchmarks/peers.py --serving --dtype bfloat16 --rounds 4
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from peers import OURS_PY, ROOT, tree_cpu_seconds, vllm_env, vllm_python

KVCTL = ROOT / ".venv" / "bin" / "kvctl"
ROWS = [  # label, report keys, scale, higher is better
    ("output tok/s", ("output_token_throughput",), 1.0, True),
    ("tok per server CPU-s", ("server_tok_per_cpu_s",), 1.0, True),
    ("TTFT P50 ms", ("ttft_s", "p50"), 1000.0, False),
    ("TTFT P99 ms", ("ttft_s", "p99"), 1000.0, False),
    ("ITL P50 ms", ("itl_s", "p50"), 1000.0, False),
    ("ITL P99 ms", ("itl_s", "p99"), 1000.0, False),
    ("failed", ("failed",), 1.0, False),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(kind: str, dtype: str, port: int, tmp: Path, args) -> tuple[list[str], dict]:
    if kind == "ours":
        cmd = [str(KVCTL), "serve", "--model", "smollm2-135m", "--dtype", dtype, "--quantization", "none",
               "--port", str(port), "--kv-cache-memory", f"{args.kv_gib}GiB", "--attention-backend", args.attention_backend,
               "--socket", str(tmp / "engine.sock"), "--snapshot-dir", str(tmp / "snaps")]  # fmt: skip
        return cmd, dict(os.environ)
    from engine.model.loader import resolve_model_dir

    cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model_dir("smollm2-135m")),
           "--served-model-name", "smollm2-135m", "--dtype", dtype, "--max-model-len", "1024",
           "--host", "127.0.0.1", "--port", str(port)] + (["--enforce-eager"] if args.enforce_eager else [])  # fmt: skip
    return cmd, vllm_env(args.kv_gib)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log.read_text(errors='replace')[-1500:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server not healthy in {timeout:.0f} s: {log.read_text(errors='replace')[-1500:]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server, then kill whatever of its tree is left (vLLM's engine core is a child)."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass


def bench(url: str, load: list[str], out: Path) -> dict:
    cmd = [str(KVCTL), "bench", "--base-url", url, "--dataset", "random", *load, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"kvctl bench exit {proc.returncode}: {proc.stderr[-1500:]}")
    return json.loads(out.read_text())


@contextlib.contextmanager
def running(kind: str, dtype: str, args):
    """A started, healthy and warmed server: (process, url, seconds it took to start)."""
    with tempfile.TemporaryDirectory(prefix=f"peers-{kind}-") as d:
        tmp, port = Path(d), free_port()
        cmd, env = server_cmd(kind, dtype, port, tmp, args)
        url = f"http://127.0.0.1:{port}"
        log = tmp / "server.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        try:
            t0 = time.perf_counter()
            wait_healthy(proc, url, log, args.timeout)
            started = time.perf_counter() - t0
            bench(url, ["--num-prompts", "4", "--input-len", "32", "--output-len", "8"], tmp / "warm.json")
            yield proc, url, started
        finally:
            stop(proc)


def with_seed(load: str, seed_offset: int) -> list[str]:
    """The load's options with its --seed moved on by `seed_offset` (from 0 where it has none)."""
    opts = load.split()
    if "--seed" in opts:
        at = opts.index("--seed") + 1
        opts[at] = str(int(opts[at]) + seed_offset)
    else:
        opts += ["--seed", str(seed_offset)]
    return opts


def measure(kind: str, dtype: str, proc, url: str, load: list[str], idle=None) -> dict:
    """One load against `url`; the CPU-seconds of the server's tree (and of an idle one's) meanwhile."""
    with tempfile.TemporaryDirectory(prefix="peers-load-") as d:
        load_before, c0 = os.getloadavg()[0], tree_cpu_seconds(proc.pid)
        i0 = tree_cpu_seconds(idle.pid) if idle is not None else 0.0
        rep = bench(url, load, Path(d) / "bench.json")
        cpu = tree_cpu_seconds(proc.pid) - c0
        idle_cpu = tree_cpu_seconds(idle.pid) - i0 if idle is not None else None
    tokens = rep["output_token_throughput"] * rep["duration_s"]
    rep.update(server=kind, dtype=dtype, server_cpu_s=cpu, server_tok_per_cpu_s=tokens / cpu, idle_cpu_s=idle_cpu,
               load_before=load_before, load_after=os.getloadavg()[0])  # fmt: skip
    return rep


def one_server(kind: str, dtype: str, args) -> dict:
    with running(kind, dtype, args) as (proc, url, started):
        rep = measure(kind, dtype, proc, url, args.serving_load.split())
    rep.update(start_s=started, round=0)
    return rep


def alternated(dtype: str, args) -> list[dict]:
    """Both servers up; round r sends the load (seed + r) to each in turn, the order flipped each round.
    A server that fails ends the rounds; the runs measured before it are kept."""
    reps: list[dict] = []
    try:
        with running("ours", dtype, args) as ours, running("vllm", dtype, args) as vllm:
            servers = {"ours": ours, "vllm": vllm}
            for rnd in range(args.rounds):
                order = ("ours", "vllm") if rnd % 2 == 0 else ("vllm", "ours")
                for kind, other in (order, order[::-1]):
                    print(f"{dtype} round {rnd + 1}/{args.rounds}: {kind}…", file=sys.stderr, flush=True)
                    proc, url, started = servers[kind]
                    rep = measure(kind, dtype, proc, url, with_seed(args.serving_load, rnd), idle=servers[other][0])
                    reps.append({**rep, "start_s": started, "round": rnd})
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"  {dtype}: stopped after {len(reps)} runs: {exc}", file=sys.stderr, flush=True)
    return reps


def pick(rep: dict, keys: tuple[str, ...]) -> float | None:
    for k in keys:
        rep = rep.get(k) if isinstance(rep, dict) else None
    return rep


def ratio(a: float | None, b: float | None, higher: bool) -> float | None:
    """How many times better ours (a) is than vLLM's (b)."""
    return (a / b if higher else b / a) if a and b else None


def summary(reps: list[dict], dtype: str) -> tuple[dict, dict, list[float | None]]:
    """Per metric: ours' and vLLM's medians over their runs, and the median of the per-round ratios."""
    runs = {k: [r for r in reps if r["dtype"] == dtype and r["server"] == k] for k in ("ours", "vllm")}
    med = {k: {} for k in runs}
    ratios = []
    for label, keys, _scale, higher in ROWS:
        for k, rs in runs.items():
            vals = [v for v in (pick(r, keys) for r in rs) if v is not None]
            med[k][label] = statistics.median(vals) if vals else None
        rounds = {r["round"] for r in runs["ours"]} & {r["round"] for r in runs["vllm"]}
        per_round = [
            ratio(*(pick(next(r for r in runs[k] if r["round"] == n), keys) for k in ("ours", "vllm")), higher)
            for n in sorted(rounds)
        ]
        per_round = [x for x in per_round if x is not None]
        ratios.append(statistics.median(per_round) if per_round else None)
    return med["ours"], med["vllm"], ratios


def print_table(reps: list[dict], load: str) -> None:
    for dtype in dict.fromkeys(r["dtype"] for r in reps):
        ours, vllm, ratios = summary(reps, dtype)
        n = max((r["round"] for r in reps if r["dtype"] == dtype), default=0) + 1
        what = f"medians of {n} alternated rounds, ratio: median of the rounds' ratios" if n > 1 else "one run each"
        print(f"\nserving, {dtype}, kvctl bench {load} ({what})")
        print(f"{'metric':22} {'kvctl serve':>12} {'vLLM':>12} {'ours vs vLLM':>13}")
        for (label, _keys, scale, _higher), r in zip(ROWS, ratios, strict=True):
            cells = [f"{v[label] * scale:12.1f}" if v.get(label) is not None else f"{'–':>12}" for v in (ours, vllm)]
            print(f"{label:22} {cells[0]} {cells[1]} {f'{r:12.2f}x' if r else '':>13}")
        for r in (r for r in reps if r["dtype"] == dtype):
            idle = f", the idle server {r['idle_cpu_s']:.1f} CPU-s" if r.get("idle_cpu_s") is not None else ""
            print(
                f"  round {r['round'] + 1} {r['server']:4}: TTFT P50 {r['ttft_s']['p50'] * 1000:,.0f} ms, "
                f"{r['output_token_throughput']:.1f} tok/s, load {r['load_before']:.1f}/{r['load_after']:.1f}{idle}"
            )
    print("ours vs vLLM: how many times better ours is (throughput ours/vLLM; latency vLLM/ours)")


def serving(args) -> list[dict]:
    if vllm_python() is None or not OURS_PY.exists():
        sys.exit("peers --serving needs .venv and .venv-vllm (make vllm)")
    reps = []
    for dtype in args.dtype:
        if args.rounds > 1:
            reps += alternated(dtype, args)
            continue
        for kind in ("ours", "vllm"):
            print(f"{dtype} {kind} server: starting…", file=sys.stderr, flush=True)
            try:
                reps.append(one_server(kind, dtype, args))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"  {kind} failed: {exc}", file=sys.stderr, flush=True)
    print_table(reps, args.serving_load)
    return reps
