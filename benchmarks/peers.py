"""Our engine beside its peers on this machine: vLLM's CPU build, transformers' static `generate`, llama.cpp.

    .venv/bin/python benchmarks/peers.py                      # offline: fp32 and bf16, fixed and mixed workloads
    .venv/bin/python benchmarks/peers.py --dtype float32 --workload fixed
    .venv/bin/python benchmarks/peers.py --serving            # kvctl bench against kvctl serve, then vLLM's server
    .venv/bin/python benchmarks/peers.py --serving --rounds 4 # both servers up, the same loads alternated
    make bench-peers                                          # builds .venv-vllm and the model first

Offline, the SAME prompts (token ids) go through each engine in turn, each in its own process, never
two at once (two OpenMP processes on 2 cores ruin each other's figures), greedy, ignore_eos:
  ours          engine.LLM, attention backend `cpu` (the C++ paged attention)
  vllm          vLLM's CPU build (`.venv-vllm`, `make vllm`), `LLM.generate` on `TokensPrompt`s
  transformers  `generate` on one left-padded static batch of all the prompts
  llamacpp      llama.cpp's llama-server (`make llamacpp`) on the same GGUF file, its own Q4_1 weights
                whatever the dtype: a slot per prompt, all sent at once (benchmarks/llamacpp_peer.py)
`--quantization auto` runs ours on the file's Q4_1 blocks too (csrc/quant_packed.cpp), llama.cpp's
like for like.
Workloads: fixed, 64 prompts × 256 random token ids × 128 output tokens; mixed, the fixed workload of
`throughput.py` (64 prompts of 32–512 tokens × 128 output tokens). Each engine runs a 4-prompt warm-up
first. Reported: output tok/s (wall) and output tokens per CPU-second of the engine's process tree
(vLLM's engine core included), which moves less than wall time when others share the machine, and
how many requests' first 16 tokens equal ours (a check that the same weights and prompts went in).
Both engines run offline with their prefix caches off: a workload's prompts share no prefix, and a
repeat of the same prompts in one process would otherwise skip its prefill.

A shared machine moves by a third between identical runs, so one run of each engine can put a quiet
minute against a busy one. `--repeats N` runs each workload N times in each engine's process;
`--rounds N` starts every engine N times, taking them in turn (ours, vLLM, transformers, then the
other way round, ...), so that each engine has runs spread over the same stretch of time. The table
gives each engine's best and median tok/s over all its runs and the ratios of both.

    .venv/bin/python benchmarks/peers.py --dtype bfloat16 --workload fixed --rounds 3 --repeats 2

`--kv-cache-dtype int8` (or fp8_e4m3) runs ours with a quantized KV cache while the peers keep the
model's dtype: the trade side by side, its speed in the ratios and its accuracy in the agreement column.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS_PY = ROOT / ".venv" / "bin" / "python"
ENGINES = ("ours", "vllm", "transformers", "llamacpp")
AGREE_TOKENS = 16
SERVING_LOAD = "--num-prompts 32 --input-len 256 --output-len 128 --max-concurrency 16 --seed 0"


def vllm_python() -> Path | None:
    """The python of the venv `make vllm` installed ($KVTOP_VLLM_VENV, $KVTOP_CACHE/venv-vllm, or an older
    checkout's .venv-vllm), or None."""
    from kvtop.protocol.paths import cache_dir

    for venv in (os.environ.get("KVTOP_VLLM_VENV"), cache_dir() / "venv-vllm", ROOT / ".venv-vllm"):
        if venv and (Path(venv) / ".installed").exists():
            return Path(venv) / "bin" / "python"
    return None


def vllm_env(kv_gib: int) -> dict[str, str]:
    """vLLM's CPU build: both cores (its default reserves one), no AOT recompile at start, no network."""
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_USE_AOT_COMPILE": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process and all its descendants alive now."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


# ---- workers: one engine, one dtype, every workload; run in that engine's venv ---------------
def timed(generate, prompts, out_lens) -> dict:
    c0, t0 = tree_cpu_seconds(), time.perf_counter()
    tokens = generate(prompts, out_lens)
    wall, cpu = time.perf_counter() - t0, tree_cpu_seconds() - c0
    assert [len(t) for t in tokens] == out_lens, "an engine stopped early despite ignore_eos"
    n_tok = sum(out_lens)
    return {"wall_s": wall, "cpu_s": cpu, "tok_s": n_tok / wall, "tok_cpu_s": n_tok / cpu, "tokens": tokens,
            "load_after": os.getloadavg()[0]}  # fmt: skip


def ours_generator(spec: dict):
    from engine import LLM, SamplingParams

    llm = LLM("smollm2-135m", dtype=spec["dtype"], kv_cache_memory=f"{spec['kv_gib']}GiB",
              kv_cache_dtype=spec.get("kv_cache_dtype", "auto"), attention_backend=spec["attention_backend"],
              quantization=spec.get("quantization", "none"), enable_prefix_caching=False, quiet=True)  # fmt: skip

    def generate(prompts, out_lens):
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in out_lens]
        return [o.token_ids for o in llm.generate(prompts, params)]

    stats = llm.stats()
    return generate, {"attention_backend": stats["engine"]["attention_backend"], "kv_cache_dtype": stats["kv"]["dtype"],
                      "weights": stats["memory"]["weights_format"]}  # fmt: skip


