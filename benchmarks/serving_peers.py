"""`peers.py --serving`: one `kvctl bench` load against `kvctl serve`, then against vLLM's OpenAI server.

One server at a time, each started, warmed with 4 short requests, measured, then stopped (its whole
process tree). Both get the same prompts (kvctl bench's random dataset, same seed), streamed, greedy,
ignore_eos. Reported per server: TTFT and ITL P50/P99, output tok/s, and output tokens per CPU-second
of the server's process tree during the load.
"""

from __future__ import annotations

import json
import os
import socket
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
        cmd = [str(KVCTL), "serve", "--model", "smollm2-135m", "--dtype", dtype, "--port", str(port),
               "--kv-cache-memory", f"{args.kv_gib}GiB", "--attention-backend", args.attention_backend,
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


def one_server(kind: str, dtype: str, args) -> dict:
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
            load_before, c0 = os.getloadavg()[0], tree_cpu_seconds(proc.pid)
            rep = bench(url, args.serving_load.split(), tmp / "bench.json")
            cpu = tree_cpu_seconds(proc.pid) - c0
        finally:
            stop(proc)
    tokens = rep["output_token_throughput"] * rep["duration_s"]
    rep.update(server=kind, dtype=dtype, start_s=started, server_cpu_s=cpu, server_tok_per_cpu_s=tokens / cpu,
               load_before=load_before, load_after=os.getloadavg()[0])  # fmt: skip
    return rep


def pick(rep: dict, keys: tuple[str, ...]) -> float | None:
    for k in keys:
        rep = rep.get(k) if isinstance(rep, dict) else None
    return rep


def print_table(reps: list[dict], load: str) -> None:
    for dtype in dict.fromkeys(r["dtype"] for r in reps):
        ours = next((r for r in reps if r["dtype"] == dtype and r["server"] == "ours"), {})
        vllm = next((r for r in reps if r["dtype"] == dtype and r["server"] == "vllm"), {})
        print(f"\nserving, {dtype}, kvctl bench {load}")
        print(f"{'metric':22} {'kvctl serve':>12} {'vLLM':>12} {'ours vs vLLM':>13}")
        for label, keys, scale, higher in ROWS:
            a, b = pick(ours, keys), pick(vllm, keys)
            cells = [f"{v * scale:12.1f}" if v is not None else f"{'–':>12}" for v in (a, b)]
            ratio = (a / b if higher else b / a) if a and b else None
            print(f"{label:22} {cells[0]} {cells[1]} {f'{ratio:12.2f}x' if ratio else '':>13}")
        for r in (ours, vllm):
            if r:
                print(
                    f"  {r['server']}: started in {r['start_s']:.0f} s, load {r['load_before']:.1f}/{r['load_after']:.1f}"
                )
    print("ours vs vLLM: how many times better ours is (throughput ours/vLLM; latency vLLM/ours)")


def serving(args) -> list[dict]:
    if vllm_python() is None or not OURS_PY.exists():
        sys.exit("peers --serving needs .venv and .venv-vllm (make vllm)")
    reps = []
    for dtype in args.dtype:
        for kind in ("ours", "vllm"):
            print(f"{dtype} {kind} server: starting…", file=sys.stderr, flush=True)
            try:
                reps.append(one_server(kind, dtype, args))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"  {kind} failed: {exc}", file=sys.stderr, flush=True)
    print_table(reps, args.serving_load)
    return reps
