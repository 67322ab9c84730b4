"""How fast `kvctl whatif` simulates: a synthetic trace of N requests (open-loop Poisson, prompts
64-1,024 tokens, outputs 16-256, half behind 4 shared 256-token system prompts) through the real
Scheduler and BlockManager, at SmolLM2-135M's float32 KV shape, timed whole.

    .venv/bin/python benchmarks/whatif_speed.py            # 10,000 requests
    .venv/bin/python benchmarks/whatif_speed.py -n 2000 --kv-cache-memory 256MiB
"""

from __future__ import annotations

import argparse
import time

from engine.whatif.config import whatif_config
from engine.whatif.figures import simulated_figures
from engine.whatif.sim import simulate
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
    args = ap.parse_args()
    trace = synthetic_trace(args.n, rate=args.rate, config=HEADER)
    config = whatif_config(HEADER, kv_cache_memory=args.kv_cache_memory)
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(trace, config, MODEL)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    f = simulated_figures(res)
    print(f"{args.n} requests, {res.num_steps} steps, {sum(o.output_len for o in res.outcomes)} output tokens, "
          f"{f['preemptions']} preemptions, prefix hit rate {f['prefix_hit_rate']:.2f}: simulated in {wall:.2f} s wall, {cpu:.2f} s CPU "
          f"({config.describe()})")  # fmt: skip


if __name__ == "__main__":
    main()
