"""Capacity planning (`kvctl plan`): the article's arithmetic for any supported model, torch-free
(kvtop.protocol.sizing holds the rule the engine allocates by), so the light install plans too.

A model's shape comes from a preset name, an HF directory or a `config.json` — read here — or, for a
`.gguf` file and the names the engine fetches, from the engine's own config reader (kvtop[engine]).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvtop.protocol.config import CPU_DEFAULT_KV_MEMORY, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig, format_bytes
from kvtop.protocol.errors import ConfigError
from kvtop.protocol.sizing import (
    ELEMENT_BYTES,
    GGUF_PRESETS,
    INT8_PRESET,
    PRESETS,
    ModelShape,
    bytes_per_token,
    held_weights,
    num_blocks_for,
    parameter_count,
    preset_tensors,
    shape_from_config,
)

PLAN_KV_DTYPES = KV_CACHE_DTYPES  # the engine's own: `auto` is the model's 16-bit dtype
GPU_MEMORY_UTILIZATION = EngineConfig.gpu_memory_utilization  # vLLM's default: the share the engine may take
PLAN_DEVICES = ("cpu", "cuda")  # where the planned engine runs: it decides how a GGUF's weights are held


class PlanError(ConfigError):
    """A budget that cannot work (the weights do not fit, a KV budget beyond the memory): the
    message says so in one line and what to change."""


def config_for(model: str) -> dict:
    """The HF config fields of `model`: a preset name, an HF directory, a config.json — or, through
    the engine (a CLIError naming what to install where it is absent), a .gguf file or a name it fetches."""
    path = Path(model).expanduser()
    if model in PRESETS and not path.exists():
        return PRESETS[model]
    config_json = path / "config.json" if path.is_dir() else path
    if config_json.suffix == ".json" and config_json.is_file():
        try:
            return json.loads(config_json.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read a model config from {config_json}: {exc}") from None
    from kvtop.ctl.engine_gate import load_engine

    return load_engine("engine.model.loader", "plan").read_config_fields(model)


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
    weights_format: str = ""  # the dtype, or a GGUF file's block formats kept quantized: "Q4_1, Q8_0, float32"
    device: str = "cpu"
    dequantized_on_device: bool = False  # blocks the CPU would keep, de-quantized here (a GPU's engine does)

    @property
    def gqa_saving(self) -> float:
        """How many times smaller the KV is than full multi-head attention's."""
        return self.heads / self.kv_heads

    @property
    def bytes_saved(self) -> int:
        """What the weights' blocks save against the same weights in `dtype` (0 when held in it)."""
        return max(0, self.parameters * ELEMENT_BYTES[self.dtype] - self.weights_bytes)

    @property
    def cpu_auto_kv_bytes(self) -> int:
        """The engine's `auto` KV size on the CPU for these weights: the default plus what their blocks
        save (at most half the host memory free at start: engine/runtime/devices.py)."""
        return CPU_DEFAULT_KV_MEMORY + self.bytes_saved

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


def _kv_option(
    shape: ModelShape, kvd: str, dtype: str, kv_memory: int, block_size: int, contexts: list[int]
) -> KVOption:
    """One KV dtype's row: the engine's own bytes per token and block count for this budget."""
    bpt = bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, kvd, dtype)
    blocks = num_blocks_for(kv_memory, bpt, block_size)
    return KVOption(
        kv_cache_dtype=kvd,
        bytes_per_token=bpt,
        mha_bytes_per_token=bytes_per_token(shape.num_layers, shape.num_heads, shape.head_dim, kvd, dtype),
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
    quantization: str = EngineConfig.quantization,
    device: str = "cpu",
) -> Plan:
    """Figures for a KV budget given directly (`kv_cache_memory`), or as what `memory` × utilization
    leaves after the weights, or both (the KV budget, checked against the memory). Raises PlanError
    where the weights or the budget do not fit. A GGUF's weights count as the engine holds them on
    `device`: on the CPU, with `quantization` auto, its blocks in the kernel's formats
    (sizing.GGUF_BLOCKS) as they are, with none de-quantized; on a GPU (cuda) always de-quantized to
    `dtype`, as the engine loads them there (int8 too: it keeps the weights as loaded)."""
    shape = shape_from_config(config_for(model))
    params = parameter_count(shape)
    weights, weights_format, dequantized_on_device = device_weights(model, shape, dtype, quantization, device)
    kv_memory = kv_budget(weights, kv_cache_memory, memory, gpu_memory_utilization)
    contexts = contexts or [shape.max_position_embeddings]
    options = [_kv_option(shape, kvd, dtype, kv_memory, block_size, contexts) for kvd in kv_dtypes]
    if max(o.num_blocks for o in options) == 0:
        raise PlanError(
            f"{format_bytes(kv_memory)} for KV holds not one block of {block_size} tokens "
            f"({format_bytes(options[0].bytes_per_token * block_size)} at {dtype}) — a bigger budget"
        )
    warnings = [
        f"context {c} is beyond the model's max_position_embeddings {shape.max_position_embeddings}: "
        "the model was not trained for it (the engine's default max_model_len is its max_position_embeddings)"
        for c in contexts
        if c > shape.max_position_embeddings
    ]
    return Plan(
        model=model,
        model_type=shape.model_type,
        layers=shape.num_layers,
        heads=shape.num_heads,
        kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        parameters=params,
        dtype=dtype,
        weights_bytes=weights,
        kv_memory_bytes=int(kv_memory),
        block_size=block_size,
        contexts=contexts,
        options=options,
        max_position_embeddings=shape.max_position_embeddings,
        memory_bytes=memory,
        gpu_memory_utilization=gpu_memory_utilization,
        warnings=warnings,
        weights_format=weights_format,
        device=device,
        dequantized_on_device=dequantized_on_device,
    )


def device_weights(model: str, shape: ModelShape, dtype: str, quantization: str, device: str) -> tuple[int, str, bool]:
    """The weights' bytes and format as the engine holds them on `device`, and whether blocks the CPU
    would keep are de-quantized there (a GPU's engine runs no quantized kernel)."""
    if device not in PLAN_DEVICES:
        raise PlanError(f"--device {device!r} is not one of {', '.join(PLAN_DEVICES)}")
    tensors = gguf_weight_tensors(model, shape, quantization)
    if tensors and device == "cpu":
        return (*held_weights(tensors, dtype), False)
    return parameter_count(shape) * ELEMENT_BYTES[dtype], dtype, bool(tensors)


def gguf_weight_tensors(model: str, shape: ModelShape, quantization: str) -> list[tuple[str, int]] | None:
    """A GGUF model's weight tensors as (format, elements) where the engine keeps them quantized
    (`quantization` auto): a fetched name's from its preset (no file, no torch), a .gguf file's read
    through the engine; None where the weights load de-quantized."""
    if quantization not in QUANTIZATIONS:
        raise PlanError(f"--quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    path = Path(model).expanduser()
    if quantization == "none":
        return None
    if quantization == "int8":  # every projection, the head and the embedding made Q8_0 at load
        return preset_tensors(shape, INT8_PRESET)
    if model in GGUF_PRESETS and not path.exists():
        return preset_tensors(shape, GGUF_PRESETS[model])
    if path.suffix != ".gguf" or not path.is_file():
        return None
    from kvtop.ctl.engine_gate import load_engine

    return load_engine("engine.model.gguf_quant", "plan").weight_tensors(path)
