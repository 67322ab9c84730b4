"""Paged-attention kernels on a CUDA GPU: the Triton decode and prefill kernels side by side with
torch SDPA over the same K/V gathered into contiguous tensors, and against the device's measured
copy bandwidth.

    python benchmarks/triton_kernels.py [--json PATH] [--quick] [--time-budget S]

Decode: batch {1, 16, 64, 256} x context {512, 4096, 32768}, bf16 queries, for SmolLM2-135M-like
heads (9 q / 3 kv / head_dim 64) and Llama-3-8B-like heads (32 q / 8 kv / head_dim 128); the 16-bit
cache ("auto") and, for the Llama shape, int8 and fp8_e4m3 caches. Prefill: a few (batch, cached
prefix, new tokens) sizes. Every sequence of a row has the same length; block tables are random
permutations of the cache's blocks.

Columns:
- `triton_ms`: median time (triton.testing.do_bench, CUDA events, L2 flushed between runs).
- `GB/s`: bytes of K/V (and int8 scales) the kernel must read, over its time; `%copy`: that rate
  over the device's copy bandwidth (a 4 GiB device-to-device copy, bytes read + written).
- `sdpa_ms`: torch SDPA (its own backend choice) over K/V already gathered into contiguous
  `[batch, heads, len, head_dim]` tensors: gather EXCLUDED. `sdpa+g_ms`: the same with the gather
  from the paged cache INCLUDED. Decode runs SDPA with each GQA group's query heads as the query
  rows of its KV head (no K/V repetition); prefill repeats K/V heads into the gathered tensors
  (counted in the gather) and uses a lower-right causal mask. For int8/fp8 rows SDPA runs on the
  bf16 cache of the same shape (what the quantized cache replaces).
- `x_sdpa`, `x_sdpa+g`: SDPA time over Triton time (> 1: Triton is faster).
- `max_err`: max |Triton - SDPA| on the bf16 rows (a guard against a fast wrong kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton

DEVICE = "cuda"
BLOCK_SIZE = 16
SHAPES = {"smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128)}  # (q heads, kv heads, head_dim)
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 32768)
QUANT_SHAPES = ("llama-8b",)
PREFILLS = ((1, 0, 2048), (4, 0, 1024), (1, 0, 8192), (8, 1024, 512))  # (batch, cached prefix, new)
MEMORY_FRACTION = 0.8  # of the free device memory a row may take


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bench_ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written."""
    src = torch.randn(1 << 31, device=DEVICE, dtype=torch.bfloat16)  # 4 GiB, far past the L2
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