def vllm_generator(spec: dict):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], max_model_len=1024, seed=0,
              enforce_eager=spec["enforce_eager"], enable_prefix_caching=False)  # fmt: skip

    def generate(prompts, out_lens):
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in out_lens]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    import vllm

    return generate, {"vllm": vllm.__version__, "enforce_eager": spec["enforce_eager"]}


def transformers_generator(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"])).eval()

    def generate(prompts, out_lens):
        width, new = max(map(len, prompts)), max(out_lens)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)  # fmt: skip
        return [row[width : width + m] for row, m in zip(out.tolist(), out_lens, strict=True)]

    return generate, {"threads": torch.get_num_threads()}


def llamacpp_generator(spec: dict):
    from llamacpp_peer import complete_all, serving

    from engine.model.default import KNOWN_MODELS, fetch_gguf

    gguf = fetch_gguf(*KNOWN_MODELS["smollm2-135m"])
    loads = spec["workloads"].values()
    slots, longest = max(len(p) for p, _ in loads), max(len(q) + max(m) for p, m in loads for q in p)
    server = contextlib.ExitStack()
    url = server.enter_context(serving(gguf, slots, longest))
    atexit.register(server.close)  # up until the worker exits, then stopped

    def generate(prompts, out_lens):
        return complete_all(url, prompts, out_lens)

    return generate, {"weights": "the GGUF file's (Q4_1, Q8_0)"}


