"""GGUF weights kept quantized against our de-quantized bf16 and fp32, and llama.cpp on the same file.

    .venv/bin/python benchmarks/quant.py                          # SmolLM2 Q4_1: 1 and 64 sequences, all engines
    .venv/bin/python benchmarks/quant.py --sequences 1 --rounds 3 # runs alternated, best and median
    .venv/bin/python benchmarks/quant.py --engines quant,bf16     # a subset
    .venv/bin/python benchmarks/quant.py --engines quant-bf16,bf16 --sequences 64 --rounds 8 --one-process
    .venv/bin/python benchmarks/random_gguf.py --shape llama3-8b --out /tmp/llama3-8b-q4_k_m.gguf
    .venv/bin/python benchmarks/quant.py --model /tmp/llama3-8b-q4_k_m.gguf --engines quant-bf16,llama-server \
        --sequences 1,16 --prompt-len 64 --max-tokens 16 --kv-cache-memory 8GiB

Each engine runs in its own process, one at a time (two OpenMP processes on 2 cores ruin each
other's figures), or with `--one-process` our engines side by side in one process, run in turn round
after round (a VM drifts by more between processes than between neighbouring runs); on the same
prompts: `--sequences` prompts of `--prompt-len` random token ids, each generating `--max-tokens`
greedy tokens (ignore_eos), all submitted at once; a short warm-up first.
  quant     ours, the GGUF's weights in their blocks (`quantization="auto"`: Q4_1 projections, Q8_0 head),
            fp32 activations (the default); the blocks are repacked at load into tiles of 16 columns
            (the same bytes: csrc/quant_packed.cpp) that decode multiplies in fp32, 16 or (AVX2) 8 at a time
  quant-bf16  the same blocks in a bf16 model (`dtype="bfloat16"`): bf16 activations; on AMX, prefill and
            batched decode multiply bf16 tiles read out of the packed blocks
  bf16      ours, the same file de-quantized to bf16 (`quantization="none"`)
  fp32      ours, de-quantized to fp32
  llama-server  llama.cpp's own server on the same file (`make llamacpp` builds it; benchmarks/llamacpp_peer.py),
            2 threads, a slot per sequence: every prompt sent at once as token ids, timed from the first
            send to the last answer
  llamacpp  llama.cpp through node-llama-cpp 3.21.1 from npm (a prebuilt llama.cpp, no build: a quick
            look; installed once under $KVTOP_CACHE/node-llama-cpp: `npm install node-llama-cpp@3.21.1`
            there), CPU, 2 threads, one sequence at a time
Reported: output tokens per second of wall time (prompt processing included), best and median over
`--rounds`, and the first engine's ratio to each other one: best to best, and run by run (the median of
each round's ratio, lowest and highest beside it); for ours, the last run's
seconds and the part of them that went to prompt tokens (the engine's split: a step's time shared
among its tokens). Only meaningful on a quiet machine (load < 1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {
    "quant": ("float32", "auto"),
    "quant-bf16": ("bfloat16", "auto"),  # the blocks with bf16 activations (AMX for many rows, where present)
    "bf16": ("bfloat16", "none"),
    "fp32": ("float32", "none"),
}
NODE_LLAMA_CPP = "node-llama-cpp@3.21.1"


def prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 49152) for _ in range(length)] for _ in range(n)]


def load_ours(name: str, model: str, n: int, kv: str | None):
    """One of our engines, loaded and warmed up; with the seconds its load took."""
    from engine import LLM, SamplingParams

    dtype, quantization = OURS[name]
    t0 = time.perf_counter()
    llm = LLM(
        model,
        dtype=dtype,
        quantization=quantization,
        kv_cache_memory=kv or ("1GiB" if n > 8 else "256MiB"),
        enable_prefix_caching=False,
        quiet=True,
    )
    load_seconds = time.perf_counter() - t0
    llm.generate(prompts(2, 16), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    return llm, load_seconds


def time_ours(llm, n: int, prompt_len: int, max_tokens: int, load_seconds: float) -> dict:
    """One timed generate of every prompt on a loaded engine."""
    import resource

    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    work = prompts(n, prompt_len)
    counters = llm.engine.metrics.counters
    prefill_before = counters.prefill_seconds
    t0 = time.perf_counter()
    outs = llm.generate(work, params)
    seconds = time.perf_counter() - t0
    memory = llm.stats()["memory"]
    return {
        "tokens": sum(len(o.token_ids) for o in outs),
        "seconds": seconds,
        # the engine's own split: each step's time shared among its tokens, prompt tokens' share here
        "prefill_seconds": counters.prefill_seconds - prefill_before,
        "weights": memory["weights"],
        # bf16 on AMX (or bf16 panels) also holds oneDNN's copy of the projections for long prefill steps
        "prefill_copy": memory.get("prefill_copy", 0),
        "format": memory["weights_format"],
        "kv": memory["kv"],
        "load_seconds": load_seconds,
        "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def run_ours(names: list[str], args: argparse.Namespace, n: int) -> dict[str, list[dict]]:
    """In this process (the child): load every engine named, then `--rounds` timed runs of each in turn
    (one engine and one run unless --one-process)."""
    loaded = {name: load_ours(name, args.model, n, args.kv_cache_memory) for name in names}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for name in in_turn(names, args.rounds):  # the parent passes --rounds with --one-process only
        llm, load_seconds = loaded[name]
        runs[name].append(time_ours(llm, n, args.prompt_len, args.max_tokens, load_seconds))
    return runs


def in_turn(names: list[str], rounds: int):
    """The names round after round, every other round backwards (A B, B A, ...): drift falls on both alike."""
    for r in range(rounds):
        yield from names if r % 2 == 0 else names[::-1]


def tensor_bytes(gguf: Path) -> int:
    """The file's tensors' bytes (what resident weights are held against)."""
    from engine.model.gguf_quant import read_index

    return sum(t.n_bytes for t in read_index(gguf).tensors.values())


def node_llama_cpp_dir() -> Path | None:
    """Where node-llama-cpp is installed (with the driver script beside it), or None."""
    from kvtop.protocol.paths import cache_dir

    home = cache_dir() / "node-llama-cpp"
    if not (home / "node_modules" / "node-llama-cpp").exists():
        return None
    shutil.copy(ROOT / "benchmarks" / "llamacpp_node.mjs", home / "llamacpp_node.mjs")
    return home


def gguf_path(model: str) -> Path:
    """The GGUF file behind `model`: a known name's (fetched once) or the path given."""
    from engine.model.default import KNOWN_MODELS, fetch_gguf

    return fetch_gguf(*KNOWN_MODELS[model]) if model in KNOWN_MODELS else Path(model)


