"""Kernel backends: the same functions — three of paged attention (`store_kv`, decode, prefill) and
the decoder's element-wise ops (`rms_norm`, `fused_add_rms_norm`, `rotary_embedding`,
`silu_and_mul`) — in Triton (GPU, or its interpreter on the CPU), C++ for the CPU, and plain torch
(the reference, the oracle the others are tested against).

`get_backend(name, device)` returns the module to call; `auto` picks Triton on CUDA and the C++
CPU kernels elsewhere. When those cannot be built here, the reference serves (said once, in
`engine.kernels.cpu`), and `resolve_backend_name` names the backend that really runs.
`KVTOP_TRITON_ELEMENTWISE=0` gives the Triton backend the reference's torch element-wise ops in
place of its fused kernels (the attention stays Triton), to compare the two.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from engine.runtime.knobs import knob
from kvtop.protocol.errors import ConfigError

ELEMENTWISE_ENV = "KVTOP_TRITON_ELEMENTWISE"
ELEMENTWISE_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")


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
            module = importlib.import_module("engine.kernels.triton")
        except ImportError as exc:  # triton missing, or the module not built yet
            raise ConfigError(f"attention_backend=triton is not available here: {exc}") from exc
        return module if knob(ELEMENTWISE_ENV) != "0" else _with_torch_elementwise(module)
    raise ConfigError(f"unknown attention backend {name!r}: use auto, cpu, triton or reference")


@functools.cache
def _with_torch_elementwise(module: ModuleType) -> ModuleType:
    """`module` with the reference's element-wise ops in place of its own (one per process, so the
    model's per-backend state sees the same backend every step)."""
    from engine.kernels import reference

    mixed = ModuleType(f"{module.__name__}+torch-elementwise", module.__doc__)
    mixed.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    mixed.__dict__.update({op: getattr(reference, op) for op in ELEMENTWISE_OPS})
    return mixed
