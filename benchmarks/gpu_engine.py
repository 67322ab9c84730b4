"""The engine end to end on a CUDA GPU, beside transformers on the same GPU and the same weights.

    python benchmarks/gpu_engine.py [--model-dir DIR] [--json PATH] [--device cuda]

No weights travel: transformers makes random ones from a config, so the check runs on a GPU
machine that holds no model file. `--model-dir` is SmolLM2-135M's directory (default: the one
`make model` converts into ~/.cache/kvtop/models/smollm2-135m); its tokenizer and config.json are
read, never its weights.

1. Tokens. A tiny Llama (2 layers, hidden 64, random weights with peaky logits) in float32:
   16 prompts of 5..80 tokens, 24 greedy tokens each, our engine (Triton paged attention on CUDA)
   against transformers' greedy `generate`, one prompt at a time. For each KV cache kind (16-bit
   "auto", int8, fp8_e4m3) and a bfloat16 model, the batch runs twice so the second pass takes its
   prompts from the prefix cache; both passes are compared. float32 with the "auto" cache must
   match token for token (exit 1 otherwise); the others report agreement (quantization and bf16
   rounding change tokens, as on the CPU).
2. Speed. SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads, head_dim 64) with random weights
   in bfloat16: N prompts x 256 tokens -> 128 output tokens each (ignore_eos), our engine against
   transformers' batched greedy `generate`, output tokens per second and the ratio.

3. Where a decode step's time goes (`--parts profile`): N sequences of SmolLM2-135M's shape in
   steady decode, the wall time of a step against the GPU's busy time in it (torch.profiler), the
   kernels launched per step and the host ops that cost most. A step far longer than the GPU's
   busy time is bound by the host (launches, Python), not by the kernels. The batches of
   `--profile-torch-batches` are profiled a second time with the reference's torch element-wise
   ops in place of the Triton ones (KVTOP_TRITON_ELEMENTWISE=0): the launches and time they save.

`--device cpu` runs the same on the CPU (our C++ kernels), as a dry run of the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.1,  # peaky logits: greedy choices are not near-ties
    vocab_size=49152,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=False,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DEFAULT_MODEL_DIR = Path(os.environ.get("KVTOP_CACHE", Path.home() / ".cache" / "kvtop")) / "models" / "smollm2-135m"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_model(config, out_dir: Path, model_dir: Path, seed: int, dtype: torch.dtype = torch.float32) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out_dir / name)
    return out_dir


def hf_model(path: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def hf_greedy_one_by_one(model, prompts: list[list[int]], new: int, device: str) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            row = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)  # fmt: skip
            out.append(row[0, len(p) :].tolist())
    return out


def ours(path: Path, device: str, dtype: str, **kwargs):
    from engine import LLM

    return LLM(str(path), device=device, dtype=dtype, quiet=True, **kwargs)


def ours_generate(llm, prompts: list[list[int]], out_lens: list[int]) -> list[list[int]]:
    from engine import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in out_lens]
    return [o.token_ids for o in llm.generate(prompts, params)]


def tokens_check(model_dir: Path, device: str, tmp: Path) -> tuple[list[dict], bool]:
    from transformers import LlamaConfig

    path = make_model(LlamaConfig(**TINY), tmp / "tiny", model_dir, seed=0)
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randrange(5, 81))] for _ in range(16)]
    new = 24
    ref = hf_greedy_one_by_one(hf_model(path, torch.float32, device), prompts, new, device)
    rows, ok = [], True
    for dtype, kv in (("float32", "auto"), ("float32", "int8"), ("float32", "fp8_e4m3"), ("bfloat16", "auto")):
        llm = ours(path, device, dtype, kv_cache_dtype=kv, kv_cache_memory="64MiB")
        first = ours_generate(llm, prompts, [new] * len(prompts))
        hits_before = llm.stats()["prefix"]["hit_tokens"]
        second = ours_generate(llm, prompts, [new] * len(prompts))
        stats = llm.stats()
        backend = stats["engine"]["attention_backend"]
        hits = stats["prefix"]["hit_tokens"]
        row = {
            "dtype": dtype,
            "kv": kv,
            "backend": backend,
            "equal_first_pass": sum(a == b for a, b in zip(first, ref, strict=True)),
            "equal_second_pass": sum(a == b for a, b in zip(second, ref, strict=True)),
            "passes_equal": sum(a == b for a, b in zip(first, second, strict=True)),
            "prompts": len(prompts),
            "prefix_hit_tokens": hits - hits_before,
            "kernels": llm.engine.runner.kernels.__name__,  # the backend module that really ran
        }
        if dtype == "float32" and kv == "auto":
            row["must_match"] = True
            ok = ok and row["equal_first_pass"] == row["equal_second_pass"] == len(prompts)
        rows.append(row)
        print(
            f"tokens  {dtype:>8} kv={kv:<8} backend={backend:<9} equal to transformers: "
            f"{row['equal_first_pass']}/{len(prompts)} first pass, {row['equal_second_pass']}/{len(prompts)} "
            f"from the prefix cache ({row['prefix_hit_tokens']} tokens hit); passes equal {row['passes_equal']}/{len(prompts)}",
            flush=True,
        )
        del llm
    return rows, ok


def speed_check(model_dir: Path, device: str, tmp: Path, batches: list[int]) -> list[dict]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    path = make_model(config, tmp / "smollm2-shape", model_dir, seed=0, dtype=torch.bfloat16)
    rows = []
    rng = random.Random(13)
    for n in batches:
        prompts = [[rng.randrange(100, 49000) for _ in range(256)] for _ in range(n)]
        new = 128
        row = {"model": "smollm2-135m shape, random weights", "dtype": "bfloat16", "batch": n, "prompt": 256,
               "new": new}  # fmt: skip

        llm = ours(path, device, "bfloat16", max_num_seqs=max(n, 1), enable_prefix_caching=False,
                   kv_cache_memory="4GiB")  # fmt: skip
        ours_generate(llm, prompts[:2], [8] * len(prompts[:2]))  # compile and warm
        sync(device)
        t0 = time.perf_counter()
        got = ours_generate(llm, prompts, [new] * n)
        sync(device)
        row["ours_s"] = time.perf_counter() - t0
        assert all(len(t) == new for t in got)
        row["ours_tok_s"] = n * new / row["ours_s"]
        del llm

        model = hf_model(path, torch.bfloat16, device)
        ids = torch.tensor(prompts, device=device)
        with torch.no_grad():
            model.generate(ids[:2], max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            sync(device)
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            sync(device)
        row["transformers_s"] = time.perf_counter() - t0
        assert out.shape[1] == 256 + new
        row["transformers_tok_s"] = n * new / row["transformers_s"]
        row["ratio"] = row["ours_tok_s"] / row["transformers_tok_s"]
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        rows.append(row)
        print(
            f"speed   batch {n:>3} x 256 -> {new}: ours {row['ours_tok_s']:8.0f} tok/s ({row['ours_s']:.2f} s), "
            f"transformers {row['transformers_tok_s']:8.0f} tok/s ({row['transformers_s']:.2f} s), "
            f"ratio {row['ratio']:.2f}x",
            flush=True,
        )
    return rows


@contextlib.contextmanager
def elementwise_ops(torch_ops: bool) -> Iterator[None]:
    """KVTOP_TRITON_ELEMENTWISE set while an engine is built (its backend is chosen then)."""
    from engine.kernels import ELEMENTWISE_ENV

    before = os.environ.get(ELEMENTWISE_ENV)
    os.environ[ELEMENTWISE_ENV] = "0" if torch_ops else "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ELEMENTWISE_ENV]
        else:
            os.environ[ELEMENTWISE_ENV] = before


def profile_decode(
    model_dir: Path, device: str, tmp: Path, batch: int, torch_ops: bool = False, steps: int = 10
) -> dict:
    """`torch_ops`: the engine built with KVTOP_TRITON_ELEMENTWISE=0 (the reference's element-wise
    ops on the Triton backend; no effect on the CPU's)."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    path = tmp / "smollm2-shape"
    if not path.exists():
        from transformers import AutoConfig

        make_model(AutoConfig.from_pretrained(model_dir), path, model_dir, seed=0, dtype=torch.bfloat16)
    with elementwise_ops(torch_ops):
        llm = ours(path, device, "bfloat16", max_num_seqs=batch, enable_prefix_caching=False, kv_cache_memory="4GiB")
    engine = llm.engine
    rng = random.Random(5)
    for _ in range(batch):
        prompt = [rng.randrange(100, 49000) for _ in range(256)]
        engine.add_request(prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    while len(engine.step()) < batch:  # prefill, chunk by chunk, until every sequence decodes
        pass
    for _ in range(3):
        engine.step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    row = summarize_profile(prof, batch, steps, wall_ms)
    row["kernels"] = engine.runner.kernels.__name__  # ...triton+torch-elementwise: KVTOP_TRITON_ELEMENTWISE=0
    print(
        f"profile batch {batch:>3}, kernels {row['kernels']}: {wall_ms:.2f} ms a decode step "
        f"(no profiler), GPU busy {row['gpu_busy_ms_per_step']:.2f} ms of it, {row['kernels_per_step']:.0f} kernels "
        f"a step, {row['launches_per_step']:.0f} launches from the host",
        flush=True,
    )
    for k in row["top_kernels"]:
        print(f"  kernel {k['ms_per_step']:7.3f} ms/step {k['count_per_step']:6.0f}x  {k['name']}")
    for h in row["top_host_ops"]:
        print(f"  host   {h['self_cpu_ms_per_step']:7.3f} ms/step {h['calls_per_step']:6.0f}x  {h['name']}")
    return row


def summarize_profile(prof, batch: int, steps: int, wall_ms: float) -> dict:
    """Per step: the GPU's busy time and kernel count, the costliest kernels and host ops."""
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    # cudaLaunchKernel (torch), cuLaunchKernel / cuLaunchKernelEx (Triton), cudaLaunchKernelExC
    launches = [e for e in prof.events() if e.device_type.name == "CPU" and "LaunchKernel" in e.name]
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        by_kernel.setdefault(e.name, []).append(e.device_time / 1e3)
    top_kernels = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:8]
    top_host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    return {
        "batch": batch,
        "steps": steps,
        "wall_ms_per_step": wall_ms,
        "gpu_busy_ms_per_step": sum(e.device_time for e in kernels) / 1e3 / steps,
        "kernels_per_step": len(kernels) / steps,
        "launches_per_step": len(launches) / steps,
        "top_kernels": [
            {"name": n[:80], "count_per_step": len(t) / steps, "ms_per_step": sum(t) / steps} for n, t in top_kernels
        ],
        "top_host_ops": [
            {
                "name": e.key[:80],
                "calls_per_step": e.count / steps,
                "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            }
            for e in top_host
        ],
    }


def ints(text: str) -> list[int]:
    return [int(b) for b in text.split(",") if b.strip()]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                    help="SmolLM2-135M's directory: its tokenizer and config.json (weights are not read)")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64,256", help="comma-separated batch sizes for the speed part")
    ap.add_argument("--parts", default="tokens,speed,profile", help="which parts to run: tokens, speed, profile")
    ap.add_argument("--profile-batches", default="1,64", help="comma-separated batch sizes for the profile part")
    ap.add_argument("--profile-torch-batches", default="64",
                    help="batch sizes profiled again with torch's element-wise ops (KVTOP_TRITON_ELEMENTWISE=0)")  # fmt: skip
    ap.add_argument("--json", dest="json_path", help="write every row here")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_engine.py: needs a CUDA GPU and torch sees none (--device cpu for a dry run)")
    if not (args.model_dir / "tokenizer.json").exists() or not (args.model_dir / "config.json").exists():
        sys.exit(f"benchmarks/gpu_engine.py: no tokenizer.json and config.json in {args.model_dir}: "
                 "run `make model`, or pass --model-dir")  # fmt: skip

    import transformers

    result = {"command": " ".join(sys.argv), "device": args.device, "torch": torch.__version__,
              "transformers": transformers.__version__}  # fmt: skip
    if args.device.startswith("cuda"):
        import triton

        result["gpu"] = torch.cuda.get_device_name(0)
        result["triton"] = triton.__version__
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu-engine-") as tmp:
        # each part on its own: a failure in one still leaves the other's figures (a GPU lease is short)
        parts = {p.strip() for p in args.parts.split(",") if p.strip()}
        unknown = parts - {"tokens", "speed", "profile"}
        if unknown:
            sys.exit(
                f"benchmarks/gpu_engine.py: unknown part(s) {', '.join(sorted(unknown))}: use tokens, speed, profile"
            )
        runs = {
            "tokens": lambda: tokens_check(args.model_dir, args.device, Path(tmp)),
            "speed": lambda: speed_check(args.model_dir, args.device, Path(tmp), ints(args.batches)),
            "profile": lambda: (
                [profile_decode(args.model_dir, args.device, Path(tmp), b) for b in ints(args.profile_batches)]
                + [
                    profile_decode(args.model_dir, args.device, Path(tmp), b, torch_ops=True)
                    for b in ints(args.profile_torch_batches)
                ]
            ),
        }
        for name in ("tokens", "speed", "profile"):
            if name not in parts:
                continue
            try:
                if name == "tokens":
                    result["tokens"], tokens_ok = runs[name]()
                    ok = ok and tokens_ok
                else:
                    result[name] = runs[name]()
            except Exception:
                traceback.print_exc()
                result[f"{name}_error"], ok = traceback.format_exc(limit=-8), False
            if args.json_path:
                Path(args.json_path).write_text(json.dumps(result, indent=1))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json_path}")
    if not ok:
        sys.exit("benchmarks/gpu_engine.py: float32 tokens differ from transformers', or a part failed (see above)")


if __name__ == "__main__":
    main()