def run_llamacpp(model: str, n: int, prompt_len: int, max_tokens: int) -> dict | None:
    home = node_llama_cpp_dir()
    if home is None or shutil.which("node") is None:
        print(f"llamacpp: skipped (node and `npm install {NODE_LLAMA_CPP}` in $KVTOP_CACHE/node-llama-cpp)")
        return None
    gguf = gguf_path(model)
    cmd = ["node", "llamacpp_node.mjs", str(gguf), str(n), str(prompt_len), str(max_tokens), "2"]
    proc = subprocess.run(cmd, cwd=home, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        print(f"llamacpp: failed ({proc.stderr.strip().splitlines()[-1:]})")
        return None
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "weights": gguf.stat().st_size, "format": "GGUF file"}


def run_llama_server(model: str, n: int, prompt_len: int, max_tokens: int) -> dict | None:
    from llamacpp_peer import MISSING, complete_all, llama_server, serving

    if llama_server() is None:
        print(f"llama-server: skipped ({MISSING})")
        return None
    gguf, work = gguf_path(model), prompts(n, prompt_len)
    with serving(gguf, n, prompt_len + max_tokens) as url:
        complete_all(url, [work[0][:16]], [4])  # warm-up
        t0 = time.perf_counter()
        answers = complete_all(url, work, [max_tokens] * n)
        seconds = time.perf_counter() - t0
    return {"tokens": sum(map(len, answers)), "seconds": seconds, "weights": gguf.stat().st_size, "format": "GGUF file"}


