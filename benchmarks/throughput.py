"""Offline throughput: the same prompts through our engine, transformers' static-batch `generate`
and transformers' `generate_batch` (its own continuous batching), in one process, same dtype.

    .venv/bin/python benchmarks/throughput.py                       # both workloads, fp32 and bf16
    .venv/bin/python benchmarks/throughput.py --dtype bfloat16 --workload fixed
    .venv/bin/python benchmarks/throughput.py --dtype float32 --workload fixed --attention-backend cpu,reference

`--attention-backend` picks the engine's attention kernels (default auto); a comma-separated list
runs only the engine, once per backend on the same prompts, and prints each against the first.

Workloads (SmolLM2-135M, random prompt token ids, seeded):
  fixed:    64 prompts of 32–512 tokens × 128 output tokens (ignore_eos)
  variable: 64 prompts of 32–512 tokens × 16–256 output tokens
Throughput counts the output tokens each request asked for; a static batch has to run every row
to the longest request, which is exactly the waste continuous batching removes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from engine import LLM, SamplingParams


def workload(kind: str, n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(32, 512))] for _ in range(n)]
    outs = [128] * n if kind == "fixed" else [rng.randint(16, 256) for _ in range(n)]
    return prompts, outs


def run_engine(llm: LLM, prompts, out_lens) -> float:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in out_lens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == out_lens
    return dt


def run_hf_static(model, prompts, out_lens, batch_size: int) -> float:
    """transformers generate in static batches (left-padded), each batch to its longest request."""
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        new = max(out_lens[i : i + batch_size])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)  # fmt: skip
    return time.perf_counter() - t0


def run_hf_generate_batch(model, prompts, out_lens) -> float | None:
    """transformers' continuous batching; every request runs to the longest length asked."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max(out_lens), do_sample=False, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    try:
        model.generate_batch(inputs=prompts, generation_config=cfg)
    except Exception as exc:  # an API that moves between releases: report, don't die
        print(f"  generate_batch failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return time.perf_counter() - t0


def compare_backends(backends: list[str], dtypes: list[str], kinds: list[str], args) -> list[dict]:
    """The engine alone on each attention backend, same prompts, in one process."""
    results = []
    for dtype in dtypes:
        for kind in kinds:
            prompts, out_lens = workload(kind, args.num_prompts)
            useful = sum(out_lens)
            for backend in backends:
                llm = LLM("smollm2-135m", dtype=dtype, kv_cache_memory=args.kv_cache_memory,
                          attention_backend=backend, quantization="none", quiet=True)  # fmt: skip
                resolved = llm.stats()["engine"]["attention_backend"]
                run_engine(llm, *workload("fixed", 4, seed=99))  # warm-up
                walls, cpus = [], []
                for _ in range(args.repeats):
                    c0 = time.process_time()
                    walls.append(run_engine(llm, prompts, out_lens))
                    cpus.append(time.process_time() - c0)
                # tokens per CPU-second of this process: on a shared machine, less disturbed than wall time
                row = {"dtype": dtype, "workload": kind, "attention_backend": resolved,
                       "engine_tok_s": useful / min(walls), "engine_tok_per_cpu_s": useful / min(cpus)}  # fmt: skip
                results.append(row)
                first = next(r for r in results if r["dtype"] == dtype and r["workload"] == kind)
                print(
                    f"{dtype:9} {kind:8} engine[{resolved}] {row['engine_tok_s']:7.1f} tok/s"
                    f" ({row['engine_tok_s'] / first['engine_tok_s']:.2f}x of {first['attention_backend']}),"
                    f" {row['engine_tok_per_cpu_s']:7.1f} tok/CPU-s"
                    f" ({row['engine_tok_per_cpu_s'] / first['engine_tok_per_cpu_s']:.2f}x)",
                    flush=True,
                )
                del llm
    return results


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    ap.add_argument("--workload", choices=["fixed", "variable", "both"], default="both")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--generate-batch-prompts", type=int, default=32,
                    help="prompts for transformers generate_batch (slow on CPU; 0 skips it)")  # fmt: skip
    ap.add_argument("--kv-cache-memory", default="3GiB")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument(
        "--attention-backend", default="auto", help="auto, cpu, triton, reference, or a list: cpu,reference"
    )
    ap.add_argument("--repeats", type=int, default=1, help="with a list of backends: runs of each, the best kept")
    return ap.parse_args()


def measure(llm: LLM, hf, dtype: str, kind: str, args: argparse.Namespace) -> dict:
    """One (dtype, workload) row: the engine against transformers' generate on the same prompts."""
    prompts, out_lens = workload(kind, args.num_prompts)
    useful = sum(out_lens)
    row = {"dtype": dtype, "workload": kind, "prompts": len(prompts), "output_tokens": useful}
    row["engine_s"] = run_engine(llm, prompts, out_lens)
    row["hf_static_s"] = run_hf_static(hf, prompts, out_lens, args.hf_batch_size)
    row["engine_tok_s"] = useful / row["engine_s"]
    row["hf_static_tok_s"] = useful / row["hf_static_s"]
    if args.generate_batch_prompts:
        gp, gl = prompts[: args.generate_batch_prompts], out_lens[: args.generate_batch_prompts]
        gb = run_hf_generate_batch(hf, gp, gl)
        eng = run_engine(llm, gp, gl)
        row["gb_prompts"] = len(gp)
        row["hf_generate_batch_tok_s"] = sum(gl) / gb if gb else None
        row["engine_same_prompts_tok_s"] = sum(gl) / eng
    row["preemptions"] = llm.stats()["scheduler"]["preemptions_total"]
    return row


def print_row(row: dict) -> None:
    gbs = row.get("hf_generate_batch_tok_s")
    print(
        f"{row['dtype']:9} {row['workload']:8} engine {row['engine_tok_s']:7.1f} tok/s | transformers generate "
        f"{row['hf_static_tok_s']:7.1f} tok/s | ratio {row['engine_tok_s'] / row['hf_static_tok_s']:.2f}x"
        + (
            f" || on {row['gb_prompts']} prompts: engine {row['engine_same_prompts_tok_s']:.1f} vs "
            f"generate_batch {gbs:.1f} tok/s, ratio {row['engine_same_prompts_tok_s'] / gbs:.2f}x"
            if gbs
            else ""
        ),
        flush=True,
    )


def main() -> None:
    args = parse_args()
    from transformers import AutoModelForCausalLM

    from engine.model.loader import resolve_model_dir

    model_dir = resolve_model_dir("smollm2-135m")
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    kinds = ["fixed", "variable"] if args.workload == "both" else [args.workload]
    results = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; SmolLM2-135M; {args.num_prompts} prompts")
    if "," in args.attention_backend:
        results = compare_backends(args.attention_backend.split(","), dtypes, kinds, args)
        dtypes = []
    for dtype in dtypes:
        llm = LLM("smollm2-135m", dtype=dtype, kv_cache_memory=args.kv_cache_memory,
                  attention_backend=args.attention_backend, quantization="none", quiet=True)  # fmt: skip
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        # warm both paths once so one-time costs (allocator, kernels) do not land in the figures
        run_engine(llm, *workload("fixed", 4, seed=99))
        run_hf_static(hf, *workload("fixed", 4, seed=99), 4)
        for kind in kinds:
            results.append(measure(llm, hf, dtype, kind, args))
            print_row(results[-1])
        del llm, hf
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
