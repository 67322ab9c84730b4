"""Capacity planning (`kvctl plan`): the article's arithmetic for any supported model.

KV bytes per token = layers × 2 × kv_heads × head_dim × bytes per element (+ int8 scales); what fits
in a memory budget after the weights (of memory × gpu_memory_utilization, as vLLM); how many sequences of a given context length fit at once;
what grouped-query attention saves against the same model with a full multi-head KV.
Every number comes from the same functions the engine sizes its cache with.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import ModelLoadError
from kvtop.protocol.config import KV_CACHE_DTYPES, EngineConfig, format_bytes
from kvtop.protocol.errors import ConfigError

if TYPE_CHECKING:
    from engine.model.spec import ModelSpec

PLAN_KV_DTYPES = KV_CACHE_DTYPES  # the engine's own: `auto` is the model's 16-bit dtype
GPU_MEMORY_UTILIZATION = (
    EngineConfig.gpu_memory_utilization
)  # vLLM's default: the share of device memory the engine may take

# Shapes of well-known models, so `kvctl plan llama3-8b` works without downloading anything
# (from their published config.json files; weights are never needed to plan).
_LLAMA3 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
PRESETS: dict[str, dict] = {
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, rope_theta=10000.0, sliding_window=None),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, rope_theta=1000000.0),
}  # fmt: skip


class PlanError(ConfigError):
    """A budget that cannot work (the weights do not fit, a KV budget beyond the memory): the
    message says so in one line and what to change."""


def spec_for(model: str) -> tuple[ModelSpec, str]:
    """A ModelSpec from a known name, an HF directory, a config.json or a .gguf file — without
    loading weights (a known name is fetched once if missing)."""
    from transformers import AutoConfig

    from engine.model.loader import resolve_model_dir
    from engine.model.spec import spec_from_config

    path = Path(model).expanduser()
    if model in PRESETS and not path.exists():
        preset = dict(PRESETS[model])
        return spec_from_config(AutoConfig.for_model(preset.pop("model_type"), **preset)), model
    try:
        if path.suffix == ".gguf" and path.is_file():
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        elif path.name == "config.json" and path.is_file():
            config = AutoConfig.from_pretrained(str(path.parent))
        else:
            config = AutoConfig.from_pretrained(str(resolve_model_dir(model)))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read a model config from {model}: {exc}") from None
    return spec_from_config(config), getattr(config, "_name_or_path", "") or model


def parameter_count(spec: ModelSpec) -> int:
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    per_layer = spec.hidden_size * (q + 2 * kv) + q * spec.hidden_size
    per_layer += 3 * spec.hidden_size * spec.intermediate_size + 2 * spec.hidden_size
    if spec.qkv_bias:
        per_layer += q + 2 * kv
    if spec.qk_norm:
        per_layer += 2 * spec.head_dim
    embed = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return embed + spec.num_layers * per_layer + spec.hidden_size


@dataclass
class KVOption:
    kv_cache_dtype: str
    bytes_per_token: int
    mha_bytes_per_token: int  # the same model if every query head had its own KV head
    num_blocks: int
    capacity_tokens: int
    max_seqs: dict[int, int]  # context length -> sequences that fit at once


@dataclass
class Plan:
    model: str
    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    parameters: int
    dtype: str
    weights_bytes: int
    kv_memory_bytes: int
    block_size: int
    contexts: list[int]
    options: list[KVOption]
    max_position_embeddings: int = 0
    memory_bytes: int | None = None  # the device memory asked about, when it was
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    warnings: list[str] = field(default_factory=list)

    @property
    def gqa_saving(self) -> float:
        """How many times smaller the KV is than full multi-head attention's."""
        return self.heads / self.kv_heads

    @property
    def usable_bytes(self) -> int | None:
        """What the engine may take of `memory_bytes`; the rest is headroom (activations, other processes)."""
        return None if self.memory_bytes is None else int(self.memory_bytes * self.gpu_memory_utilization)


