"""Paged attention on the CPU: the C++ kernels (`engine.kernels.cpu`, reading the KV blocks in
place) side by side with the torch reference (`engine.kernels.reference`: gather the blocks into a
contiguous copy, then SDPA), over the same caches, in one process.

    python benchmarks/cpu_attention.py [--seqs 64] [--context 384] [--layers 30] [--repeats 5]
        [--dtype float32|bfloat16] [--clock wall|cpu]

One "step" is what one decode step of the engine asks of attention: every layer's decode kernel
over its own cache (SmolLM2-135M's shapes: 9 query heads, 3 KV heads, head_dim 64, 30 layers,
block size 16), 64 sequences of 384 tokens with their blocks scattered at random. Rows: fp32
queries over an fp32, int8 and fp8_e4m3 cache; then one prefill (4 prompts of 256 new tokens over
a 128-token cached prefix) on the fp32 cache, by the C++ kernel (the backend itself sends chunks
this long to the reference's SDPA: see `SHORT_CHUNK` in engine/kernels/cpu.py). Times are the best of `--repeats` runs (the machine
may be shared: the best is the least disturbed); `x` is reference time over CPU-kernel time
(> 1: the kernel is faster); `max_err` guards against a fast wrong kernel.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.kernels import cpu
from engine.kernels import reference as ref

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}


def best_ms(fn, repeats: int, clock: str = "wall") -> float:
    now = CLOCK[clock]
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = now()
        fn()
        times.append(now() - t0)
    return min(times) * 1e3


def make_layers(kind: str, layers: int, num_blocks: int, gen: torch.Generator, dtype=torch.float32) -> list[tuple]:
    """Per layer: (k_cache, v_cache, k_scale, v_scale), filled through the reference store."""
    out = []
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    rows = torch.arange(num_blocks * BLOCK_SIZE)
    for _ in range(layers):
        k = torch.randn(num_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(num_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
        if kind == "auto":
            out.append((k.view(shape).to(dtype), v.view(shape).to(dtype), None, None))
            continue
        dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
        kc, vc = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        if kind == "int8":
            ks, vs = torch.empty(shape[:3]), torch.empty(shape[:3])
        else:
            ks, vs = (k.abs().max() / ref.FP8_MAX).view(1), (v.abs().max() / ref.FP8_MAX).view(1)
        ref.store_kv(k, v, kc, vc, rows, ks, vs)
        out.append((kc, vc, ks, vs))
    return out


def step(module, q, layers, tables, lens, cu=None) -> torch.Tensor:
    scale = HEAD_DIM**-0.5
    for k, v, ks, vs in layers:
        if cu is None:
            out = module.paged_decode_attention(q, k, v, tables, lens, scale, ks, vs)
        else:  # the C++ prefill kernel itself, not the backend's rule that sends long chunks to SDPA
            prefill = cpu.inplace_prefill_attention if module is cpu else module.paged_prefill_attention
            out = prefill(q, k, v, tables, cu, lens, scale, ks, vs)
    return out


def row(name: str, args: argparse.Namespace, layers, q, tables, lens, cu=None) -> None:
    t_ref = best_ms(lambda: step(ref, q, layers, tables, lens, cu), args.repeats, args.clock)
    t_cpu = best_ms(lambda: step(cpu, q, layers, tables, lens, cu), args.repeats, args.clock)
    err = (step(ref, q, layers[-1:], tables, lens, cu) - step(cpu, q, layers[-1:], tables, lens, cu)).abs().max()
    print(f"{name:<34} {t_ref:>9.2f} {t_cpu:>9.2f} {t_ref / t_cpu:>6.2f}x {err.item():>9.1e}", flush=True)


def prefill_row(args, layers, num_blocks: int, gen: torch.Generator, dtype, kind: str) -> None:
    """4 prompts of 256 new tokens over a 128-token cached prefix, in blocks of their own (any --context)."""
    seqs, cached, new = 4, 128, 256
    per_seq = -(-(cached + new) // BLOCK_SIZE)
    if seqs * per_seq > num_blocks - 1:
        print(f"prefill: skipped ({seqs} x {cached + new} tokens need more blocks than --seqs x --context give)")
        return
    tables = (torch.randperm(num_blocks - 1, generator=gen)[: seqs * per_seq] + 1).to(torch.int32).view(seqs, per_seq)
    lens = torch.full((seqs,), cached + new, dtype=torch.int32)
    cu = torch.arange(0, (seqs + 1) * new, new, dtype=torch.int32)
    q = torch.randn(seqs * new, HEADS, HEAD_DIM, generator=gen).to(dtype)
    row(f"prefill {seqs}x{new} over {cached} kv={kind}", args, layers, q, tables, lens, cu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="queries and an `auto` cache")
    ap.add_argument(
        "--clock",
        choices=list(CLOCK),
        default="wall",
        help="cpu: the process's CPU time (moves less on a busy machine)",
    )
    args = ap.parse_args()
    if not cpu.load():
        raise SystemExit("the CPU attention kernel could not be built here (see the line above)")
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-args.context // BLOCK_SIZE)
    num_blocks = args.seqs * per_seq + 1
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32).view(args.seqs, per_seq)
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(args.seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.layers} layers, {args.dtype}, "
        f"best of {args.repeats}, {args.clock} ms"
    )
    print(f"{'':<34} {'ref_ms':>9} {'cpu_ms':>9} {'x':>7} {'max_err':>9}")
    for kind in ("auto", "int8", "fp8"):
        layers = make_layers(kind, args.layers, num_blocks, gen, dtype)
        row(f"decode {args.seqs}x{args.context} kv={kind}", args, layers, q, tables, lens)
        if kind == "auto":
            prefill_row(args, layers, num_blocks, gen, dtype, kind)
        del layers


if __name__ == "__main__":
    main()