class PagedKV:
    """A paged cache for `batch` sequences of `length` tokens, blocks in random order."""

    def __init__(self, batch: int, length: int, kv_heads: int, head_dim: int, kind: str) -> None:
        per_seq = cdiv(length, BLOCK_SIZE)
        num_blocks = batch * per_seq
        shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        self.k_scale = self.v_scale = None
        if kind == "auto":
            self.k_cache = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
            self.v_cache = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
        elif kind == "int8":
            self.k_cache = torch.randint(-127, 128, shape, device=DEVICE, dtype=torch.int8)
            self.v_cache = torch.randint(-127, 128, shape, device=DEVICE, dtype=torch.int8)
            self.k_scale = torch.rand(shape[:3], device=DEVICE) / 127
            self.v_scale = torch.rand(shape[:3], device=DEVICE) / 127
        else:
            self.k_cache = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            self.v_cache = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            self.k_scale = torch.tensor([1.0], device=DEVICE)
            self.v_scale = torch.tensor([1.0], device=DEVICE)
        order = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int64)
        self.block_tables = order.view(batch, per_seq).to(torch.int32)
        self.seq_lens = torch.full((batch,), length, device=DEVICE, dtype=torch.int32)
        self.batch, self.length, self.kv_heads, self.head_dim = batch, length, kv_heads, head_dim

    def read_bytes(self) -> int:
        """K/V bytes (and int8 scales) attention over every sequence must read."""
        tokens = self.batch * self.length
        per_token = 2 * self.kv_heads * self.head_dim * self.k_cache.element_size()
        if self.k_scale is not None and self.k_scale.dim() == 3:
            per_token += 2 * self.kv_heads * 4
        return tokens * per_token

    def gather(self, repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous bf16 `[batch, kv_heads * repeat, length, head_dim]` K and V."""
        tables = self.block_tables.long()
        out = []
        for cache in (self.k_cache, self.v_cache):
            x = cache[tables].view(self.batch, -1, self.kv_heads, self.head_dim)[:, : self.length]
            x = x.transpose(1, 2)
            if repeat > 1:
                x = x.repeat_interleave(repeat, dim=1)
            out.append(x.to(torch.bfloat16).contiguous())
        return out[0], out[1]


def cache_bytes(batch: int, length: int, kv_heads: int, head_dim: int, kind: str) -> int:
    elem = 2 if kind == "auto" else 1
    return 2 * batch * cdiv(length, BLOCK_SIZE) * BLOCK_SIZE * kv_heads * head_dim * elem


def fits(nbytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes <= MEMORY_FRACTION * free


def decode_row(tk, shape: str, kind: str, batch: int, length: int, copy_bps: float) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape]
    group = heads // kv_heads
    row = {"phase": "decode", "shape": shape, "kv": kind, "batch": batch, "context": length}
    # SDPA's part is the larger: a bf16 cache, its gathered copy, and the gather's temporaries
    need = max(
        cache_bytes(batch, length, kv_heads, head_dim, kind),
        cache_bytes(batch, length, kv_heads, head_dim, "auto") * 5 // 2,
    )
    if not fits(need):
        row["skipped"] = f"needs ~{need / 2**30:.0f} GiB"
        return row
    paged = PagedKV(batch, length, kv_heads, head_dim, kind)
    q = torch.randn(batch, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale, paged.k_scale, paged.v_scale)
    out = tk.paged_decode_attention(*args)
    row["splits"] = tk.decode_num_splits(batch, kv_heads, paged.block_tables.shape[1] * BLOCK_SIZE, num_sms())
    row["triton_ms"] = bench_ms(lambda: tk.paged_decode_attention(*args))
    row["GBps"] = paged.read_bytes() / (row["triton_ms"] * 1e-3) / 1e9
    row["pct_copy"] = 100 * row["GBps"] * 1e9 / copy_bps

    if kind != "auto":  # SDPA reads the bf16 cache the quantized one stands in for
        del args, paged
        paged = PagedKV(batch, length, kv_heads, head_dim, "auto")
    qg = q.view(batch, kv_heads, group, head_dim)  # a group's query heads as the query rows

    def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(qg, k, v, scale=scale)

    kv = paged.gather()
    got = sdpa(*kv).reshape(batch, heads, head_dim)
    if kind == "auto":
        row["max_err"] = (got.float() - out.float()).abs().max().item()
    row["sdpa_ms"] = bench_ms(lambda: sdpa(*kv))
    kv = None  # free the gathered copy before timing the gather itself
    row["sdpa_gather_ms"] = bench_ms(lambda: sdpa(*paged.gather()))
    row["x_sdpa"] = row["sdpa_ms"] / row["triton_ms"]
    row["x_sdpa_gather"] = row["sdpa_gather_ms"] / row["triton_ms"]
    return row


def prefill_row(tk, shape: str, batch: int, prefix: int, new: int, copy_bps: float) -> dict:
    from torch.nn.attention.bias import causal_lower_right

    heads, kv_heads, head_dim = SHAPES[shape]
    group = heads // kv_heads
    length = prefix + new
    row = {"phase": "prefill", "shape": shape, "kv": "auto", "batch": batch, "context": length, "new": new}
    need = cache_bytes(batch, length, kv_heads, head_dim, "auto") * (1 + 3 * group)
    if not fits(need):
        row["skipped"] = f"needs ~{need / 2**30:.0f} GiB"
        return row
    paged = PagedKV(batch, length, kv_heads, head_dim, "auto")
    q = torch.randn(batch * new, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    cu = torch.arange(0, batch * new + 1, new, device=DEVICE, dtype=torch.int32)
    scale = head_dim**-0.5
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, cu, paged.seq_lens, scale)
    out = tk.paged_prefill_attention(*args)
    row["triton_ms"] = bench_ms(lambda: tk.paged_prefill_attention(*args))
    row["GBps"] = paged.read_bytes() / (row["triton_ms"] * 1e-3) / 1e9
    row["pct_copy"] = 100 * row["GBps"] * 1e9 / copy_bps
    # causal work actually needed: query at position p attends p + 1 keys, two products of 2*d flops
    pairs = batch * (new * prefix + new * (new + 1) // 2)
    row["TFLOPs"] = 4 * heads * head_dim * pairs / (row["triton_ms"] * 1e-3) / 1e12

    qs = q.view(batch, new, heads, head_dim).transpose(1, 2)
    mask = causal_lower_right(new, length)

    def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)

    kv = paged.gather(repeat=group)
    got = sdpa(*kv).transpose(1, 2).reshape(batch * new, heads, head_dim)
    row["max_err"] = (got.float() - out.float()).abs().max().item()
    row["sdpa_ms"] = bench_ms(lambda: sdpa(*kv))
    kv = None  # free the gathered copy before timing the gather itself
    row["sdpa_gather_ms"] = bench_ms(lambda: sdpa(*paged.gather(repeat=group)))
    row["x_sdpa"] = row["sdpa_ms"] / row["triton_ms"]
    row["x_sdpa_gather"] = row["sdpa_gather_ms"] / row["triton_ms"]
    return row


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


COLUMNS = [
    ("phase", "{}", 7),
    ("shape", "{}", 12),
    ("kv", "{}", 4),
    ("batch", "{}", 5),
    ("context", "{}", 7),
    ("new", "{}", 5),
    ("splits", "{}", 6),
    ("triton_ms", "{:.3f}", 9),
    ("GBps", "{:.0f}", 6),
    ("pct_copy", "{:.0f}%", 6),
    ("TFLOPs", "{:.0f}", 6),
    ("sdpa_ms", "{:.3f}", 9),
    ("sdpa_gather_ms", "{:.3f}", 9),
    ("x_sdpa", "{:.2f}", 6),
    ("x_sdpa_gather", "{:.2f}", 8),
    ("max_err", "{:.1e}", 8),
]
HEADERS = {"GBps": "GB/s", "pct_copy": "%copy", "sdpa_gather_ms": "sdpa+g_ms", "x_sdpa_gather": "x_sdpa+g"}


def format_row(row: dict) -> str:
    cells = []
    for key, fmt, width in COLUMNS:
        value = row.get(key)
        cells.append(("-" if value is None else fmt.format(value)).rjust(width))
    line = " ".join(cells)
    return line + (f"  skipped: {row['skipped']}" if "skipped" in row else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", dest="json_path", help="write the device, copy bandwidth and every row here")
    ap.add_argument("--quick", action="store_true", help="batches {1, 64} x contexts {4096} only")
    ap.add_argument("--time-budget", type=float, default=240.0, help="seconds; later rows are skipped past it")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/triton_kernels.py: needs a CUDA GPU and torch sees none; nothing was measured")

    from engine.kernels import triton as tk

    start = time.time()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_bps = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"{props.name}: {props.multi_processor_count} SMs, copy bandwidth {copy_bps / 1e9:.0f} GB/s (read + write)")
    batches, contexts = ((1, 64), (4096,)) if args.quick else (BATCHES, CONTEXTS)
    plan = [("decode", shape, kind, b, c) for shape in SHAPES for kind in ("auto",) for b in batches for c in contexts]
    plan += [
        ("decode", s, kind, b, c) for s in QUANT_SHAPES for kind in ("int8", "fp8") for b in batches for c in contexts
    ]
    plan += [("prefill", shape, b, p, n) for shape in SHAPES for b, p, n in PREFILLS]

    print(" ".join(HEADERS.get(k, k).rjust(w) for k, _, w in COLUMNS))
    rows = []
    result = {
        "command": " ".join(sys.argv),
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_GBps": copy_bps / 1e9,
        "rows": rows,
    }
    for item in plan:
        if time.time() - start > args.time_budget:
            row = {"phase": item[0], "shape": item[1], "skipped": "time budget spent"}
        else:
            try:
                if item[0] == "decode":
                    row = decode_row(tk, *item[1:], copy_bps)
                else:
                    row = prefill_row(tk, *item[1:], copy_bps)
            except Exception as exc:  # one row's failure (a compile error, OOM) must not lose the others
                row = {"phase": item[0], "shape": item[1], "skipped": f"failed: {type(exc).__name__}: {exc}"[:300]}
        torch.cuda.empty_cache()
        rows.append(row)
        print(format_row(row), flush=True)
        if args.json_path:  # after every row: a run stopped at its time limit keeps what it measured
            with open(args.json_path, "w") as f:
                json.dump(result, f, indent=1)
    print(
        "x_sdpa = SDPA time (K/V pre-gathered, gather excluded) / Triton time; x_sdpa+g includes the gather; "
        "> 1 means Triton is faster"
    )
    if args.json_path:
        print(f"wrote {args.json_path}")
    if any(str(row.get("skipped", "")).startswith("failed") for row in rows):
        sys.exit("benchmarks/triton_kernels.py: some rows failed (see above)")


if __name__ == "__main__":
    main()
