"""CPU paged attention that reads the KV blocks where they lie: a small C++ extension
(`csrc/paged_attention.cpp`), with the signatures of `engine.kernels.reference`.

The extension is built on the machine that runs it (`-O3 -march=native`: machines differ) the
first time it is needed, into `$KVTOP_CACHE/kernels/cpu-attention-<key>`, where the key hashes
the source, the torch version, the CPU's flags and the compiler. Later processes load the built
library in milliseconds. If the build fails (no compiler, no ninja) one line says so and
`engine.kernels.get_backend` serves the reference kernels instead: never a crash.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from engine.kernels import reference
from engine.kernels.cpu_prefill import bf16_pairs_pay, sdpa_pays, sdpa_prefill_attention
from engine.runtime.knobs import knob
from engine.runtime.log import log
from kvtop.protocol.paths import cache_dir

NAME = "kvtop_cpu_attention"
CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / "paged_attention.cpp",
    CSRC / "fused_ops.cpp",
    CSRC / "amx_linear.cpp",
    CSRC / "amx_attention.cpp",
    CSRC / "fp32_gemm.cpp",
    CSRC / "bf16_gemm.cpp",
    CSRC / "fp32_attention.cpp",
    CSRC / "bf16_attention.cpp",
    CSRC / "decode_layers.cpp",
    CSRC / "quant_gemm.cpp",
    CSRC / "quant_packed.cpp",
]
# every header beside the sources, in the build key too: a changed header is a new build (a list by
# hand once missed a new header, and an edit to it ran the stale build)
HEADERS = sorted(CSRC.glob("*.h"))
# -fopenmp: at::parallel_for is inline OpenMP in torch's headers (without it the loop runs on one
# thread); the libgomp it links is the one torch has already loaded (same soname).
# -fno-trapping-math: without it gcc keeps exp_nonpositive's floor and float-to-int scalar (they
# could raise FP exceptions nobody traps); with it the softmax's exp vectorizes: decode attention
# 7 % (fp32) to 16 % (bf16 cache) less CPU time.
# KVTOP_CPU_ARCH names another target than this machine (e.g. x86-64-v3: AVX2, no AVX-512) — for a
# build that must run elsewhere, and for the test that checks the portable paths on an AVX-512 machine.
ARCH = knob("KVTOP_CPU_ARCH")
CFLAGS = ["-O3", f"-march={ARCH}", "-fopenmp", "-fno-trapping-math"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_loaded: dict[str, bool] = {}  # this process's one attempt: {"ok": bool}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_dir() -> Path:
    """Where this machine's build lives: a new source, torch, CPU or compiler means a new build."""
    digest = hashlib.sha256()
    for part in (
        *(path.read_bytes() for path in SOURCES + HEADERS),
        torch.__version__,
        _cpu_flags(),
        " ".join(CFLAGS + LDFLAGS),
        os.environ.get("CXX", ""),
    ):
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return cache_dir() / "kernels" / f"cpu-attention-{digest.hexdigest()[:16]}"


def load() -> bool:
    """Build (once per machine) and load the extension. False, said once per process, if it cannot."""
    with _lock:
        if "ok" not in _loaded:
            _loaded["ok"] = _load()
        return _loaded["ok"]


def loaded() -> bool:
    """The extension is loaded in this process (never builds it: for callers outside the backend)."""
    return _loaded.get("ok", False)


def says(question: str) -> bool:
    """The extension built here, and its yes/no op `question` (amx_supported, fp32_linear_supported) says yes."""
    return load() and bool(getattr(torch.ops.kvtop_cpu, question)())


def _load() -> bool:
    directory = build_dir()
    library, built = directory / f"{NAME}.so", directory / "built"
    try:
        if not (built.exists() and library.exists()):
            _build(directory)
            built.touch()
        torch.ops.load_library(str(library))
        return True
    except Exception as exc:  # any failure to build or load means the reference serves
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "error" in ln.lower() and ln != lines[0]), "")
        reason = "; ".join(x for x in (lines[0] if lines else type(exc).__name__, detail) if x)
        log(f"the CPU attention kernel could not be built ({reason[:300]}); using the reference kernels")
        return False


