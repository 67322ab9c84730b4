"""kvtop's inference engine: a paged KV cache, continuous batching, and the numbers to watch."""

from engine.config import EngineConfig
from engine.errors import (
    ConfigError,
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