def child(engines: list[str], args: argparse.Namespace, n: int) -> dict[str, list[dict]]:
    """Runs in a fresh process: one engine's (llama-server's: its own), or with --one-process all of ours."""
    if engines == ["llama-server"]:
        result = run_llama_server(args.model, n, args.prompt_len, args.max_tokens)
        return {"llama-server": [result] if result else []}
    if engines == ["llamacpp"]:
        result = run_llamacpp(args.model, n, args.prompt_len, args.max_tokens)
        return {"llamacpp": [result] if result else []}
    cmd = [sys.executable, __file__, "--child", ",".join(engines), "--model", args.model, "--sequences", str(n)]
    cmd += ["--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", args.kv_cache_memory]
    if args.one_process:
        cmd += ["--one-process", "--rounds", str(args.rounds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if proc.returncode != 0:
        print(f"{','.join(engines)}: failed\n{proc.stderr[-2000:]}")
        return {e: [] for e in engines}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def paired_ratios(first: list[float], other: list[float]) -> str:
    """The first engine's rate over the other's, run by run (the runs taken in turn): median (lowest-highest)."""
    ratios = [a / b for a, b in zip(first, other)]
    if len(ratios) < 2:
        return ""
    return f"; run by run {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def collect(engines: list[str], args: argparse.Namespace, n: int) -> dict[str, list[dict]]:
    """Every engine's `--rounds` runs at n sequences: a process a run, taken in turn, or --one-process's one."""
    if args.one_process:
        return child(engines, args, n)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for engine in in_turn(engines, args.rounds):
        runs[engine] += child([engine], args, n)[engine]
    return runs


def report(n: int, runs: dict[str, list[dict]], args: argparse.Namespace, tensors: int) -> None:
    """The table of one sequence count: tok/s best and median, weights held, the first engine's ratios."""
    engines = list(runs)
    rates = {e: [run["tokens"] / run["seconds"] for run in runs[e]] for e in engines}
    info = {e: runs[e][-1] for e in engines if runs[e]}
    where = "one process, in turn" if args.one_process else "a process a run"
    print(f"\n{n} sequence(s) x {args.prompt_len}-token prompt -> {args.max_tokens} tokens, output tok/s ({where}):")
    first = engines[0]  # the ratios: the first engine named against each other one, best against best
    base = max(rates[first] or [0.0]) or None
    for engine in engines:
        if not rates[engine]:
            continue
        best, median = max(rates[engine]), statistics.median(rates[engine])
        ratio = ""
        if base and engine != first:
            ratio = f"{first} / {engine} = {base / best:.2f}x" + paired_ratios(rates[first], rates[engine])
        weights = f"{info[engine]['weights'] / 2**20:.1f} MiB {info[engine]['format']}"
        if copy := info[engine].get("prefill_copy"):
            weights += f" + {copy / 2**20:.1f} MiB prefill copy"
        print(f"  {engine:12s} best {best:8.2f}  median {median:8.2f}   weights {weights:58s} {ratio}")
        if "kv" in info[engine]:
            i = info[engine]
            shared = " (the process's: every engine)" if args.one_process else ""
            held = i["weights"] + i.get("prefill_copy", 0)
            print(f"               weights {held / tensors:.3f}x the file's tensor bytes, KV "
                  f"{i['kv'] / 2**30:.2f} GiB, loaded in {i['load_seconds']:.1f} s, "
                  f"peak resident {i['max_rss'] / 2**30:.2f} GiB{shared}; last run {i['seconds']:.2f} s, "
                  f"{i['prefill_seconds']:.2f} of them prefill")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="quant-bf16,quant,bf16,fp32,llama-server,llamacpp")
    ap.add_argument("--model", default="smollm2-135m", help="a known name or a .gguf file")
    ap.add_argument("--kv-cache-memory", help="ours: the KV cache's size (default 256MiB, 1GiB past 8 sequences)")
    ap.add_argument("--sequences", default="1,64", help="comma-separated sequence counts")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="runs of every engine, taken in turn")
    ap.add_argument(
        "--one-process",
        action="store_true",
        help="our engines loaded side by side in one process and run in turn, so that each run's ratio "
        "is taken between neighbours: the machine's drift between processes cancels (ours only)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_ours(args.child.split(","), args, int(args.sequences))))
        return
    engines = args.engines.split(",")
    if unknown := [e for e in engines if e not in OURS and e not in ("llama-server", "llamacpp")]:
        sys.exit(f"quant.py: unknown engine {unknown[0]!r} (ours: {', '.join(OURS)}; peers: llama-server, llamacpp)")
    if args.one_process and (peers := [e for e in engines if e not in OURS]):
        sys.exit(f"quant.py: --one-process runs our engines only, not {peers[0]}")
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} at start")
    tensors = tensor_bytes(gguf_path(args.model))
    print(f"model: {args.model}, its tensors {tensors / 2**20:.1f} MiB")
    for n in (int(s) for s in args.sequences.split(",")):
        report(n, collect(engines, args, n), args, tensors)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
