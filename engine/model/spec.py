"""ModelSpec: what the engine needs to know about a model's shape, read from its HF config.

A leaf: the KV cache, capacity planning and the model all read it; it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelLoadError, UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelSpec:
    """A model's shape: layers, heads, sizes, RoPE (everything but the weights)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
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


def spec_from_config(config) -> ModelSpec:
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        arch = ", ".join(getattr(config, "architectures", None) or [model_type])
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch} (model_type {model_type!r}): kvtop runs Llama-family decoders "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq, scaling = _rope(config)
    return ModelSpec(
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        qk_norm=model_type == "qwen3",
        inv_freq=inv_freq,
        rope_scaling=scaling,
    )


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
