"""Linear layers and embeddings whose weight stays in a GGUF block format (issue #41).

A GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights are kept as the file holds them — uint8
[N, row bytes], one row of blocks (of 32 values; of 256 for the K formats) per output column — and
multiplied by our kernel (engine/kernels/csrc/quant_gemm.cpp)
on the CPU where it is built with AVX2 + FMA + F16C: `quant_gemv` de-quantizes inside the registers
for a few rows (decode, where the weights' bytes set the time), and from `gemv_rows()` + 1 rows
(prefill, batched decode) `quant_gemm` de-quantizes a panel of 48 columns into a cached fp32 buffer
once for up to 256 rows and multiplies it with the fp32 panel GEMM's register blocks. SmolLM2-135M's
Q4_1 projections are 0.625 bytes a weight against fp32's 4 and bf16's 2.

All of them are repacked at load (`pack_for_decode`: the same bytes, tiles of 16 columns;
csrc/quant_packed.cpp): one to four rows multiply 16 columns a register as
int16 (AVX-512 with BF16 and VNNI; 8 columns with AVX2, csrc/quant_packed_avx2.h) — each block of 32
activations rounded to 16 bits of its range, the products summed exactly in int32, each block's
scale applied once per tile; more rows read AMX tiles, bf16 panels (AVX512-BF16 without AMX: the
bf16 model's weights, multiplied as its panels multiply them) or fp32 panels straight out of the
tiles, no transpose. The file layout's kernels above run where packing is switched off (`KVTOP_QUANT_PACK=0`)
or a weight's N is not a multiple of 16. (Q5_0 is what llama.cpp's Q4_K_M writes for rows that are not
a multiple of 256, SmolLM2's 576; Q5_1 Q5_K_M's, likewise; Q5_K is most of a Q5_K_M file.)

The reference — `dequantize` (the `gguf` package's de-quantization) then `F.linear` — is the oracle
in the tests, and the path where the kernel is not built. A tied embedding looks its rows up in the
logits head's blocks and de-quantizes only the rows it reads: the table is held once.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from engine.kernels import cpu
from engine.model.packed_linear import gate_up_order
from engine.runtime.knobs import knob

# the formats our kernel runs, by ggml type id (quant_blocks.h's kQ4_0 … kQ6_K)
KERNEL_FORMATS = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)


def kernel_available() -> bool:
    """The kernel extension built here with the quantized GEMM (AVX2 + FMA + F16C)."""
    return cpu.says("quant_linear_supported")


def gemv_rows() -> int:
    """Up to this many rows `quant_linear` de-quantizes in the registers (quant_gemv); above, a panel
    at a time (quant_gemm). The kernel's constant: one home for it."""
    return int(torch.ops.kvtop_cpu.quant_gemv_rows())


def packed_kernel_available() -> bool:
    """The kernel extension built here with the packed kernels (AVX-512 BW + BF16, or AVX2 + FMA + F16C)."""
    return cpu.says("quant_packed_supported")


def gate_up_kernel_available() -> bool:
    """The kernel extension built here with SiLU-and-mul over gate/up tile pairs (AVX-512 BW + BF16)."""
    return cpu.says("quant_gate_up_supported")


PACKED_FORMATS = KERNEL_FORMATS  # what quant_pack repacks (csrc/quant_packed.h's packable_format): all of them
PACKED_OFFSET = 100  # a packed weight's kernel format: its ggml type + this (quant_blocks.h's kPackedFormat)
PACKED_TILE = 16  # columns per tile: N must be a multiple