def kv_budget(weights: int, kv_cache_memory: int | None, memory: int | None, utilization: float) -> int:
    """The KV bytes a plan works with, or PlanError when the numbers contradict each other: with
    `memory`, the engine may use memory × utilization (vLLM's --gpu-memory-utilization), weights first."""
    if not 0.0 < utilization <= 1.0:
        raise PlanError(f"--gpu-memory-utilization {utilization:g} must be in (0, 1]")
    if memory is None:
        if kv_cache_memory is None:
            raise PlanError("give --kv-cache-memory or --memory")
        return kv_cache_memory
    usable = int(memory * utilization)
    where = f"{format_bytes(usable)} usable ({format_bytes(memory)} × {utilization:g})"
    if weights >= usable:
        raise PlanError(
            f"the weights ({format_bytes(weights)}) do not fit in {where}: nothing is left for the KV cache — "
            "more --memory, a smaller model or --dtype"
        )
    if kv_cache_memory is None:
        return usable - weights
    if weights + kv_cache_memory > usable:
        raise PlanError(
            f"--kv-cache-memory {format_bytes(kv_cache_memory)} and {format_bytes(weights)} of weights exceed "
            f"{where}: at most {format_bytes(usable - weights)} is left for KV"
        )
    return kv_cache_memory


def _kv_option(spec, kvd: str, torch_dtype, kv_memory: int, block_size: int, contexts: list[int]) -> KVOption:
    """One KV dtype's row: the engine's own bytes per token and block count for this budget."""
    from engine.kv.cache import bytes_per_token, num_blocks_for

    bpt = bytes_per_token(spec, kvd, torch_dtype)
    blocks = num_blocks_for(kv_memory, bpt, block_size)
    return KVOption(
        kv_cache_dtype=kvd,
        bytes_per_token=bpt,
        mha_bytes_per_token=bytes_per_token(replace(spec, num_kv_heads=spec.num_heads), kvd, torch_dtype),
        num_blocks=blocks,
        capacity_tokens=blocks * block_size,
        max_seqs={c: blocks // -(-c // block_size) for c in contexts},
    )


def plan(
    model: str,
    dtype: str = "bfloat16",
    kv_cache_memory: int | None = None,
    memory: int | None = None,
    block_size: int = 16,
    contexts: list[int] | None = None,
    kv_dtypes: tuple[str, ...] = PLAN_KV_DTYPES,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
) -> Plan:
    """Figures for a KV budget given directly (`kv_cache_memory`), or as what `memory` × utilization
    leaves after the weights, or both (the KV budget, checked against the memory). Raises PlanError
    where the weights or the budget do not fit."""
    import torch

    from engine.devices import TORCH_DTYPES  # the engine's own name -> dtype map

    spec, _ = spec_for(model)
    torch_dtype = TORCH_DTYPES[dtype]
    params = parameter_count(spec)
    weights = params * torch.empty((), dtype=torch_dtype).element_size()
    kv_memory = kv_budget(weights, kv_cache_memory, memory, gpu_memory_utilization)
    contexts = contexts or [spec.max_position_embeddings]
    options = [_kv_option(spec, kvd, torch_dtype, kv_memory, block_size, contexts) for kvd in kv_dtypes]
    if max(o.num_blocks for o in options) == 0:
        raise PlanError(
            f"{format_bytes(kv_memory)} for KV holds not one block of {block_size} tokens "
            f"({format_bytes(options[0].bytes_per_token * block_size)} at {dtype}) — a bigger budget"
        )
    warnings = [
        f"context {c} is beyond the model's max_position_embeddings {spec.max_position_embeddings}: "
        "the model was not trained for it (the engine's default max_model_len is its max_position_embeddings)"
        for c in contexts
        if c > spec.max_position_embeddings
    ]
    return Plan(
        model=model,
        model_type=spec.model_type,
        layers=spec.num_layers,
        heads=spec.num_heads,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        parameters=params,
        dtype=dtype,
        weights_bytes=weights,
        kv_memory_bytes=int(kv_memory),
        block_size=block_size,
        contexts=contexts,
        options=options,
        max_position_embeddings=spec.max_position_embeddings,
        memory_bytes=memory,
        gpu_memory_utilization=gpu_memory_utilization,
        warnings=warnings,
    )