def _build(directory: Path) -> None:
    from torch.utils import cpp_extension

    print("[kvtop] building the CPU attention kernel (once)…", file=sys.stderr, flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    _ensure_ninja_on_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compiler-version notes: the one line on failure is ours
        cpp_extension.load(
            name=NAME,
            sources=[str(path) for path in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )


def _ensure_ninja_on_path() -> None:
    """pip's `ninja` lands beside the interpreter, which is not on PATH when the venv is not active."""
    if shutil.which("ninja"):
        return
    here = Path(sys.executable).parent
    if (here / "ninja").exists():
        os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"


def _cpp_kernel(op_name: str, oracle: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The C++ op `op_name` behind the oracle's own signature and docstring (`functools.wraps`),
    so the backends cannot drift apart: arguments are bound by the oracle's names, the block tables
    go in as int32; the op takes the query as it is (converting what its kernels do not read) and
    answers in the query's dtype."""
    signature = inspect.signature(oracle)
    names = list(signature.parameters)

    @functools.wraps(oracle)
    def kernel(*args, **kwargs) -> torch.Tensor:
        if kwargs or len(args) != len(names):  # the model passes every argument by position: no bind there
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = tuple(bound.arguments.values())
        a = dict(zip(names, args, strict=True))
        a["block_tables"] = a["block_tables"].to(torch.int32).contiguous()
        a["scale"] = float(a["scale"])
        return getattr(torch.ops.kvtop_cpu, op_name)(*a.values())

    return kernel


paged_decode_attention = _cpp_kernel("paged_decode", reference.paged_decode_attention)
# the C++ prefill kernel whatever the chunk length (tests and benchmarks/cpu_attention.py call it)
inplace_prefill_attention = _cpp_kernel("paged_prefill", reference.paged_prefill_attention)

# Prefill: the in-place kernel wins on short chunks (a few new tokens over a cached context); on
# longer ones SDPA's GEMM tiles (`cpu_prefill`) are faster. Measured single-threaded, CPU ms,
# SmolLM2 heads, in-place vs SDPA: 4 seqs over 256 cached x 8 new 0.59 vs 0.81 (bf16 0.64 vs
# 0.61), x 12 new 1.13 vs 0.80 (0.90 vs 0.66); 16 seqs over 100..500 cached x 8 new 3.30 vs 4.00,
# x 16 new 5.96 vs 4.95; 1 x 2,048 new 133 vs 51 (bf16 142 vs 22). Longer chunks still stay in
# place when SDPA would need a launch for each of many small shapes (`cpu_prefill.sdpa_pays`). In
# bf16 on AVX512-BF16 without AMX (AMD Zen 4) long chunks go to `csrc/bf16_attention.cpp` instead,
# whatever their shapes: one call, no gather (`cpu_prefill.bf16_pairs_pay`).
SHORT_CHUNK = 8
_PREFILL = inspect.signature(reference.paged_prefill_attention)


@functools.wraps(reference.paged_prefill_attention)
def paged_prefill_attention(*args, **kwargs) -> torch.Tensor:
    # the model passes every argument by position: no bind (0.1 ms) on that path
    a = args if len(args) > 6 and not kwargs else tuple(_PREFILL.bind(*args, **kwargs).arguments.values())
    q, k_cache, v_cache, tables, cu, lens, scale = a[:7]
    if int((cu[1:] - cu[:-1]).max()) > SHORT_CHUNK:
        if bf16_pairs_pay(q, k_cache):  # every sequence in one call, K/V read in place (csrc/bf16_attention.cpp)
            tables = tables.to(torch.int32).contiguous()
            return torch.ops.kvtop_cpu.bf16_paged_prefill(q, k_cache, v_cache, tables, cu, lens, float(scale))
        if sdpa_pays(cu, lens):
            return sdpa_prefill_attention(*args, **kwargs)
    return inplace_prefill_attention(*args, **kwargs)


_STORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.wraps(reference.store_kv)
def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    # a cache of key's own dtype is a copy per token (csrc/fused_ops.cpp); int8/fp8 quantize in torch
    if k_cache.dtype == key.dtype and k_cache.dtype in _STORE_DTYPES:
        torch.ops.kvtop_cpu.store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


# The decoder layer's element-wise ops (`csrc/fused_ops.cpp`): one pass each, the reference's
# rounding. float32 and bfloat16; other dtypes (float16) take the reference's torch ops.
_FUSED_DTYPES = (torch.float32, torch.bfloat16)


@functools.wraps(reference.rms_norm)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype not in _FUSED_DTYPES:
        return reference.rms_norm(x, weight, eps)
    return torch.ops.kvtop_cpu.rms_norm(x, weight, eps)


@functools.wraps(reference.fused_add_rms_norm)
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype not in _FUSED_DTYPES:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    return torch.ops.kvtop_cpu.fused_add_rms_norm(x, residual, weight, eps)


@functools.wraps(reference.rotary_embedding)
def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.dtype not in _FUSED_DTYPES:
        return reference.rotary_embedding(q, k, cos, sin)
    torch.ops.kvtop_cpu.rotary_embedding(q, k, cos, sin)  # in place
    return q, k


@functools.wraps(reference.silu_and_mul)
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dtype not in _FUSED_DTYPES:
        return reference.silu_and_mul(gate_up)
    return torch.ops.kvtop_cpu.silu_and_mul(gate_up)
