"""A GGUF file's weights loaded as the file holds them (issue #41): the projections, the logits head
and the embedding stay in their block formats (engine/model/quant_linear.py); the norms, small, in
the model's dtype.

The model's shape, config and tokenizer still come from the HF directory `engine.model.gguf`
converts the file to once; only the weights are read here, straight from the file. Fused projections
are the file's tensors' rows stacked (q, k, v; gate, up), with llama.cpp's permutation of the q and k
rows undone as transformers undoes it, so the numbers are the de-quantized model's exactly.

A tensor in a format our kernel does not run (Q2_K, Q3_K, F16…) is de-quantized (one line names the
tensor and its type): never a refusal. `dequantize_all` de-quantizes every tensor, one projection at a
time, to the model's dtype: the de-quantized model (`quantization="none"`, or a GPU) without
transformers' conversion, which holds every tensor in float32 at once (an 8B file: 32 GB). A fused projection whose parts differ in format (Q4_K_M's
v in Q6_K beside q and k in Q4_K) is a `StackedLinear` of its parts, each quantized; de-quantized
whole only where a part's format has no kernel.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from torch import nn

from engine.errors import ModelLoadError
from engine.model.llama import CausalLM
from engine.model.quant_linear import (
    KERNEL_FORMATS,
    QuantEmbedding,
    QuantLinear,
    StackedLinear,
    dequantize,
    kernel_available,
)
from engine.model.spec import ModelSpec
from engine.runtime.log import log
from kvtop.protocol.paths import cache_dir

# the GGUF architectures whose tensors map onto our decoder as llama's do
ARCHITECTURES = ("llama",)
FLOATS = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
DEQUANTIZE_CHUNK = 1 << 24  # values de-quantized at once (64 MB in float32)


@dataclass
class TensorEntry:
    """Where a tensor lies in the file: ggml type, GGUF shape ([K, N]: K first), byte offset and size."""

    name: str
    type: int
    shape: list[int]
    offset: int
    n_bytes: int

    @property
    def fmt(self) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.type)


@dataclass
class GGUFIndex:
    architecture: str
    tensors: dict[str, TensorEntry]


def read_index(path: Path) -> GGUFIndex:
    """The file's architecture and tensor table. `gguf`'s reader parses every metadata field in Python
    (SmolLM2's 49,152-token vocabulary: tens of seconds on a busy 2-core machine), so the table is
    kept in the cache, keyed by the file's path, size and mtime: later loads read it in milliseconds."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "gguf-index" / f"{path.stem}-{key}.json"
    if cached.exists():
        data = json.loads(cached.read_text())
        return GGUFIndex(data["architecture"], {t["name"]: TensorEntry(**t) for t in data["tensors"]})
    reader = GGUFReader(path)
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
    tensors = {
        t.name: TensorEntry(t.name, int(t.tensor_type), [int(x) for x in t.shape], int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    }
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"architecture": arch, "tensors": [asdict(t) for t in tensors.values()]}))
    os.replace(tmp, cached)
    return GGUFIndex(arch, tensors)


def weight_tensors(path: Path) -> list[tuple[str, int]] | None:
    """The file's weight tensors as (GGUF format name, elements), for `kvctl plan` to count as
    `load_quantized` holds them (kvtop.protocol.sizing.held_weights); None for an architecture that
    loads de-quantized. Exact where each fused projection's parts share one format (a mixed one is
    de-quantized whole at load: more than the plan says)."""
    index = read_index(path)
    if index.architecture not in ARCHITECTURES:
        return None
    return [
        (t.fmt.name, int(np.prod(t.shape))) for t in index.tensors.values() if not t.name.endswith("rope_freqs.weight")
    ]


def quantized_load_refusal(path: Path, device: str) -> str | None:
    """Why this GGUF file cannot load quantized here (one line), or None when it can."""
    if not device.startswith("cpu"):
        return f"quantized weights run on the CPU only: de-quantizing {path.name} for {device}"
    if not kernel_available():
        return f"the quantized kernel is not built here (needs AVX2 with FMA and F16C): de-quantizing {path.name}"
    arch = read_index(path).architecture
    if arch not in ARCHITECTURES:
        return f"{path.name} is a {arch!r} GGUF: quantized loading takes {', '.join(ARCHITECTURES)}; de-quantizing"
    return None


