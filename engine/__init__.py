"""kvtop's inference engine: a paged KV cache, continuous batching, and the numbers to watch.

Exports load lazily (PEP 562): `import engine` alone costs nothing, and `engine.LLMEngine` loads
torch when first asked for. What the tools share with the engine (its config, the stats frame,
snapshots, metric names, the socket) is `kvtop.protocol`, which needs neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "engine.llm",
    "ConfigError": "kvtop.protocol.errors",
    "EngineConfig": "kvtop.protocol.config",
    "EngineDrainingError": "engine.errors",
    "EngineError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "LLMEngine": "engine.llm_engine",
    "ModelLoadError": "engine.errors",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling",
    "UnsupportedArchitectureError": "engine.errors",
}

__all__ = [
    "LLM",
    "ConfigError",
    "EngineConfig",
    "EngineDrainingError",
    "EngineError",
    "InvalidRequestError",
    "LLMEngine",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "UnsupportedArchitectureError",
]

if TYPE_CHECKING:
    from engine.errors import (
        EngineDrainingError,
        EngineError,
        InvalidRequestError,
        ModelLoadError,
        UnsupportedArchitectureError,
    )
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput
    from engine.sampling import SamplingParams
    from kvtop.protocol.config import EngineConfig
    from kvtop.protocol.errors import ConfigError


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
