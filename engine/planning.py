"""Capacity planning (`kvctl plan`): the article's arithmetic for any supported model.

KV bytes per token = layers × 2 × kv_heads × head_dim × bytes per element (+ int8 scales); what fits
in a memory budget after the weights; how many sequences of a given context length fit at once;
what grouped-query attention saves against the same model with a full multi-head KV.
Every number comes from the same functions the engine sizes its cache with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.model.llama import ModelSpec

PLAN_KV_DTYPES = ("auto", "fp8_e4m3", "int8")


def spec_for(model: str) -> tuple[ModelSpec, str]:
    """A ModelSpec from a known name, an HF directory, a config.json or a .gguf file — without
    loading weights (a known name is fetched once if missing)."""
    from transformers import AutoConfig

    from engine.model.loader import resolve_model_dir, spec_from_config

    path = Path(model).expanduser()
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

    @property
    def gqa_saving(self) -> float:
        """How many times smaller the KV is than full multi-head attention's."""
        return self.heads / self.kv_heads


def plan(
    model: str,
    dtype: str = "bfloat16",
    kv_cache_memory: int | None = None,
    memory: int | None = None,
    block_size: int = 16,
    contexts: list[int] | None = None,
    kv_dtypes: tuple[str, ...] = PLAN_KV_DTYPES,
) -> Plan:
    """Figures for a KV budget given directly (`kv_cache_memory`) or as what `memory` leaves after
    the weights."""
    import torch

    from engine.kv.cache import bytes_per_token, num_blocks_for
    from engine.llm_engine import TORCH_DTYPES  # the engine's own name -> dtype map

    spec, _ = spec_for(model)
    torch_dtype = TORCH_DTYPES[dtype]
    params = parameter_count(spec)
    weights = params * torch.empty((), dtype=torch_dtype).element_size()
    if kv_cache_memory is None:
        if memory is None:
            raise ValueError("give kv_cache_memory or memory")
        kv_cache_memory = max(0, memory - weights)
    contexts = contexts or [spec.max_position_embeddings]
    mha = replace(spec, num_kv_heads=spec.num_heads)
    options = []
    for kvd in kv_dtypes:
        bpt = bytes_per_token(spec, kvd, torch_dtype)
        blocks = num_blocks_for(kv_cache_memory, bpt, block_size)
        options.append(
            KVOption(
                kv_cache_dtype=kvd,
                bytes_per_token=bpt,
                mha_bytes_per_token=bytes_per_token(mha, kvd, torch_dtype),
                num_blocks=blocks,
                capacity_tokens=blocks * block_size,
                max_seqs={c: blocks // -(-c // block_size) for c in contexts},
            )
        )
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
        kv_memory_bytes=int(kv_cache_memory),
        block_size=block_size,
        contexts=contexts,
        options=options,
    )