def worker(kind: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    generators = {"ours": ours_generator, "vllm": vllm_generator, "transformers": transformers_generator,
                  "llamacpp": llamacpp_generator}  # fmt: skip
    generate, info = generators[kind](spec)
    result = {"engine": kind, "dtype": spec["dtype"], "info": info, "start_s": time.perf_counter() - t0}
    timed(generate, *spec["warmup"])
    result["runs"] = {name: [] for name in spec["workloads"]}
    for i in range(spec.get("repeats", 1)):
        for name, w in spec["workloads"].items():
            run = timed(generate, *w)
            if i:  # the first run's tokens are the ones compared; the others only must be as long
                run["tokens"] = None
            result["runs"][name].append(run)
    Path(out_path).write_text(json.dumps(result))


# ---- the driver --------------------------------------------------------------------------------
def workloads(names: list[str], n: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    import random

    sys.path.insert(0, str(Path(__file__).parent))
    from throughput import workload

    out = {}
    if "fixed" in names:
        rng = random.Random(13)
        out["fixed"] = ([[rng.randrange(100, 49000) for _ in range(256)] for _ in range(n)], [128] * n)
    if "mixed" in names:
        out["mixed"] = workload("fixed", n)
    return out


def run_worker(kind: str, spec: dict, timeout: float) -> dict:
    """One engine in its own process; its result, or the reason it has none."""
    py = vllm_python() if kind == "vllm" else OURS_PY
    env = vllm_env(spec["kv_gib"]) if kind == "vllm" else dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        spec_path, out_path, log_path = Path(tmp, "spec.json"), Path(tmp, "out.json"), Path(tmp, "log")
        spec_path.write_text(json.dumps(spec))
        load_before = os.getloadavg()[0]
        cmd = [str(py), __file__, "--worker", kind, "--spec", str(spec_path), "--out", str(out_path)]
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp, timeout=timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc != 0 or not out_path.exists():
            tail = log_path.read_text(errors="replace")[-2000:]
            return {"engine": kind, "dtype": spec["dtype"], "error": f"exit {rc}: {tail}"}
        result = json.loads(out_path.read_text())
    result["load_before"] = load_before
    return result


def agreement(ours: list[list[int]], other: list[list[int]]) -> int:
    return sum(a[:AGREE_TOKENS] == b[:AGREE_TOKENS] for a, b in zip(ours, other, strict=True))


def merge_rounds(results: list[dict]) -> list[dict]:
    """One entry per (dtype, engine): the runs of every round together, the first round's tokens."""
    merged: dict[tuple[str, str], dict] = {}
    for r in results:
        key = (r["dtype"], r["engine"])
        if key not in merged or "error" in merged[key]:
            merged[key] = {**r, "loads_before": [r.get("load_before", 0.0)]}
            continue
        if "error" in r:
            continue
        into = merged[key]
        into["loads_before"].append(r.get("load_before", 0.0))
        for name, runs in r["runs"].items():
            into["runs"][name] = into["runs"][name] + [{**run, "tokens": None} for run in runs]
    return list(merged.values())


def print_table(results: list[dict]) -> None:
    head = f"{'dtype':9} {'workload':8} {'engine':13} {'runs':>4} {'tok/s best':>10} {'median':>8} {'tok/CPU-s':>9} "
    head += f"{'ours/x best':>11} {'median':>7} {'CPU':>6} {'load':>9} {'first ' + str(AGREE_TOKENS) + ' = ours':>14}"
    print("\n" + head)
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        rows = [r for r in results if r["dtype"] == dtype]
        ours = next((r for r in rows if r["engine"] == "ours" and "runs" in r), None)
        for name in dict.fromkeys(n for r in rows for n in r.get("runs", {})):
            for r in rows:
                if "error" in r:
                    print(f"{dtype:9} {name:8} {r['engine']:13} failed: {r['error'].splitlines()[-1][:80]}")
                    continue
                runs = r["runs"][name]
                best, med = max(x["tok_s"] for x in runs), statistics.median(x["tok_s"] for x in runs)
                tpc = max(x["tok_cpu_s"] for x in runs)
                load = f"{min(r['loads_before']):4.1f}/{max(x['load_after'] for x in runs):<4.1f}"
                line = f"{dtype:9} {name:8} {r['engine']:13} {len(runs):4} {best:10.1f} {med:8.1f} {tpc:9.1f} "
                if ours and r is not ours:
                    o = ours["runs"][name]
                    o_best, o_med = max(x["tok_s"] for x in o), statistics.median(x["tok_s"] for x in o)
                    o_tpc = max(x["tok_cpu_s"] for x in o)
                    same = agreement(o[0]["tokens"], runs[0]["tokens"])
                    line += f"{o_best / best:10.2f}x {o_med / med:6.2f}x {o_tpc / tpc:5.2f}x "
                    line += f"{load} {same:>6}/{len(runs[0]['tokens'])}"
                else:
                    line += f"{'':11} {'':7} {'':6} {load}"
                print(line)
    print("tok/s: output tokens per wall second, best and median of the runs; tok/CPU-s: per CPU-second of the")
    print("engine's process tree (best); ours/x: our figure over that engine's; load: lowest 1-min load average")
    print("before the engine started / highest after a run")


def offline(args) -> list[dict]:
    from llamacpp_peer import llama_server  # here: a vLLM worker runs this file in vLLM's venv

    from engine.model.loader import resolve_model_dir

    model_dir = str(resolve_model_dir("smollm2-135m"))
    loads = workloads(args.workload, args.num_prompts)
    if args.output_len != 128:
        loads = {k: (p, [args.output_len] * len(p)) for k, (p, _) in loads.items()}
    warm = workloads(["fixed"], 4)["fixed"]
    results = []
    for rnd in range(args.rounds):
        for dtype in args.dtype:
            for kind in args.engines if rnd % 2 == 0 else args.engines[::-1]:
                if kind == "vllm" and vllm_python() is None:
                    results.append({"engine": kind, "dtype": dtype, "error": "no .venv-vllm: run `make vllm`"})
                    continue
                if kind == "llamacpp" and llama_server() is None:
                    results.append({"engine": kind, "dtype": dtype, "error": "no llama-server: run `make llamacpp`"})
                    continue
                spec = {"dtype": dtype, "model_dir": model_dir, "kv_gib": args.kv_gib, "workloads": loads,
                        "warmup": (warm[0], [8] * 4), "attention_backend": args.attention_backend,
                        "enforce_eager": args.enforce_eager, "repeats": args.repeats,
                        "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization}  # fmt: skip
                where = f"round {rnd + 1}/{args.rounds} " if args.rounds > 1 else ""
                what = f"{', '.join(loads)} × {args.repeats}"
                print(f"{where}{dtype} {kind}: running ({what})…", file=sys.stderr, flush=True)
                r = run_worker(kind, spec, args.timeout)
                results.append(r)
                print(f"  {'failed: ' + r['error'][-300:] if 'error' in r else 'done'}", file=sys.stderr, flush=True)
    results = merge_rounds(results)
    if args.kv_cache_dtype != "auto":
        print(f"\nours: the KV cache in {args.kv_cache_dtype} (the peers keep the model's dtype)")
    print_table(results)
    return results


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))  # throughput.py, llamacpp_peer.py, serving_peers.py beside this file
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    ap.add_argument("--workload", default="fixed,mixed", help="comma-separated: fixed,mixed")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: ours,vllm,transformers,llamacpp")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="offline: runs of each workload in each engine's process")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="offline: start every engine this many times, in turn; --serving: both servers up, the load alternated",
    )
    ap.add_argument("--kv-gib", type=int, default=3, help="KV cache of ours and vLLM (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--attention-backend", default="cpu", help="ours: cpu (default), reference, auto")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
                    help="ours: a quantized KV cache, to measure the trade (the peers keep the model's dtype)")  # fmt: skip
    ap.add_argument("--quantization", default="none", choices=["none", "auto"],
                    help="ours: none (here the default: vLLM and transformers run the de-quantized weights, "
                         "like for like) or auto, the GGUF's Q4_1 blocks as llama.cpp runs them")  # fmt: skip
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for one engine's process")
    ap.add_argument("--serving", action="store_true", help="kvctl bench against kvctl serve, then vLLM's server")
    ap.add_argument("--serving-load", default=SERVING_LOAD, help=f"kvctl bench options (default: {SERVING_LOAD})")
    ap.add_argument("--json", dest="json_path", help="write every figure here")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.spec, args.out)
    args.dtype, args.workload, args.engines = (s.split(",") for s in (args.dtype, args.workload, args.engines))
    if args.repeats < 1 or args.rounds < 1:
        ap.error("--repeats and --rounds must be at least 1")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    if args.serving:
        from serving_peers import serving

        results = serving(args)
    else:
        results = offline(args)
    print(f"load average {os.getloadavg()[0]:.2f} at the end", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
