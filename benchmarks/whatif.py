"""Does `kvctl whatif` predict what a real run does? Record a real SmolLM2 run at a configuration
that preempts, predict three other configurations from that recording alone, then run each for
real on the same trace and compare (issue #37: goal 10 % on TTFT P50, end-to-end P50 and
throughput, preemptions within 20 % or 3; the self-check within 5 %).

    .venv/bin/python benchmarks/whatif.py                       # ~10 min on 2 idle cores
    .venv/bin/python benchmarks/whatif.py --runs 1 --num-prompts 30   # a quick look

1. `kvctl serve` at RECORDED (a KV cache too small for the load), `kvctl bench` sends the load
   (a shared system prompt per group, mixed output lengths, Poisson arrivals), `kvctl snapshot`
   keeps the engine's own trace of it.
2. `kvctl whatif` on that snapshot for each of WHATIFS: the predicted figures (`--json`), and the
   self-check (the recorded configuration simulated against what was recorded).
3. For each what-if, `--runs` times: a fresh `kvctl serve` at that configuration, `kvctl bench
   --trace` replays the recording's arrivals and lengths, `kvctl snapshot`; the measured figures
   are the engine's own record of the run (the same code computes "recorded" in whatif), so the
   prediction and the measurement are figures of the same name, timed by the same clock.

One server at a time. Compare on a quiet machine: the step-time model is fitted to the recording,
and a load that comes and goes between runs is not in it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from serving_peers import KVCTL, free_port, stop, wait_healthy

from engine.whatif.figures import recorded_figures
from kvtop.protocol.trace_file import load_trace

RECORDED = {"kv_cache_memory": "48MiB", "max_num_seqs": 16}  # SmolLM2 fp32: 68 blocks of 16 tokens
WHATIFS = {
    "2x KV memory": {"kv_cache_memory": "96MiB"},
    "int8 KV": {"kv_cache_dtype": "int8"},
    "half max-num-seqs": {"max_num_seqs": 8},
}
FIGURES = [  # figure, label, goal: (relative, absolute) — within either
    ("ttft_p50_s", "TTFT P50", (0.10, 0.0)),
    ("e2e_p50_s", "e2e P50", (0.10, 0.0)),
    ("output_tokens_per_s", "output tok/s", (0.10, 0.0)),
    ("preemptions", "preemptions", (0.20, 3.0)),
]


def flags(config: dict) -> list[str]:
    return [part for k, v in config.items() for part in (f"--{k.replace('_', '-')}", str(v))]


def kvctl(*args: str, timeout: float = 3600) -> str:
    proc = subprocess.run([str(KVCTL), *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"kvctl {' '.join(args[:2])} failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")
    return proc.stdout


@contextlib.contextmanager
def serving(config: dict, tmp: Path):
    """A fresh, healthy `kvctl serve` at `config`: (its URL, its control socket)."""
    port, sock = free_port(), tmp / "s" / "engine.sock"  # the server makes its socket directory, 0700
    cmd = [str(KVCTL), "serve", "--model", "smollm2-135m", "--dtype", "float32", "--quantization", "none",
           "--port", str(port),
           "--socket", str(sock), "--snapshot-dir", str(tmp), *flags(config)]  # fmt: skip
    log = tmp / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log, 600)
        yield url, sock
    finally:
        stop(proc)


def run_once(config: dict, load: list[str], tmp: Path) -> Path:
    """One real run at `config` under `load` (bench flags): the snapshot holding its trace."""
    tmp.mkdir(parents=True)
    with serving(config, tmp) as (url, sock):
        kvctl("bench", "--base-url", url, *load, "--json", str(tmp / "bench.json"))
        return Path(kvctl("snapshot", "--socket", str(sock), "-o", str(tmp / "run.kvsnap")).strip())


def whatif(snapshot: Path, config: dict) -> dict:
    return json.loads(kvctl("whatif", str(snapshot), *flags(config), "--json"))


def within(predicted: float | None, measured: float | None, goal: tuple[float, float]) -> bool:
    if predicted is None or measured is None:
        return False
    error = abs(predicted - measured)
    return error <= goal[1] or (measured != 0 and error / abs(measured) <= goal[0])


def error_text(predicted: float | None, measured: float | None, key: str) -> str:
    if predicted is None or measured is None:
        return "—"
    if key == "preemptions" or not measured:
        return f"{predicted - measured:+.0f}"
    return f"{(predicted / measured - 1) * 100:+.1f} %"


def show(value: float | None, key: str) -> str:
    if value is None:
        return "—"
    if key == "output_tokens_per_s":
        return f"{value:.1f}"
    return f"{value * 1000:.0f} ms" if key.endswith("_s") else f"{value:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="real runs per what-if (their median is compared)")
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--request-rate", type=float, default=1.5, help="requests/s, Poisson")
    args = ap.parse_args()
    load = ["--dataset", "shared-prefix", "--groups", "2", "--system-len", "200", "--question-len", "24",
            "--output-len", "16:128", "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
            "--seed", "7", "--scrape-interval", "0"]  # fmt: skip
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")  # fmt: skip
    print(f"kvctl whatif vs real runs · SmolLM2-135M fp32 · {cpu}", flush=True)
    with tempfile.TemporaryDirectory(prefix="whatif-bench-") as d:
        tmp = Path(d)
        recording = run_once(RECORDED, load, tmp / "recorded")
        base = whatif(recording, {})
        check = base["self_check"]
        print(f"recorded at {base['recorded_config']}: {base['recorded']['preemptions']} preemptions; "
              f"self-check {', '.join(f'{k} {v * 100:+.1f} %' for k, v in check.items() if v is not None)}; "
              f"timing {base['timing']}", flush=True)  # fmt: skip
        rows = []
        for name, change in WHATIFS.items():
            predicted = whatif(recording, change)["whatif"]
            measured_runs = []
            for i in range(args.runs):
                snap = run_once(
                    {**RECORDED, **change}, ["--trace", str(recording)], tmp / f"{name}-{i}".replace(" ", "-")
                )
                measured_runs.append(recorded_figures(load_trace(snap)))
            rows.append((name, predicted, measured_runs))
            print(f"  {name}: done ({args.runs} runs)", file=sys.stderr, flush=True)
    print(f"\n{'what-if':20} {'figure':14} {'predicted':>10} {'measured (median; runs)':>34} {'error':>9} goal")
    met = total = 0
    for name, predicted, runs in rows:
        for key, label, goal in FIGURES:
            values = [r.get(key) for r in runs if r.get(key) is not None]
            measured = statistics.median(values) if values else None
            spread = ", ".join(show(v, key) for v in values)
            ok = within(predicted.get(key), measured, goal)
            met, total = met + ok, total + 1
            print(f"{name:20} {label:14} {show(predicted.get(key), key):>10} {show(measured, key):>10} ({spread:>20}) "
                  f"{error_text(predicted.get(key), measured, key):>9} {'met' if ok else 'MISSED'}")  # fmt: skip
    print(f"\n{met} of {total} figures within the goal (10 % on latencies and throughput, preemptions 20 % or 3)")


if __name__ == "__main__":
    main()
