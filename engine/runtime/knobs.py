"""The engine's environment knobs: every `KVTOP_*` variable the engine reads, in one table.

They are for comparing one implementation with another and for tests, not for serving: the
defaults are what the benchmarks chose. Each is read through `knob(name)` where its choice is
made (at load: the packed projections, the Triton element-wise ops; at the first decode: the
fused layer loop; the C++ build's target at its first build; the allocator and the fault
injector at start; the OpenMP pool at each thread's end). `check()` reads them all when an engine
is constructed, before the model loads, so that a value that is not one of a knob's choices
stops it there with a one-line `ConfigError` naming them — not a silent default, and not a
failed step later.

The tools' own variables (`KVTOP_SOCKET`, `KVTOP_SOCKET_OWNER`, `KVTOP_CACHE`, `KVTOP_API_KEY`)
are options of `kvctl` and `kvtop`, documented with those (`--help`); docs/engine.md lists these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvtop.protocol.errors import ConfigError


@dataclass(frozen=True)
class Knob:
    name: str
    default: str
    choices: tuple[str, ...] | None  # None: any text (a -march target, a fault spec)
    doc: str


KNOBS = {
    k.name: k
    for k in (
        Knob("KVTOP_PACKED_LINEAR", "1", ("1", "0", "all", "onednn"),
             "CPU projections: 1 packs bf16 (AMX, else our bf16 panels, else oneDNN) and puts fp32 on our fp32 "
             "panels; all packs fp32 with oneDNN too; onednn uses oneDNN's for bf16; 0 keeps nn.Linear."),
        Knob("KVTOP_LARGE_GEMM", "auto", ("auto", "1", "0"),
             "A second, oneDNN-packed copy of the projections for prefill-sized steps: auto when it is at most "
             "1 GiB, 1 always, 0 never."),
        Knob("KVTOP_QUANT_PACK", "1", ("1", "0"),
             "GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K/Q8_0 weights repacked at load into the AVX-512 decode kernel's tiles (same "
             "bytes); 0 keeps the file's layout."),
        Knob("KVTOP_FUSED_DECODE", "1", ("1", "0"),
             "Decode steps through the C++ fused layer loop (CPU backend); 0 runs the Python loop."),
        Knob("KVTOP_TRITON_ELEMENTWISE", "1", ("1", "0"),
             "The Triton backend's element-wise kernels (RMSNorm + residual, RoPE, SiLU-and-mul); 0 uses "
             "the reference's torch ops."),
        Knob("KVTOP_OMP_RELEASE", "1", ("1", "0"),
             "Free a thread's OpenMP pool when it runs no more parallel regions; 0 keeps it."),
        Knob("KVTOP_MALLOC", "1", ("1", "0"),
             "glibc malloc settings that keep freed memory for reuse; 0 keeps glibc's defaults."),
        Knob("KVTOP_HUGE_PAGES", "1", ("1", "0"),
             "A CPU engine's weights and KV cache on 2 MiB pages (madvise); 0 leaves them on torch's allocator."),
        Knob("KVTOP_CPU_ARCH", "native", None,
             "The -march of the C++ kernels' build: native, or another target (x86-64-v3: AVX2, no AVX-512)."),
        Knob("KVTOP_FAULT_INJECT", "", None,
             "Tests only: step=N[,M…], every=N, token=ID (a step fails) or stall=SECONDS (steps slow down)."),
    )
}  # fmt: skip


def knob(name: str) -> str:
    """The knob's value: the environment's where set (stripped), else its default. A value outside
    its choices is a ConfigError that names them."""
    k = KNOBS[name]
    value = os.environ.get(name, "").strip() or k.default
    if k.choices is not None and value not in k.choices:
        raise ConfigError(f"{name}={value!r}: use one of {', '.join(k.choices)} (default {k.default})")
    return value


def check() -> None:
    """Read every knob once (see the module docstring): a ConfigError for the first bad value."""
    for name in KNOBS:
        knob(name)
