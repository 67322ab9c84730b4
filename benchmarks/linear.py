"""The CPU engine's linear layers against the GEMM libraries they replace, on SmolLM2-135M's shapes
(30 layers of qkv, o, gate/up and down projections, each layer its own weight, and the logits).

    .venv/bin/python benchmarks/linear.py                    # bf16 (AMX) and fp32, 1..2,048 rows
    .venv/bin/python benchmarks/linear.py --dtype float32 --rows 1,4,16
    .venv/bin/python benchmarks/linear.py --cold --rows 16,32,64,256   # weights from DRAM, as in the engine

bf16: our AMX tile kernel (engine/kernels/csrc/amx_linear.cpp) where the CPU has AMX, else our bf16
panel kernel (csrc/bf16_gemm.cpp) where it has AVX512-BF16, against oneDNN's packed GEMM (what
`KVTOP_PACKED_LINEAR=onednn` uses). fp32: our panel kernel (csrc/fp32_gemm.cpp, the weights packed
by engine/model/panel_linear.py) against `F.linear` (MKL's sgemm). The best of `--repeats` passes over all the layers; GB/s is the weights'
bytes over that time (a decode step is bound by how fast they stream).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.kernels import cpu
from engine.model.packed_linear import _pack_tiles
from engine.model.panel_linear import pack_panels

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "logits": (49152, 576)}


def onednn_linear(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def amx_linear_for(name: str):
    return functools.partial(lambda x, w, n: torch.ops.kvtop_cpu.amx_linear(x, w, None, n), n=SHAPES[name][0])


def bf16_gemm_for(name: str):
    return functools.partial(lambda x, w, n: torch.ops.kvtop_cpu.bf16_gemm(x, w, None, n), n=SHAPES[name][0])


def mkl_linear(x, w):
    return F.linear(x, w)


def fp32_gemm_for(name: str):
    return functools.partial(lambda x, w, n: torch.ops.kvtop_cpu.fp32_gemm(x, w, None, n), n=SHAPES[name][0])


def best(fn, weights, x, repeats: int) -> float:
    for w in weights:
        fn(x, w)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            fn(x, w)
        times.append(time.perf_counter() - t)
    return min(times)


def cold_bf16(rows_list: list[int], repeats: int) -> None:
    """Our AMX kernel as a decode step sees it: layer by layer (qkv, o, gate/up, down), each layer's
    weights its own, and between layers a read of 14 MiB — one layer's K/V of 64 sequences x 300
    tokens — so the weights come from DRAM as in the engine, not from the L3 a loop over one
    projection's 30 weights finds them in. Only the projections are timed."""
    torch.manual_seed(0)
    layers = [{n: _pack_tiles(torch.randn(*SHAPES[n]).to(torch.bfloat16)) for n in SHAPES if n != "logits"}]
    layers += [{n: _pack_tiles(torch.randn(*SHAPES[n]).to(torch.bfloat16)) for n in layers[0]} for _ in range(29)]
    logits = _pack_tiles(torch.randn(*SHAPES["logits"]).to(torch.bfloat16))
    kv = [torch.ones(7 << 20, dtype=torch.bfloat16) for _ in layers]
    nbytes = sum(w.numel() * 2 for layer in layers for w in layer.values()) + logits.numel() * 2
    print(f"\nbfloat16, ours, layer by layer with a K/V read between ({nbytes / 2**20:.0f} MiB of weights)")
    print(f"{'rows':>6} {'ours ms':>9} {'our GB/s':>9}")
    for rows in rows_list:
        xs = {n: torch.randn(rows, SHAPES[n][1]).to(torch.bfloat16) for n in SHAPES}
        times = []
        for _ in range(repeats + 1):  # the first pass warms up
            spent = 0.0
            for layer, cache in zip(layers, kv, strict=True):
                cache.sum()
                t = time.perf_counter()
                for n, w in layer.items():
                    torch.ops.kvtop_cpu.amx_linear(xs[n], w, None, SHAPES[n][0])
                spent += time.perf_counter() - t
            t = time.perf_counter()
            torch.ops.kvtop_cpu.amx_linear(xs["logits"], logits, None, SHAPES["logits"][0])
            times.append(spent + time.perf_counter() - t)
        t_ours = min(times[1:])
        print(f"{rows:6d} {t_ours * 1e3:9.2f} {nbytes / t_ours / 1e9:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16,float32", help="comma-separated: bfloat16,float32")
    ap.add_argument("--rows", default="1,4,16,32,64,256,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="bf16 AMX only, weights from DRAM as in a decode step")
    args = ap.parse_args()
    if not cpu.load():
        sys.exit("the CPU kernel extension could not be built here")
    ops = torch.ops.kvtop_cpu
    print(f"{torch.get_num_threads()} threads")
    if args.cold:
        if not ops.amx_supported():
            sys.exit("--cold measures the AMX kernel: this CPU has no AMX")
        cold_bf16([int(r) for r in args.rows.split(",")], args.repeats)
        return
    for dtype in args.dtype.split(","):
        amx = ops.amx_supported()
        if dtype == "bfloat16" and not (amx or ops.bf16_linear_supported()):
            print("bfloat16: this CPU has neither AMX nor AVX512-BF16 (the engine uses oneDNN's packed GEMM)")
            continue
        if dtype == "float32" and not ops.fp32_linear_supported():
            print("float32: no AVX-512 in this build (the engine uses nn.Linear)")
            continue
        torch.manual_seed(0)
        dt = getattr(torch, dtype)
        layers = {n: [torch.randn(*s).to(dt) for _ in range(1 if n == "logits" else 30)] for n, s in SHAPES.items()}
        nbytes = sum(w.numel() * w.element_size() for ws in layers.values() for w in ws)
        if dtype == "bfloat16":
            lib = "oneDNN packed"
            theirs = {n: [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws] for n, ws in layers.items()}
            pack = _pack_tiles if amx else pack_panels
            ours = {n: [pack(w) for w in ws] for n, ws in layers.items()}
            their_fn, our_fn_for = onednn_linear, amx_linear_for if amx else bf16_gemm_for
        else:
            lib, theirs = "MKL sgemm", layers
            ours = {n: [pack_panels(w) for w in ws] for n, ws in layers.items()}
            their_fn, our_fn_for = mkl_linear, fp32_gemm_for

        print(f"\n{dtype}: ours vs {lib}, SmolLM2-135M's linears ({nbytes / 2**20:.0f} MiB of weights)")
        flop = 2 * sum(w.numel() for ws in layers.values() for w in ws)  # per row
        print(
            f"{'rows':>6} {lib + ' ms':>16} {'ours ms':>9} {'their GB/s':>11} {'our GB/s':>9} {'our GF/s':>9} {'speedup':>8}"
        )
        for rows in (int(r) for r in args.rows.split(",")):
            t_theirs = t_ours = 0.0
            for n in SHAPES:
                x = torch.randn(rows, SHAPES[n][1]).to(dt)
                t_theirs += best(their_fn, theirs[n], x, args.repeats)
                t_ours += best(our_fn_for(n), ours[n], x, args.repeats)
            print(f"{rows:6d} {t_theirs * 1e3:16.2f} {t_ours * 1e3:9.2f} {nbytes / t_theirs / 1e9:11.1f} "
                  f"{nbytes / t_ours / 1e9:9.1f} {flop * rows / t_ours / 1e9:9.0f} {t_theirs / t_ours:7.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
