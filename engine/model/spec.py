"""ModelSpec: what the engine needs to know about a model's shape, read from its HF config.

A leaf: the KV cache, capacity planning and the model all read it; it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelLoadError, UnsupportedArchitectureError
from kvtop.protocol.sizing import SHAPE_CONFIG_KEYS, ModelShape, UnsupportedModelError, shape_from_config


@dataclass
class ModelSpec(ModelShape):
    """A model's shape (kvtop.protocol.sizing, what planning reads too) and what running it adds:
    the norm's epsilon and RoPE's frequencies."""

    rms_norm_eps: float
    inv_freq: torch.Tensor
    rope_scaling: float

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_spec(model_dir: Path) -> tuple[ModelSpec, object]:
    """The ModelSpec of an HF directory, or a clear error naming an unsupported architecture."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {exc}") from None
    return spec_from_config(config), config


def config_fields(config) -> dict:
    """The fields of transformers' config object that a shape is read from."""
    names = (*SHAPE_CONFIG_KEYS, "architectures")
    return {name: getattr(config, name, None) for name in names if getattr(config, name, None) is not None}


def spec_from_config(config) -> ModelSpec:
    try:
        shape = shape_from_config(config_fields(config))
    except UnsupportedModelError as exc:
        raise UnsupportedArchitectureError(str(exc)) from None
    inv_freq, scaling = _rope(config)
    return ModelSpec(**vars(shape), rms_norm_eps=config.rms_norm_eps, inv_freq=inv_freq, rope_scaling=scaling)


def _rope(config) -> tuple[torch.Tensor, float]:
    """inv_freq through transformers' own RoPE initialisers (default, llama3, linear, yarn…)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedArchitectureError(f"unsupported RoPE type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq, float(scaling)
