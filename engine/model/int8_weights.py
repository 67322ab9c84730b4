"""Weights quantized at load, `quantization="int8"` (issue #41): any checkpoint's projections,
logits head and untied embedding become Q8_0 blocks — int8 values with one fp16 scale per 32 along
K (finer than one scale per output channel, at 8.5 bits a weight) — and run on the kernel that runs
a GGUF file's blocks (engine/model/quant_linear.py's QuantLinear). A tied embedding looks its rows
up in the head's blocks: the table is held once. The blocks are the `gguf` package's Q8_0 quantization, so a
weight moves by at most half its block's step.

On the CPU only, where the kernel is built (AVX2 + FMA + F16C); elsewhere, or for a projection whose
K is not a multiple of 32, the weights stay as loaded, with one line saying so.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from engine.model.llama import CausalLM
from engine.model.packed_linear import PROJECTIONS
from engine.model.quant_linear import QuantEmbedding, QuantLinear, kernel_available

Q8_0 = GGMLQuantizationType.Q8_0
BLOCK = 32  # values per Q8_0 block


def int8_refusal(device: str) -> str | None:
    """Why int8 weights cannot be made here (one line), or None when they can."""
    if not device.startswith("cpu"):
        return f"int8 weights run on the CPU only: keeping the weights as loaded for {device}"
    if not kernel_available():
        return "the quantized kernel is not built here (needs AVX2 with FMA and F16C): keeping the weights as loaded"
    return None


def q8_blocks(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] weight as Q8_0 blocks, uint8 [N, K/32 * 34]."""
    return torch.from_numpy(quantize(weight.detach().float().numpy(), Q8_0))


def quantize_int8(net: CausalLM, dtype: torch.dtype) -> list[str]:
    """Swap `net`'s projections and logits head for Q8_0 ones, in place, each original going as its
    copy is made; returns the names of those left as loaded (K not a multiple of 32)."""
    kept: list[str] = []
    for i, layer in enumerate(net.layers):
        for name in PROJECTIONS:
            linear = getattr(layer, name)
            if linear.in_features % BLOCK:
                kept.append(f"layers.{i}.{name}")
                continue
            setattr(layer, name, QuantLinear(q8_blocks(linear.weight), Q8_0, linear.in_features, bias=linear.bias))
    hidden = net.spec.hidden_size
    if hidden % BLOCK:
        return [*kept, "logits head"]
    tied = net.lm_head is None
    head = net.embed_tokens.weight if tied else net.lm_head.weight
    net.logits_head = QuantLinear(q8_blocks(head), Q8_0, hidden)
    if tied:
        net.embed_tokens = QuantEmbedding.tied_to(net.logits_head, dtype)
    else:
        net.lm_head = net.logits_head
        net.embed_tokens = QuantEmbedding(q8_blocks(net.embed_tokens.weight), Q8_0, hidden, dtype)
    return kept
