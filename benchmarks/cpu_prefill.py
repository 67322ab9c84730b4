"""Prefill attention on the CPU, one layer, four ways over the same paged cache, in one process:
the reference (gather every sequence padded to the longest + a mask + SDPA: the cpu backend's long
chunks before), the C++ in-place kernel (`cpu.inplace_prefill_attention`, the backend's chunks of
at most SHORT_CHUNK new tokens), the SDPA path (`cpu_prefill.sdpa_prefill_attention`: per shape,
SDPA or our causal kernels on gathered K/V), the bf16-pairs op (`csrc/bf16_attention.cpp`, bf16
where the build has AVX512-BF16: one call, K/V read in place), and the backend itself
(`cpu.paged_prefill_attention`, which picks one of them).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_prefill.py [--repeats 3] [--runs 3]

SmolLM2-135M's heads (9 query, 3 KV, head_dim 64), block size 16, blocks in random order, strided
queries (a slice of a fused qkv projection, as the engine passes them), float32 and bfloat16
queries and cache. CPU time of the process (`time.process_time`, one thread): the machine may be
shared. Each cell is the best of `--repeats` calls in each of `--runs` passes over all cases (a
busy spell then spoils one pass, not a row). `max_err` is the backend's largest difference from the
reference.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.kernels import cpu
from engine.kernels import reference as ref
from engine.kernels.cpu_prefill import sdpa_prefill_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# name: (cached prefix, new tokens) per sequence
CASES = {
    "8 x 256 new, no prefix": [(0, 256)] * 8,
    "1 x 2,048 new": [(0, 2048)],
    "4 x 256 new over 128 cached": [(128, 256)] * 4,
    "64 x 32 new, no prefix": [(0, 32)] * 64,
    "16 prompts of 32..482 (all different)": [(0, 32 + 30 * i) for i in range(16)],
    "12 chunks of 20..273 over 0..296 cached": [(37 * i % 300, 20 + 23 * i) for i in range(12)],
    "64 prompts of 20..44 (25 lengths)": [(0, 20 + i % 25) for i in range(64)],
}
WAYS = {
    "reference": ref.paged_prefill_attention,
    "in-place C++": cpu.inplace_prefill_attention,
    "SDPA path": sdpa_prefill_attention,
    "bf16 pairs": lambda *a: torch.ops.kvtop_cpu.bf16_paged_prefill(*a),  # bf16 on AVX512-BF16 only
    "cpu backend": cpu.paged_prefill_attention,  # SHORT_CHUNK and `sdpa_pays` pick one of the two
}


def make_case(seqs: list[tuple[int, int]], dtype: torch.dtype, gen: torch.Generator) -> tuple:
    lens = [p + n for p, n in seqs]
    need = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(need) + 1
    k = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    start = 0
    for s, n in enumerate(need):
        tables[s, :n] = order[start : start + n]
        start += n
    q_lens = [n for _, n in seqs]
    q = torch.randn(sum(q_lens), HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(dtype)[:, :HEADS]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, tables, cu, torch.tensor(lens, dtype=torch.int32), HEAD_DIM**-0.5


def best_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if not cpu.load():
        raise SystemExit("the CPU attention kernel could not be built here")
    gen = torch.Generator().manual_seed(0)
    dtypes = (torch.float32, torch.bfloat16)
    cases = {(d, name): make_case(seqs, d, gen) for d in dtypes for name, seqs in CASES.items()}
    best: dict[tuple, float] = {}
    for _ in range(args.runs):
        for key, case in cases.items():
            for way, fn in WAYS.items():
                if not applies(way, key[0]):
                    continue
                ms = best_ms(lambda fn=fn, case=case: fn(*case), args.repeats)
                best[(*key, way)] = min(best.get((*key, way), ms), ms)
    print(f"{torch.get_num_threads()} thread(s), CPU ms per layer call, best of {args.runs} x {args.repeats}")
    print(f"| dtype | case | {' | '.join(WAYS)} | reference / backend | max_err |")
    print(f"|---|---|{'---:|' * (len(WAYS) + 2)}")
    for (dtype, name), case in cases.items():
        err = (cpu.paged_prefill_attention(*case).float() - ref.paged_prefill_attention(*case).float()).abs().max()
        cells = [best.get((dtype, name, way)) for way in WAYS]
        ratio = cells[0] / cells[-1]  # the path before over the backend now
        shown = " | ".join("–" if c is None else f"{c:.2f}" for c in cells)
        print(f"| {str(dtype)[6:]} | {name} | {shown} | {ratio:.2f}x | {err:.1e} |")


def applies(way: str, dtype: torch.dtype) -> bool:
    """The bf16-pairs op takes bf16 only, and only where the build has AVX512-BF16."""
    return way != "bf16 pairs" or (dtype == torch.bfloat16 and cpu.says("bf16_attention_supported"))


if __name__ == "__main__":
    main()
