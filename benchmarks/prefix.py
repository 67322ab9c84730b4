"""Prefix cache and CPU tier, measured on SmolLM2-135M.

    .venv/bin/python benchmarks/prefix.py

1. 64 requests sharing a 1,024-token system prompt, each with a short distinct question, arriving
   together after one warm-up request (a serving engine has usually seen its system prompt):
   TTFT P50/P99 and total prefill time with the prefix cache on vs off.
2. Preemption under a tight KV budget: swap to a CPU tier vs recompute — wall time, preemptions,
   bytes moved, TTFT/ITL P99.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine import LLM, SamplingParams
from kvtop.protocol.stats_math import percentiles


def shared_prefix_prompts(n: int, system_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(100, 49000) for _ in range(system_len)]
    return [system + [rng.randrange(100, 49000) for _ in range(rng.randint(8, 24))] for _ in range(n + 1)]


def run(llm: LLM, prompts, params) -> dict:
    engine = llm.engine
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    ttfts = [o.metrics.ttft for o in outs]
    itls = [x for o in outs for x in o.metrics.itls]
    c = engine.metrics.counters

    ttft_p50, ttft_p99 = percentiles(ttfts, (50, 99), method="rank")
    return {
        "wall_s": wall,
        "ttft_p50_s": ttft_p50,
        "ttft_p99_s": ttft_p99,
        "itl_p99_s": percentiles(itls, (99,), method="rank")[0],
        "prefill_s": c.prefill_seconds,
        "prefill_tokens": c.prefill_tokens,
        "cached_tokens": sum(o.cached_tokens for o in outs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--part", choices=["1", "2", "both"], default="both", help="1: prefix cache, 2: swap vs recompute")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    results: dict = {}
    if args.part != "2":
        shared_prefix_part(args, results)
    if args.part != "1":
        swap_part(args, results)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)


def shared_prefix_part(args, results: dict) -> None:

    prompts = shared_prefix_prompts(args.requests, args.system_len)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    print(f"1. {args.requests} requests sharing a {args.system_len}-token system prompt, 16 output tokens each")
    for on in (True, False):
        llm = LLM("smollm2-135m", dtype=args.dtype, kv_cache_memory="4GiB", enable_prefix_caching=on,
                  quantization="none", quiet=True)  # fmt: skip
        llm.generate(prompts[:1], params)  # warm-up: the system prompt has been seen once
        llm.engine.metrics.counters.prefill_seconds = 0.0
        llm.engine.metrics.counters.prefill_tokens = 0
        r = run(llm, prompts[1:], params)
        results[f"prefix_{'on' if on else 'off'}"] = r
        print(f"   prefix cache {'on ' if on else 'off'}: TTFT P50 {r['ttft_p50_s']:.3f} s, P99 {r['ttft_p99_s']:.3f} s, "
              f"prefill {r['prefill_s']:.2f} s over {r['prefill_tokens']} tokens, wall {r['wall_s']:.2f} s, "
              f"cached tokens {r['cached_tokens']}", flush=True)  # fmt: skip
    on, off = results["prefix_on"], results["prefix_off"]
    print(f"   → TTFT P50 {off['ttft_p50_s'] / on['ttft_p50_s']:.1f}× lower, prefill time "
          f"{off['prefill_s'] / max(on['prefill_s'], 1e-9):.1f}× lower with the prefix cache")  # fmt: skip


def swap_part(args, results: dict) -> None:
    print("2. 32 requests of 200–400 prompt tokens × 128 output tokens in a KV cache of 96 MiB (~2,100 tokens)")
    rng = random.Random(1)
    long_prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(200, 400))] for _ in range(32)]
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    outputs = {}
    for mode in ("recompute", "swap"):
        extra = {"cpu_offload_memory": "1GiB"} if mode == "swap" else {}
        llm = LLM("smollm2-135m", dtype=args.dtype, kv_cache_memory="96MiB", preemption_mode=mode,
                  enable_prefix_caching=False, quantization="none", quiet=True, **extra)  # fmt: skip
        r = run(llm, long_prompts, params)
        outputs[mode] = [o.token_ids for o in llm.generate(long_prompts[:4], params)]
        frame = llm.stats()
        r["preemptions"] = frame["scheduler"]["preemptions_total"]
        r["cpu"] = frame["kv"]["cpu"]
        results[f"preempt_{mode}"] = r
        moved = (r["cpu"].get("swap_out_bytes", 0) + r["cpu"].get("swap_in_bytes", 0)) / 2**20
        print(f"   {mode:9}: wall {r['wall_s']:.2f} s, preemptions {r['preemptions']}, prefill tokens "
              f"{r['prefill_tokens']}, TTFT P99 {r['ttft_p99_s']:.2f} s, ITL P99 {r['itl_p99_s'] * 1000:.0f} ms, "
              f"moved {moved:.0f} MiB in {r['cpu'].get('to_host_s', 0) + r['cpu'].get('to_device_s', 0):.2f} s",
              flush=True)  # fmt: skip
    print(f"   same tokens either way: {outputs['swap'] == outputs['recompute']}")


if __name__ == "__main__":
    main()
