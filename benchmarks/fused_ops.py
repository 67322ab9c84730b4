"""The C++ element-wise ops against torch's, inside one engine: the same process, model and `cpu`
attention, with the backend's `rms_norm`, `fused_add_rms_norm`, `rotary_embedding` and
`silu_and_mul` either the C++ ones (`fused`) or the reference's torch ops (`torch`), alternated,
best CPU time (`time.process_time`) of `--repeats`. Alternating in one process keeps a busy
machine's drift out of the ratio, which separate before/after runs of `cpu_step.py` do not.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fused_ops.py --dtype bfloat16   # and float32

Workloads (SmolLM2-135M, random token ids, greedy, ignore_eos, no prefix cache): one 2,048-token
prefill step (8 prompts × 256, one output token), and 64 sequences decoding 24 tokens after
16-token prompts.
"""

from __future__ import annotations

import argparse
import random
import time
import types

import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu, reference

OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")


def torch_ops_backend():
    """The cpu backend with the reference's element-wise ops in place of the C++ ones."""
    backend = types.SimpleNamespace(**{name: getattr(cpu, name) for name in dir(cpu) if not name.startswith("_")})
    for name in OPS:
        setattr(backend, name, getattr(reference, name))
    return backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(
        dtype=args.dtype, kv_cache_memory="1GiB", max_num_seqs=64, max_num_batched_tokens=2048,
        enable_prefix_caching=False, attention_backend="cpu", quantization="none", quiet=True,
    )  # fmt: skip
    assert llm.stats()["engine"]["attention_backend"] == "cpu", "the C++ kernels did not build"
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    workloads = {"prefill 8 x 256 (one 2,048-token step)": (8, 256, 1), "decode 64 seqs x 24 tokens": (64, 16, 24)}
    llm.generate(prompts(2, 8), greedy(2))  # warm-up
    backends = {"torch": torch_ops_backend(), "fused": cpu}
    for name, (n, length, out) in workloads.items():
        best = dict.fromkeys(backends, float("inf"))
        for _ in range(args.repeats):
            for label, backend in backends.items():
                llm.engine.runner.kernels = backend
                batch = prompts(n, length)
                t0 = time.process_time()
                llm.generate(batch, greedy(out))
                best[label] = min(best[label], time.process_time() - t0)
        print(
            f"{args.dtype}, {name}: torch ops {1e3 * best['torch']:.0f} CPU-ms, fused {1e3 * best['fused']:.0f} "
            f"CPU-ms ({100 * (1 - best['fused'] / best['torch']):.0f} % less)"
        )


if __name__ == "__main__":
    main()
