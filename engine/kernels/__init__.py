"""Paged-attention kernels: the same three functions in Triton (GPU) and plain torch (CPU, oracle).

`get_backend(name, device)` returns the module to call; `auto` picks Triton on CUDA and the
reference elsewhere.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from engine.errors import ConfigError


def resolve_backend_name(name: str, device: str) -> str:
    if name == "auto":
        return "triton" if device.startswith("cuda") else "reference"
    return name


def get_backend(name: str, device: str) -> ModuleType:
    resolved = resolve_backend_name(name, device)
    if resolved == "reference":
        from engine.kernels import reference

        return reference
    if resolved == "triton":
        try:
            return importlib.import_module("engine.kernels.triton")
        except ImportError as exc:  # triton missing, or the module not built yet
            raise ConfigError(f"attention_backend=triton is not available here: {exc}") from exc
    raise ConfigError(f"unknown attention backend {name!r}: use auto, triton or reference")
