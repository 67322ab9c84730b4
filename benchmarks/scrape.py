"""What a `/metrics` scrape costs the engine: with N sequences running, the time a scrape holds the
engine lock and the time the whole exposition takes to render, beside the time of one engine step,
which the lock holds up. Side by side: the scrape as it is (`engine.gauges()`: counters and gauges,
no per-sequence rows, block map or percentiles) and as it was (`engine.stats()`, the whole stats
frame under the lock, which `kvctl status` and the dashboard's socket still read).

    .venv/bin/python benchmarks/scrape.py                  # SmolLM2-135M, 64 sequences
    .venv/bin/python benchmarks/scrape.py --seqs 16 --kv-cache-memory 64MiB
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.server.exposition import make_registry, render_metrics
from engine.server.loop import EngineLoop
from engine.telemetry.stats import build_frame, build_gauges
from kvtop.protocol.config import EngineConfig, ServerConfig


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median and max of `repeats` calls, in ms."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, max(times) * 1e3


def running_engine(model: str, seqs: int, kv_cache_memory: str) -> LLMEngine:
    """An engine with `seqs` sequences past their prefill, decoding."""
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=kv_cache_memory, max_num_seqs=seqs), quiet=True)
    for i in range(seqs):
        engine.add_request(list(range(100 + i, 164 + i)), SamplingParams(max_tokens=100_000, ignore_eos=True))
    running = engine.scheduler.running
    while len(running) < seqs or any(s.num_computed_tokens < s.num_prompt_tokens for s in running):
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    engine = running_engine(args.model, args.seqs, args.kv_cache_memory)
    loop = EngineLoop(engine, ServerConfig())
    registry = make_registry(loop)
    held = timed(lambda: build_gauges(engine), args.repeats)  # what engine.gauges() holds the lock for
    held_frame = timed(lambda: build_frame(engine), args.repeats)  # what engine.stats() holds it for
    scrape = timed(lambda: render_metrics(registry), args.repeats)
    loop.gauges = loop.frame  # the exposition as it was: from the whole frame
    scrape_frame = timed(lambda: render_metrics(registry), args.repeats)
    step = timed(engine.step, 10)
    print(f"{len(engine.scheduler.running)} sequences running, {engine.kv.num_blocks} KV blocks ({args.model})")
    print("                               counters and gauges   whole frame (before)   ratio")
    print(f"engine lock held per scrape:   {held[0]:6.2f} ms (max {held[1]:5.2f})  {held_frame[0]:6.2f} ms "
          f"(max {held_frame[1]:5.2f})   {held_frame[0] / held[0]:.1f}x")  # fmt: skip
    print(f"whole /metrics exposition:     {scrape[0]:6.2f} ms (max {scrape[1]:5.2f})  {scrape_frame[0]:6.2f} ms "
          f"(max {scrape_frame[1]:5.2f})   {scrape_frame[0] / scrape[0]:.1f}x")  # fmt: skip
    print(f"one engine step (decode, {args.seqs} sequences): {step[0]:.1f} ms median")
    print(
        f"a scrape holds the lock for {held[0] / step[0]:.2%} of a step (the whole frame: {held_frame[0] / step[0]:.2%})"
    )


if __name__ == "__main__":
    main()
