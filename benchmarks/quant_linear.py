"""The quantized kernel (csrc/quant_gemm.cpp) against our dense fp32 and bf16 kernels, layer by layer
on SmolLM2-135M's shapes (30 layers of qkv, o, gate/up, down, and the logits), the best of `--repeats`
passes: where a decode step's time goes, without the engine around it (less noisy than
benchmarks/quant.py on a busy machine).

    .venv/bin/python benchmarks/quant_linear.py                       # Q4_1, Q8_0; 1, 4, 64, 256 rows
    .venv/bin/python benchmarks/quant_linear.py --formats Q4_1 --rows 1 --threads 1

"Q4_1 AMX" is the same blocks with bf16 activations on AMX (csrc/amx_linear.cpp's amx_quant_linear),
where the CPU has it; "Q4_1 packed" the blocks repacked at load (csrc/quant_packed.cpp, where the
CPU has AVX-512 with BF16) with fp32 activations, "Q4_1 packed bf16" with bf16 ones (up to 4 rows the
packed decode kernel, above it AMX tiles read from the packed blocks, or fp32 panels). GB/s is the weights' bytes (as each path holds them) over the time: a decode step streams them once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.linear import SHAPES, amx_linear_for, best, bf16_gemm_for, fp32_gemm_for
from engine.kernels import cpu
from engine.model.packed_linear import _pack_tiles
from engine.model.panel_linear import pack_panels
from engine.model.quant_linear import PACKED_OFFSET, packed_kernel_available


def quant_fn(fmt: GGMLQuantizationType, name: str):
    n = SHAPES[name][0]
    return lambda x, w: torch.ops.kvtop_cpu.quant_linear(x, w, int(fmt), n, None)


def packed_fn(fmt: GGMLQuantizationType, name: str):
    n = SHAPES[name][0]
    return lambda x, w: torch.ops.kvtop_cpu.quant_linear(x, w, int(fmt) + PACKED_OFFSET, n, None)


def quant_amx_fn(fmt: GGMLQuantizationType, name: str):
    n = SHAPES[name][0]
    return lambda x, w: torch.ops.kvtop_cpu.amx_quant_linear(x, w, int(fmt), n, None)


def timed(fn_for, weights: dict, rows: int, dtype: torch.dtype, repeats: int) -> float:
    return sum(best(fn_for(n), weights[n], torch.randn(rows, SHAPES[n][1]).to(dtype), repeats) for n in SHAPES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="Q4_1,Q8_0")
    ap.add_argument("--rows", default="1,4,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (cpu.load() and torch.ops.kvtop_cpu.quant_linear_supported()):
        sys.exit("the quantized kernel is not built on this CPU")
    amx = torch.ops.kvtop_cpu.amx_supported()
    torch.manual_seed(0)
    dense = {n: [torch.randn(*s) * 0.05 for _ in range(1 if n == "logits" else 30)] for n, s in SHAPES.items()}
    paths = {"fp32": ({n: [pack_panels(w) for w in ws] for n, ws in dense.items()}, fp32_gemm_for, torch.float32)}
    if amx or torch.ops.kvtop_cpu.bf16_linear_supported():
        pack = _pack_tiles if amx else pack_panels
        bf16 = {n: [pack(w.bfloat16()) for w in ws] for n, ws in dense.items()}
        paths["bf16"] = (bf16, amx_linear_for if amx else bf16_gemm_for, torch.bfloat16)
    for name in args.formats.split(","):
        fmt = GGMLQuantizationType[name]
        blocks = {n: [torch.from_numpy(quantize(w.numpy(), fmt)) for w in ws] for n, ws in dense.items()}
        paths[name] = (blocks, lambda n, fmt=fmt: quant_fn(fmt, n), torch.float32)
        if amx:  # bf16 activations: the blocks de-quantized a group at a time into AMX tiles
            paths[f"{name} AMX"] = (blocks, lambda n, fmt=fmt: quant_amx_fn(fmt, n), torch.bfloat16)
        if packed_kernel_available():  # the same bytes in the decode kernel's tiles
            packed = {
                n: [torch.ops.kvtop_cpu.quant_pack(b, int(fmt), b.shape[0]) for b in bs] for n, bs in blocks.items()
            }
            paths[f"{name} packed"] = (packed, lambda n, fmt=fmt: packed_fn(fmt, n), torch.float32)
            paths[f"{name} packed bf16"] = (packed, lambda n, fmt=fmt: packed_fn(fmt, n), torch.bfloat16)
    print(f"{torch.get_num_threads()} threads; SmolLM2-135M's linears; ms per pass (GB/s of the weights as held)")
    print(f"{'rows':>6} " + " ".join(f"{p:>18}" for p in paths))
    for rows in (int(r) for r in args.rows.split(",")):
        cells = []
        for weights, fn_for, dtype in paths.values():
            held = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)
            t = timed(fn_for, weights, rows, dtype, args.repeats)
            cells.append(f"{t * 1e3:9.2f} ({held / t / 1e9:5.1f})")
        print(f"{rows:6d} " + " ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
