"""A model's shape and what its KV cache and weights take: the one rule the engine allocates by
and `kvctl plan` and `kvctl whatif` predict with, torch-free so the light install plans too.

    KV bytes = layers × 2 × kv_heads × head_dim × tokens × bytes per element

(int8 adds one float32 scale per token, head and K/V). A shape comes from an HF `config.json`'s
fields — read from the file, from transformers' config object, or from PRESETS.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtop.protocol.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the model dtypes the engine runs
KV_ELEMENT_BYTES = {"fp8_e4m3": 1, "int8": 1}  # `auto`: the model's own dtype
SHAPE_CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                     "tie_word_embeddings", "attention_bias")  # fmt: skip
INT8_SCALE_BYTES = 4  # int8 KV: one float32 scale per token, KV head and K/V

# Shapes of well-known models, so `kvctl plan llama3-8b` works without downloading anything
# (from their published config.json files; weights are never needed to plan).
_LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192)
PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768),
}  # fmt: skip


class UnsupportedModelError(ConfigError):
    """A model_type the engine does not run."""


@dataclass
class ModelShape:
    """A model's shape: layers, heads, sizes (no weights, no RoPE tables)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool


def shape_from_config(config: dict) -> ModelShape:
    """The shape from an HF config's fields (`config.json`'s keys); UnsupportedModelError for an
    architecture the engine does not run, ConfigError for a field it lacks."""
    model_type = config.get("model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        arch = ", ".join(config.get("architectures") or [str(model_type)])
        raise UnsupportedModelError(
            f"unsupported architecture {arch} (model_type {model_type!r}): kvtop runs Llama-family decoders "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        heads = int(config["num_attention_heads"])
        return ModelShape(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            max_position_embeddings=int(config["max_position_embeddings"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
        )
    except KeyError as exc:
        raise ConfigError(f"the model config has no {exc.args[0]!r}: it is not a decoder's config.json") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the model config has a field that is not a number: {exc}") from None


def parameter_count(shape: ModelShape) -> int:
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    per_layer = shape.hidden_size * (q + 2 * kv) + q * shape.hidden_size
    per_layer += 3 * shape.hidden_size * shape.intermediate_size + 2 * shape.hidden_size
    if shape.qkv_bias:
        per_layer += q + 2 * kv
    if shape.qk_norm:
        per_layer += 2 * shape.head_dim
    embed = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return embed + shape.num_layers * per_layer + shape.hidden_size


def kv_element_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes of one stored K or V element: int8 and fp8 one, `auto` the model dtype's."""
    return KV_ELEMENT_BYTES.get(kv_cache_dtype) or ELEMENT_BYTES[model_dtype]


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str, model_dtype: str) -> int:
    """KV bytes one token costs across all layers, K and V, scales included."""
    per_token = num_layers * 2 * num_kv_heads * head_dim * kv_element_bytes(kv_cache_dtype, model_dtype)
    if kv_cache_dtype == "int8":
        per_token += num_layers * 2 * num_kv_heads * INT8_SCALE_BYTES
    return per_token


def num_blocks_for(memory_bytes: int, per_token: int, block_size: int) -> int:
    """Blocks that fit in `memory_bytes` (the one sizing rule, shared by the engine and its predictions)."""
    return int(memory_bytes) // (per_token * block_size)


# GGUF block formats the engine keeps quantized on the CPU (issue #41; engine/model/quant_linear.py's
# KERNEL_FORMATS): weights per block, bytes per block (the scales, offsets and values; a K format's
# super-block of 256). Every other tensor is held de-quantized, at the model's dtype.
GGUF_BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
# The GGUF files behind the names the engine fetches, so the light install plans their quantized
# bytes without the file: the projections' format and the embedding's (tied: also the logits head).
GGUF_PRESETS = {"smollm2-135m": {"projections": "Q4_1", "embedding": "Q8_0"}}
# `quantization="int8"`: any model's projections, head and embedding made Q8_0 blocks at load
INT8_PRESET = {"projections": "Q8_0", "embedding": "Q8_0"}


def tensor_bytes(fmt: str, elements: int, dtype: str) -> int:
    """Resident bytes of a weight tensor of `elements` values in GGUF format `fmt` (F32, Q4_1…): its
    blocks where the engine keeps them, else de-quantized to `dtype`."""
    if fmt in GGUF_BLOCKS:
        per_block, block_bytes = GGUF_BLOCKS[fmt]
        return -(-elements // per_block) * block_bytes
    return elements * ELEMENT_BYTES[dtype]


def held_weights(tensors: list[tuple[str, int]], dtype: str) -> tuple[int, str]:
    """The bytes and the formats (most bytes first: "Q4_1, Q8_0, float32") of weight tensors given as
    (GGUF format, elements), as the engine holds them: the kernel's formats as blocks, others at `dtype`."""
    by_format: dict[str, int] = {}
    for fmt, elements in tensors:
        name = fmt if fmt in GGUF_BLOCKS else dtype
        by_format[name] = by_format.get(name, 0) + tensor_bytes(fmt, elements, dtype)
    return sum(by_format.values()), ", ".join(sorted(by_format, key=by_format.__getitem__, reverse=True))


def preset_tensors(shape: ModelShape, preset: dict[str, str]) -> list[tuple[str, int]]:
    """A GGUF preset's weight tensors as (format, elements): its projections, norms (F32) and embedding
    (its own logits head, untied, in the embedding's format)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h, i = shape.hidden_size, shape.intermediate_size
    layer = [h * q, h * kv, h * kv, q * h, h * i, h * i, i * h]
    tensors = [(preset["projections"], n) for _ in range(shape.num_layers) for n in layer]
    tensors += [("F32", h)] * (2 * shape.num_layers + 1)
    heads = 1 if shape.tie_word_embeddings else 2
    return tensors + [(preset["embedding"], shape.vocab_size * h)] * heads
