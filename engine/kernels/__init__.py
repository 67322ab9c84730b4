"""Kernel backends: the same functions — three of paged attention (`store_kv`, decode, prefill) and
the decoder's element-wise ops (`rms_norm`, `fused_add_rms_norm`, `rotary_embedding`,
`silu_and_mul`) — in Triton (GPU; it takes the reference's element-wise ops), C++ for the CPU, and
plain torch (the reference, the oracle the others are tested against).

`get_backend(name, device)` returns the module to call; `auto` picks Triton on CUDA and the C++
CPU kernels elsewhere. When those cannot be built here, the reference serves (said once, in
`engine.kernels.cpu`), and `resolve_backend_name` names the backend that really runs.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from engine.errors import ConfigError


def _cpu_kernels_available() -> bool:
    from engine.kernels import cpu

    return cpu.load()


def resolve_backend_name(name: str, device: str) -> str:
    on_cuda = device.startswith("cuda")
    if name == "auto":
        name = "triton" if on_cuda else "cpu"
    if name == "cpu" and not on_cuda and not _cpu_kernels_available():
        return "reference"
    return name


def get_backend(name: str, device: str) -> ModuleType:
    resolved = resolve_backend_name(name, device)
    if resolved == "reference":
        from engine.kernels import reference

        return reference
    if resolved == "cpu":
        if device.startswith("cuda"):
            raise ConfigError("attention_backend=cpu runs on CPU devices only: use auto or triton on CUDA")
        from engine.kernels import cpu

        return cpu
    if resolved == "triton":
        try:
            return importlib.import_module("engine.kernels.triton")
        except ImportError as exc:  # triton missing, or the module not built yet
            raise ConfigError(f"attention_backend=triton is not available here: {exc}") from exc
    raise ConfigError(f"unknown attention backend {name!r}: use auto, cpu, triton or reference")
