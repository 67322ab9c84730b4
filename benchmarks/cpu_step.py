"""Where the engine's CPU time goes: the step loop on SmolLM2-135M, its CPU time split into steps
that prefill (any prompt chunk in the batch) and decode-only steps of the whole batch, and
optionally `torch.profiler`'s table over a few decode-only steps.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_step.py --out 32 --dtype float32
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_step.py --out 14 --profile 3

Prompts: `--prompts` × `--input` random token ids (seeded), `--out` output tokens each (greedy,
ignore_eos). CPU time of the process (`time.process_time`) moves far less than wall time when the
machine is shared; both are printed.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from engine import LLM, SamplingParams


def decode_only(engine, batch: int) -> bool:
    """The whole batch is running and every sequence is decoding (no prompt chunk left)."""
    running = engine.scheduler.running
    return (
        len(running) == batch
        and not engine.scheduler.waiting
        and all(s.num_computed_tokens == s.num_tokens - 1 for s in running)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--out", type=int, default=32)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--attention-backend", default="cpu")
    ap.add_argument("--profile", type=int, default=0, help="torch.profiler over this many decode-only steps")
    args = ap.parse_args()
    llm = LLM(
        dtype=args.dtype, kv_cache_memory="3GiB", max_num_seqs=64, max_num_batched_tokens=2048,
        attention_backend=args.attention_backend, quantization="none", quiet=True,
    )  # fmt: skip
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.input)] for _ in range(args.prompts)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=args.out, temperature=0.0, ignore_eos=True))
    cpu = {"prefill": 0.0, "decode": 0.0}
    decode_steps, profiler, wall0, cpu0 = 0, None, time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        decoding = decode_only(engine, args.prompts)
        if decoding and args.profile and decode_steps == 1 and profiler is None:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        t0 = time.process_time()
        engine.step()
        cpu["decode" if decoding else "prefill"] += time.process_time() - t0
        decode_steps += decoding
        if profiler is not None and decode_steps == 1 + args.profile:
            profiler.__exit__(None, None, None)
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
            profiler = None
    wall, total = time.perf_counter() - wall0, time.process_time() - cpu0
    tokens = args.prompts * args.out
    print(
        f"{torch.get_num_threads()} threads, {args.dtype}, {args.attention_backend}: {tokens} tokens, "
        f"wall {wall:.1f} s ({tokens / wall:.1f} tok/s), CPU {total:.1f} s ({tokens / total:.1f} tok per CPU-s); "
        f"prefill steps {cpu['prefill']:.1f} CPU-s, {decode_steps} decode-only steps "
        f"{1e3 * cpu['decode'] / max(decode_steps, 1):.0f} CPU-ms each"
    )


if __name__ == "__main__":
    main()