def _blocks(data: np.memmap, tensor: TensorEntry) -> torch.Tensor:
    """The tensor's bytes as [rows, row bytes] uint8 (a copy: the file's mapping is let go)."""
    rows = tensor.shape[-1] if len(tensor.shape) > 1 else 1
    raw = np.array(data[tensor.offset : tensor.offset + tensor.n_bytes])
    return torch.from_numpy(raw).view(rows, -1)


def _values(data: np.memmap, tensor: TensorEntry, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor of any format de-quantized to `dtype`, [rows, K] (or [K] for a vector), into `out` if
    given. A chunk of rows at a time: the `gguf` package's numpy de-quantization makes several float32
    temporaries of what it is given (an 8B file's embedding at once: ~4 GB on top of the weights); the
    kernel's formats go through the kernel's de-quantization (the same values, 4-12× faster here)."""
    k = tensor.shape[0]
    blocks = _blocks(data, tensor)
    out = torch.empty(blocks.shape[0], k, dtype=dtype) if out is None else out.view(blocks.shape[0], k)
    step = max(1, DEQUANTIZE_CHUNK // k)
    native = tensor.fmt in KERNEL_FORMATS and kernel_available()
    buffer = torch.empty(min(step, blocks.shape[0]), k) if native else None
    for r in range(0, blocks.shape[0], step):
        chunk = blocks[r : r + step]
        if tensor.fmt == GGMLQuantizationType.F32:
            out[r : r + step] = chunk.view(torch.float32)
        elif buffer is not None:
            torch.ops.kvtop_cpu.quant_dequantize(chunk, int(tensor.fmt), buffer[: chunk.shape[0]])
            out[r : r + step] = buffer[: chunk.shape[0]]
        else:
            out[r : r + step] = dequantize(chunk, tensor.fmt, k)
    return out if len(tensor.shape) > 1 else out.reshape(k)


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert permutes q and k rows for its RoPE; transformers' reverse, on whole rows
    (of blocks or of values alike)."""
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, -1).transpose(1, 2).reshape(rows.shape)


class GGUFWeights:
    """The file's tensors by name, taken out as they are used."""

    def __init__(self, path: Path, spec: ModelSpec, dtype: torch.dtype, dequantize_all: bool = False) -> None:
        self.path, self.spec, self.dtype, self.dequantize_all = path, spec, dtype, dequantize_all
        self.tensors = dict(read_index(path).tensors)
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        self.dequantized: list[str] = []  # "name (TYPE)" of the tensors we do not run quantized

    def take(self, name: str) -> TensorEntry:
        try:
            return self.tensors.pop(name)
        except KeyError:
            raise ModelLoadError(f"{self.path.name} has no tensor {name!r}") from None

    def vector(self, name: str) -> nn.Parameter:
        return nn.Parameter(_values(self.data, self.take(name), self.dtype), requires_grad=False)

    def linear(self, names: list[str], permute: dict[str, int] | None = None) -> nn.Module:
        """One projection from the file's tensors `names`, rows stacked in that order; `permute`:
        the names whose rows llama.cpp permuted, with their head counts."""
        permute = permute or {}
        parts = [self.take(name) for name in names]
        formats = {p.fmt for p in parts}
        k = parts[0].shape[0]
        fix: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, rows: (  # noqa: E731
            _unpermute(rows, permute[name]) if name in permute else rows
        )
        if not self.dequantize_all:
            if len(formats) == 1 and (fmt := formats.pop()) in KERNEL_FORMATS:
                blocks = torch.cat([fix(name, _blocks(self.data, p)) for name, p in zip(names, parts, strict=True)])
                return QuantLinear(blocks, fmt, k)
            if all(p.fmt in KERNEL_FORMATS for p in parts):  # each part quantized in its own format
                return StackedLinear(
                    [
                        QuantLinear(fix(name, _blocks(self.data, p)), p.fmt, k)
                        for name, p in zip(names, parts, strict=True)
                    ]
                )
            self.dequantized += [f"{p.name} ({p.fmt.name})" for p in parts if p.fmt not in FLOATS]
        weight = torch.empty(sum(p.shape[-1] for p in parts), k, dtype=self.dtype)  # the parts written in place
        start = 0
        for name, p in zip(names, parts, strict=True):
            rows = weight[start : start + p.shape[-1]]
            _values(self.data, p, self.dtype, out=rows)
            if name in permute:
                rows.copy_(_unpermute(rows, permute[name]))
            start += p.shape[-1]
        linear = nn.Linear(k, weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        return linear

    def leftovers(self) -> list[str]:
        return [name for name in self.tensors if not name.endswith("rope_freqs.weight")]


def load_quantized(path: Path, spec: ModelSpec, dtype: torch.dtype, dequantize_all: bool = False) -> CausalLM:
    """The model with its weights from the GGUF file at `path`, kept in their block formats (all
    de-quantized to `dtype` with `dequantize_all`: the values of transformers' conversion, bit for bit)."""
    weights = GGUFWeights(path, spec, dtype, dequantize_all)
    with torch.device("meta"):
        net = CausalLM(spec)
    h, kv = spec.num_heads, spec.num_kv_heads
    for i, layer in enumerate(net.layers):
        b = f"blk.{i}."
        q, k = b + "attn_q.weight", b + "attn_k.weight"
        layer.qkv_proj = weights.linear([q, k, b + "attn_v.weight"], permute={q: h, k: kv})
        layer.o_proj = weights.linear([b + "attn_output.weight"])
        layer.gate_up_proj = weights.linear([b + "ffn_gate.weight", b + "ffn_up.weight"])
        layer.down_proj = weights.linear([b + "ffn_down.weight"])
        layer.input_layernorm = weights.vector(b + "attn_norm.weight")
        layer.post_attention_layernorm = weights.vector(b + "ffn_norm.weight")
    net.norm = weights.vector("output_norm.weight")
    _load_embedding_and_head(net, weights, spec, dtype)
    if leftovers := weights.leftovers():
        raise ModelLoadError(f"{path.name}: tensors the llama layout does not use: {leftovers[:5]}")
    if weights.dequantized:
        shown = ", ".join(weights.dequantized[:4]) + (
            f" and {len(weights.dequantized) - 4} more" if len(weights.dequantized) > 4 else ""
        )
        log(f"no quantized kernel for {shown}: de-quantized to {str(dtype)[6:]} (the rest stays quantized)")
    del weights.data  # the file's mapping goes: every tensor was copied out
    net.eval()
    return net


def _load_embedding_and_head(net: CausalLM, weights: GGUFWeights, spec: ModelSpec, dtype: torch.dtype) -> None:
    """The logits head quantized where its format runs; the embedding looks its rows up in the
    head's blocks when tied (held once), in its own blocks otherwise."""
    tied = spec.tie_word_embeddings or "output.weight" not in weights.tensors
    embed = weights.take("token_embd.weight")
    if weights.dequantize_all:  # as the HF checkpoint's load leaves them: no logits_head until packing
        net.embed_tokens = nn.Embedding.from_pretrained(_values(weights.data, embed, dtype), freeze=True)
        net.lm_head = None if tied else weights.linear(["output.weight"])
        net.logits_head = None
        return
    if tied:
        head = embed
    else:
        head = weights.take("output.weight")
    if head.fmt in KERNEL_FORMATS:
        net.logits_head = QuantLinear(_blocks(weights.data, head), head.fmt, spec.hidden_size)
    else:
        weights.tensors[head.name] = head  # back, for linear() to de-quantize and name
        net.logits_head = weights.linear([head.name])
    net.lm_head = None if tied else net.logits_head
    if tied and isinstance(net.logits_head, QuantLinear):
        net.embed_tokens = QuantEmbedding.tied_to(net.logits_head, dtype)
    elif tied:
        net.embed_tokens = nn.Embedding.from_pretrained(net.logits_head.weight, freeze=True)
    elif embed.fmt in FLOATS:
        net.embed_tokens = nn.Embedding.from_pretrained(_values(weights.data, embed, dtype), freeze=True)
    else:
        net.embed_tokens = QuantEmbedding(_blocks(weights.data, embed), embed.fmt, spec.hidden_size, dtype)
