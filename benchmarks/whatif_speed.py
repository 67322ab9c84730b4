"""How fast `kvctl whatif` simulates: a synthetic trace of N requests (open-loop Poisson, prompts
64-1,024 tokens, outputs 16-256, half behind 4 shared 256-token system prompts) through the real
Scheduler and BlockManager, at SmolLM2-135M's float32 KV shape, timed whole.

    .venv/bin/python benchmarks/whatif_speed.py            # 10,000 requests
    .venv/bin/python benchmarks/whatif_speed.py -n 2000 --kv-cache-memory 256MiB
    .venv/bin/python benchmarks/whatif_speed.py --sweep kv-cache-memory=256MiB..2GiB   # 8 points, as kvctl's
"""

from __future__ import annotations

import argparse
import resource
import time

from engine.whatif.config import whatif_config
from engine.whatif.figures import simulated_figures
from engine.whatif.sim import simulate
from engine.whatif.sweep import parse_sweep, sweep
from engine.whatif.synthetic import synthetic_trace
from engine.whatif.timing import StepTimeModel

# SmolLM2-135M, float32: 30 layers × 3 KV heads × 64 dims
HEADER = {"model": "smollm2-135m", "dtype": "float32", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64,
          "block_size": 16, "num_blocks": 364, "kv_cache_dtype": "auto", "bytes_per_token": 46080,
          "kv_cache_memory": 364 * 16 * 46080, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
          "max_model_len": 8192, "enable_prefix_caching": True, "schedule_policy": "fcfs",
          "preemption_mode": "recompute", "cpu_blocks": 0}  # fmt: skip
MODEL = StepTimeModel((0.02, 4e-4, 8e-4, 2e-8), 0.001, source="benchmark")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument(
        "--sweep", help="time `kvctl whatif --sweep` of this trace instead, e.g. kv-cache-memory=256MiB..2GiB"
    )
    ap.add_argument("--points", type=int, default=8)
    args = ap.parse_args()
    trace = synthetic_trace(args.n, rate=args.rate, config=HEADER)
    if args.sweep:
        return time_sweep(trace, args.sweep, args.points)
    config = whatif_config(HEADER, kv_cache_memory=args.kv_cache_memory)
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(trace, config, MODEL)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    f = simulated_figures(res)
    print(f"{args.n} requests, {res.num_steps} steps, {sum(o.output_len for o in res.outcomes)} output tokens, "
          f"{f['preemptions']} preemptions, prefix hit rate {f['prefix_hit_rate']:.2f}: simulated in {wall:.2f} s wall, {cpu:.2f} s CPU "
          f"({config.describe()})")  # fmt: skip


def _cpu_with_children() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def time_sweep(trace, spec: str, points: int) -> None:
    knob, values = parse_sweep(spec, points)
    t0, c0 = time.perf_counter(), _cpu_with_children()
    rows = sweep(trace, knob, values, {}, MODEL)  # a process per core, as kvctl whatif --sweep runs it
    wall, cpu = time.perf_counter() - t0, _cpu_with_children() - c0
    for row in rows:
        print(f"  {row['label']:>10}: {row.get('preemptions', row.get('error'))} preemptions")
    print(
        f"{len(trace.requests)} requests, sweep of {len(rows)} points over {knob}: {wall:.2f} s wall, {cpu:.2f} s CPU"
    )


if __name__ == "__main__":
    main()