def dequantize(blocks: torch.Tensor, fmt: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    """The float32 [N, K] weight of GGUF blocks [N, row bytes] (the `gguf` package's values: the
    oracle, and what transformers de-quantizes a GGUF file to)."""
    values = gguf_dequantize(blocks.numpy(), fmt)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(blocks.shape[0], in_features)


def row_bytes(fmt: GGMLQuantizationType, in_features: int) -> int:
    """Bytes of one output column's blocks."""
    block, size = GGML_QUANT_SIZES[fmt]
    return in_features // block * size


class QuantLinear(nn.Module):
    """y = x W^T (+ bias) with W as GGUF blocks of one kernel format; x float32 or bfloat16 (computed
    in fp32, returned in x's dtype). `blocks` is a buffer: [N, row_bytes(fmt, K)] uint8."""

    def __init__(self, blocks: torch.Tensor, fmt: GGMLQuantizationType, in_features: int, bias=None) -> None:
        super().__init__()
        if fmt not in KERNEL_FORMATS:
            raise TypeError(f"no quantized kernel for {fmt.name}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, blocks.shape[0]
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (self.out_features, row_bytes(fmt, in_features)):
            raise ValueError(f"{fmt.name} blocks for K={in_features} must be uint8 [N, {row_bytes(fmt, in_features)}]")
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.use_kernel = kernel_available()
        self.packed = False  # `blocks` in quant_pack's tiles rather than the file's layout

    @property
    def kernel_format(self) -> int:
        """The format id quant_linear takes for `blocks`: the ggml type, + PACKED_OFFSET once packed."""
        return int(self.fmt) + (PACKED_OFFSET if self.packed else 0)

    def packable(self) -> bool:
        return self.use_kernel and self.fmt in PACKED_FORMATS and self.out_features % PACKED_TILE == 0

    def pack(self) -> None:
        """Repack the blocks for decode (same bytes; the caller checked packed_kernel_available)."""
        if not self.packed and self.packable():
            self.blocks = torch.ops.kvtop_cpu.quant_pack(self.blocks, int(self.fmt), self.out_features)
            self.packed = True

    def file_blocks(self) -> torch.Tensor:
        """The blocks in the file's layout (a copy when packed)."""
        if not self.packed:
            return self.blocks
        return torch.ops.kvtop_cpu.quant_unpack(self.blocks, int(self.fmt), self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, n = x.reshape(-1, self.in_features), self.out_features
        if self.use_kernel:  # decode_layers (csrc/decode_layers.cpp) calls the same op for its quantized kind
            y = torch.ops.kvtop_cpu.quant_linear(x2, self.blocks, self.kernel_format, n, self.bias)
        else:
            y = F.linear(x2.float(), self.dense_weight(), self.bias).to(x.dtype)
        return y.view(*x.shape[:-1], n)

    def dense_weight(self) -> torch.Tensor:
        """The float32 [N, K] weight (the reference's de-quantization)."""
        return dequantize(self.file_blocks(), self.fmt, self.in_features)

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, in_features={self.in_features}, out_features={self.out_features}"


class QuantGateUp(QuantLinear):
    """An MLP's gate/up projection [2I, K] packed with gate and up tiles in turn (tile 2g: gate rows
    16g .. 16g + 15, tile 2g + 1: the same up rows), so that `silu_and_mul(x)` never writes the
    [rows, 2I] output: on AMX it comes from the tiles' epilogue, otherwise from one pass over the tile
    pairs (csrc/quant_gemm.cpp's quant_gate_up). `forward` gives the dense [gate, up] order, bit for
    bit a packed QuantLinear's on the same blocks; `silu_and_mul` is `kernels.silu_and_mul(forward(x))`, bit
    for bit. Made from a packable QuantLinear whose I is a multiple of 16 (`fits`)."""

    @staticmethod
    def fits(linear: nn.Module) -> bool:
        return (
            type(linear) is QuantLinear
            and linear.packable()
            and linear.out_features % (2 * PACKED_TILE) == 0
            and gate_up_kernel_available()
        )

    @classmethod
    def from_linear(cls, linear: QuantLinear) -> QuantGateUp:
        order = gate_up_order(linear.out_features)
        bias = None if linear.bias is None else linear.bias[order]
        gate_up = cls(linear.file_blocks()[order], linear.fmt, linear.in_features, bias)
        gate_up.pack()
        return gate_up

    @property
    def inter(self) -> int:
        return self.out_features // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvtop_cpu.quant_gate_up(x, self.blocks, self.kernel_format, self.inter, self.bias, False)

    def silu_and_mul(self, x: torch.Tensor, kernels) -> torch.Tensor:
        """`kernels.silu_and_mul(self(x))`; without the [rows, 2I] output where that is the cpu kernels' op."""
        if kernels is not cpu:
            return kernels.silu_and_mul(self(x))
        return torch.ops.kvtop_cpu.quant_gate_up(x, self.blocks, self.kernel_format, self.inter, self.bias, True)

    def dense_weight(self) -> torch.Tensor:
        return super().dense_weight()[torch.argsort(gate_up_order(self.out_features))]


def pack_for_decode(net: nn.Module) -> int:
    """Repack a model's QuantLinears (its layers' and its logits head's; an
    embedding tied to a Q8_0 head reads the packed blocks; an MLP's gate/up becomes a QuantGateUp)
    where the packed kernel is built; returns how many were packed."""
    if knob("KVTOP_QUANT_PACK") == "0" or not packed_kernel_available():
        return 0
    packed = 0
    for layer in net.layers:
        if QuantGateUp.fits(getattr(layer, "gate_up_proj", None)):
            layer.gate_up_proj = QuantGateUp.from_linear(layer.gate_up_proj)
            packed += 1
    for module in net.layers.modules():
        if isinstance(module, QuantLinear) and not module.packed and module.packable():
            module.pack()
            packed += 1
    head, embed = net.logits_head, net.embed_tokens
    if isinstance(head, QuantLinear) and head.packable():
        tied = isinstance(embed, QuantEmbedding) and embed.blocks is head.blocks
        if not tied or head.fmt == GGMLQuantizationType.Q8_0:  # the rows the embedding reads back
            head.pack()
            packed += 1
            if tied:
                embed.read_packed(head.blocks)
    return packed


class StackedLinear(nn.Module):
    """One projection made of a file's tensors in different formats — Q4_K_M keeps q and k in Q4_K
    and, in some layers, v in Q6_K: each part keeps its own blocks and their outputs are concatenated,
    where fusing them would de-quantize the whole projection."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class QuantEmbedding(nn.Module):
    """An embedding table held as GGUF blocks (its own, or a tied logits head's): a lookup
    de-quantizes only the rows it reads. Any format the `gguf` package de-quantizes."""

    def __init__(self, blocks: torch.Tensor, fmt: GGMLQuantizationType, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.fmt, self.embedding_dim, self.dtype = fmt, embedding_dim, dtype
        self.num_embeddings = blocks.shape[0]
        self.register_buffer("blocks", blocks)
        self.packed = False  # Q8_0 blocks in quant_pack's tiles (a tied head's, packed)

    @classmethod
    def tied_to(cls, head: QuantLinear, dtype: torch.dtype) -> QuantEmbedding:
        return cls(head.blocks, head.fmt, head.in_features, dtype)  # the same tensor: held once

    def read_packed(self, blocks: torch.Tensor) -> None:
        """Look rows up in a tied Q8_0 head's packed blocks (the same tensor: still held once)."""
        if self.fmt != GGMLQuantizationType.Q8_0:
            raise TypeError(f"an embedding reads packed Q8_0 blocks, not {self.fmt.name}")
        self.blocks, self.packed = blocks, True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.packed:  # the head's tiles (csrc/quant_packed.cpp): the same values, no gather in Python
            rows = torch.ops.kvtop_cpu.quant_packed_rows(self.blocks, flat, self.num_embeddings)
        else:
            rows = dequantize(self.blocks[flat], self.fmt, self.embedding_dim)
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)
