"""Linear layers whose weight is prepacked once for the CPU's GEMM (issue #13).

`F.linear` on the CPU reorders its weight into the GEMM library's blocked layout on every call;
these layers hold the weight already reordered and call the packed op directly, as torch's own
inductor does with `freezing=True`. `pack_model` swaps a loaded model's four projections per
layer, and its logits matmul, for them, on the CPU in bf16 (any other dtype or device keeps
`nn.Linear`). Two packed kinds:

- `AMXLinear`, where the CPU has AMX (Sapphire Rapids and later) and the kernel extension built:
  our own tile kernel (engine/kernels/csrc/amx_linear.cpp), which streams the weights of a decode
  step at 20-24 GB/s where oneDNN's reached 7-12 (1-32 rows: 1.2-2.4x faster, 64-1,024 rows
  1.3-1.6x, about even at 2,048; benchmarks/linear.py). An MLP's gate/up projection is `AMXGateUp`,
  SiLU-and-mul in the kernel's epilogue. The weight in its tile layout; where
  `large_gemm_copy` allows, also oneDNN's packed copy, which takes inputs of LARGE_ROWS rows and
  more (long prefill steps, where it measured faster end to end).
- `PanelLinear` (engine/model/panel_linear.py) on AVX512-BF16 without AMX (AMD Zen 4): our
  panel kernel (engine/kernels/csrc/bf16_gemm.cpp), 1.3-1.6x oneDNN at a decode step's 1-16 rows,
  about even from 64, ~10 % behind from 256 (oneDNN keeps 94-96 % of the VDPBF16PS peak on one core,
  ours 83-87 %); a tied embedding reads its rows from the head's panels. Where `large_gemm_copy`
  allows, the projections hold oneDNN's packed copy for LARGE_ROWS rows and more too, as on AMX
  (a mixed-workload prefill step of 2,048 tokens 0.94x the time).
- `OneDNNLinear` otherwise (AVX-512 without BF16 or AMX, or the extension missing): oneDNN's packed GEMM.

fp32 is not packed with oneDNN by default (its packed fp32 measured slower end to end than MKL's
sgemm); on AVX-512 or AVX2 its layers become `PanelLinear` instead (engine/model/panel_linear.py): the
weight packed in 48-column panels for our kernel (engine/kernels/csrc/fp32_gemm.cpp), any number
of rows.

`KVTOP_PACKED_LINEAR=0` turns packing (and the fp32 panels) off, `=onednn` uses oneDNN's even where
AMX or the bf16 panels are there, and `=all` packs fp32 with oneDNN too, to compare (slower end to end: see packed_dtypes).

The packed op is oneDNN's (`torch.ops.mkldnn`): its packed weight replaces the original (no second
copy; `weight.to_dense()` reads it back), and it is right for any number of rows, the batch size
given at pack time being only a layout hint that measured within noise from 1 to 2,048 rows. MKL's
packed fp32 GEMM (`torch.ops.mkl._mkl_linear`) was measured too and left out: it is packed for one
row count only (any other runs the plain GEMM on the original weight, so it needs both copies) and
gained little more than oneDNN at that count (benchmarks/HISTORY.md, "Prepacked linear layers").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu
from engine.model.panel_linear import PanelEmbedding, PanelLinear, fits, kernel_available, to_panels, unpanelled
from engine.runtime.knobs import knob
from engine.runtime.log import log
from kvtop.protocol.config import format_bytes

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ENV = "KVTOP_PACKED_LINEAR"
LARGE_ENV = "KVTOP_LARGE_GEMM"
# From this many rows (a long prefill step) an AMX projection runs on oneDNN's packed GEMM, where it
# holds that copy too: SmolLM2-135M bf16, 2-core AMX VM, whole prefill steps alternated in one
# process: 2,048 rows 0.79x the step time, 1,536 0.85x, 1,024 1.07x, 512 1.09x, 256 1.01x.
LARGE_ROWS = 1536
LARGE_COPY_MAX = 1 << 30  # `auto` holds the second copy only up to this size (SmolLM2-135M: 203 MiB)


def onednn_available(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear exists in this torch, and for bf16 this CPU runs it (AVX-512 or
    AVX-NE-CONVERT: an AVX2-only CPU keeps nn.Linear in bf16, as inductor does)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")):
        return False
    return dtype != torch.bfloat16 or ops._is_mkldnn_bf16_supported()


class OneDNNLinear(nn.Module):
    """`weight` is oneDNN's opaque tensor: right shape, dtype and size; `weight.to_dense()` reads it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self(weight.new_zeros(1, self.in_features))  # an op that fails on this CPU fails here, not mid-step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


# amx_linear's weight layout [N/32, K/32, 2, 16, 32] (csrc/amx_linear.cpp): tile (g, kb, h) row r
# holds, for its 16 columns n = 32g + 16h + c, the pair W[n, 32kb + 2r + p] (TDPBF16PS's VNNI pairs).
# As a view of the padded dense weight that is [g, h, c, kb, r, p] permuted to [g, kb, h, r, c, p].
_TILE_ORDER = (0, 3, 1, 4, 2, 5)


def _pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """The dense [N, K] weight, zero-padded to multiples of 32, in amx_linear's tile layout."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, -k % 32, 0, -n % 32))
    groups, kbs = padded.shape[0] // 32, padded.shape[1] // 32
    tiles = padded.view(groups, 2, 16, kbs, 16, 2).permute(_TILE_ORDER)
    return tiles.reshape(groups, kbs, 2, 16, 32).contiguous()


def _unpack_tiles(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """`_pack_tiles` undone: the dense [N, K] weight."""
    groups, kbs = packed.shape[:2]
    inverse = tuple(sorted(range(6), key=_TILE_ORDER.__getitem__))
    dense = packed.view(groups, kbs, 2, 16, 16, 2).permute(inverse).reshape(groups * 32, kbs * 32)
    return dense[:out_features, :in_features].contiguous()


def amx_available() -> bool:
    """The kernel extension built here and this CPU and kernel allow AMX tiles."""
    return cpu.says("amx_supported")


class AMXLinear(nn.Module):
    """bf16 linear on AMX tiles: `weight` holds the tile layout ([N/32, K/32, 2, 16, 32], same bytes
    as the original up to padding to 32); `dense_weight()` reads the original back."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, large: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(_pack_tiles(weight), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # the kernel adds the bias in fp32: converted once here, not on every call
        self.register_buffer("bias_fp32", None if bias is None else bias.detach().float(), persistent=False)
        # prefill-sized inputs (LARGE_ROWS rows and more) go to oneDNN's packed GEMM: a second copy
        self.large = OneDNNLinear(weight, bias, LARGE_ROWS) if large else None
        self(weight.new_zeros(1, self.in_features))  # an op that fails here fails at load, not mid-step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.large is not None and x.numel() >= LARGE_ROWS * self.in_features:
            return self.large(x)
        return torch.ops.kvtop_cpu.amx_linear(x, self.weight, self.bias_fp32, self.out_features)

    def dense_weight(self) -> torch.Tensor:
        return _unpack_tiles(self.weight, self.out_features, self.in_features)


def gate_up_order(out_features: int) -> torch.Tensor:
    """Row order of a gate/up weight [2I, K] for amx_gate_up (and QuantGateUp): 16 gate rows, the same 16 up rows, ..."""
    blocks = torch.arange(out_features).view(2, -1, 16)  # [gate/up, I/16, 16]
    return blocks.transpose(0, 1).reshape(-1)


class AMXGateUp(AMXLinear):
    """An MLP's gate/up projection on AMX tiles, packed with gate and up rows interleaved by 16 so that
    `silu_and_mul(x)` comes straight from the tiles' epilogue (csrc/amx_linear.cpp's amx_gate_up): the
    [rows, 2I] output is never written nor read back. Bit for bit `silu_and_mul(forward(x))` on the cpu
    kernels; `forward` still gives the dense [gate, up] order. No oneDNN prefill copy (`large` is
    ignored): SmolLM2's gate/up + SiLU-and-mul, 30 layers at 2,048 rows, 90 ms fused against 117-119
    through oneDNN's copy and the separate op (benchmarks/HISTORY.md, "Ninth pass"). 2I must be a
    multiple of 32 (`fits`)."""

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return weight.shape[0] % 32 == 0

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, large: bool = False) -> None:
        order = gate_up_order(weight.shape[0])
        self.inter = weight.shape[0] // 2
        super().__init__(weight[order], None if bias is None else bias[order])
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvtop_cpu.amx_gate_up(x, self.weight, self.bias_fp32, self.inter, False)

    def silu_and_mul(self, x: torch.Tensor, kernels) -> torch.Tensor:
        """`kernels.silu_and_mul(self(x))`; in the epilogue where that is the cpu kernels' op."""
        if kernels is not cpu:
            return kernels.silu_and_mul(self(x))
        return torch.ops.kvtop_cpu.amx_gate_up(x, self.weight, self.bias_fp32, self.inter, True)

    def dense_weight(self) -> torch.Tensor:
        interleaved = super().dense_weight()
        return interleaved[torch.argsort(gate_up_order(self.out_features))]


class TiledEmbedding(nn.Module):
    """A tied embedding looked up in its logits head's tile layout, so the table is held once: the
    dense copy (SmolLM2: 49,152 x 576 bf16, 54 MiB) goes. Row n of W sits, for each K block kb, in
    tile (n // 32, kb, (n % 32) // 16), column n % 16 of every row r, as the pairs W[n, 32kb + 2r + p]:
    one gather over that view, a pair as one 32-bit element, gives the rows in order (2,048 ids:
    about 2 ms against 0.7 for the dense table; 64 ids: 0.05 ms)."""

    def __init__(self, head: AMXLinear) -> None:
        super().__init__()
        self.head = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tiles = self.head.weight
        groups, kbs = tiles.shape[:2]
        pairs = tiles.view(torch.int32).view(groups, kbs, 2, 16, 16)  # [g, kb, h, r, c]: W[n, 32kb+2r : +2]
        n = ids.reshape(-1)
        rows = pairs[n // 32, :, (n % 32) // 16, :, n % 16]  # [ids, kb, r]
        dense = rows.reshape(n.numel(), kbs * 16).view(tiles.dtype)[:, : self.embedding_dim]
        return dense.contiguous().view(*ids.shape, self.embedding_dim)


def packed_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = 64, large: bool = False, gate_up: bool = False
) -> nn.Module:
    """The packed layer for this weight: AMX where the CPU has it, else our bf16 panels where it has
    AVX512-BF16 (neither with KVTOP_PACKED_LINEAR=onednn), else oneDNN's. `large`: an AMX or panel layer also
    holds oneDNN's copy for prefill-sized inputs; `gate_up`: an MLP's gate/up weight, on AMX an
    AMXGateUp where it fits."""
    ours = weight.dtype == torch.bfloat16 and knob(ENV) != "onednn"
    if ours and amx_available():
        if gate_up and AMXGateUp.fits(weight):
            return AMXGateUp(weight, bias, large=large)
        return AMXLinear(weight, bias, large=large)
    if ours and fits(weight) and kernel_available(weight.dtype):
        layer = PanelLinear(weight, bias)
        layer(weight.new_zeros(1, layer.in_features))  # an op that fails here fails at load, not mid-step
        if large:  # prefill-sized inputs to oneDNN's packed GEMM, as for AMX: a second copy
            layer.large, layer.large_rows = OneDNNLinear(weight, bias, LARGE_ROWS), LARGE_ROWS
        return layer
    return OneDNNLinear(weight, bias, batch_hint)


def large_gemm_copy(projection_bytes: int) -> bool:
    """Whether the AMX (or bf16 panel) projections also hold oneDNN's packed copy for prefill-sized inputs
    (`KVTOP_LARGE_GEMM`: `auto`, the default, when that copy is at most LARGE_COPY_MAX bytes;
    `1` always; `0` never)."""
    mode = knob(LARGE_ENV)
    if mode == "0" or not onednn_available(torch.bfloat16):
        return False
    return mode == "1" or projection_bytes <= LARGE_COPY_MAX


def packed_dtypes() -> tuple[torch.dtype, ...]:
    """bf16 by default. fp32 only with KVTOP_PACKED_LINEAR=all: end to end on SmolLM2 (2 threads, 64
    prompts x 256 -> 128) packed fp32 ran at 181 tok/s against plain fp32's 207, and one sequence's
    decode step 13 % slower; bf16 packed 513 against 386."""
    mode = knob(ENV)
    return () if mode == "0" else (torch.bfloat16, torch.float32) if mode == "all" else (torch.bfloat16,)


def applies(weight: torch.Tensor) -> bool:
    """Packing applies: a CPU weight in a packed dtype (see packed_dtypes), oneDNN present, not turned off."""
    return weight.device.type == "cpu" and weight.dtype in packed_dtypes() and onednn_available(weight.dtype)


def second_copy_bytes(model: nn.Module) -> int:
    """Bytes of the oneDNN copies AMX or bf16-panel projections hold for prefill-sized inputs (0 without them)."""
    return sum(
        sum(p.numel() * p.element_size() for p in m.large.parameters())
        for m in model.modules()
        if isinstance(m, (AMXLinear, PanelLinear)) and m.large is not None
    )


def weights_note(weights_format: str, weights_bytes: int, copy_bytes: int) -> str:
    """The weights' formats and bytes, and any prefill copy, in words, for start lines."""
    note = f"{weights_format}: {format_bytes(weights_bytes)}"
    if not copy_bytes:
        return note
    return (
        f"{note} + {format_bytes(copy_bytes)}: a oneDNN copy of the projections "
        f"for prefill steps of {LARGE_ROWS:,}+ tokens ({LARGE_ENV}=0: without)"
    )


def unpacked(layer: OneDNNLinear | AMXLinear | PanelLinear) -> nn.Linear:
    """The plain nn.Linear a packed layer came from (same weight and bias)."""
    if isinstance(layer, PanelLinear):
        return unpanelled(layer)
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    dense = layer.dense_weight() if isinstance(layer, AMXLinear) else layer.weight.to_dense()
    linear.weight = nn.Parameter(dense, requires_grad=False)
    if layer.bias is not None:
        linear.bias = layer.bias
    return linear


@torch.no_grad()
def pack_model(model: nn.Module, batch_hint: int = 64) -> bool:
    """Swap the model's four projections per layer and its logits matmul for packed layers, in
    place; False where packing does not apply, or (one log line, the model back to nn.Linear) fails.
    Each original goes as soon as its packed copy exists: loading never holds two copies.
    fp32 gets PanelLinear instead where the CPU has AVX-512 or AVX2 (engine/model/panel_linear.py); that
    returns False too."""
    weight = model.embed_tokens.weight
    if not applies(weight):
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and knob(ENV) != "0":
            to_panels(model, PROJECTIONS)
        return False
    done: list[tuple[nn.Module, str]] = []
    # summed without holding the weights: a list of them would keep every original alive through the
    # loop below, twice the weights at its end (an 8B model's 15 GB bf16 would need 30)
    large = large_gemm_copy(sum(getattr(layer, name).weight.nbytes for layer in model.layers for name in PROJECTIONS))
    try:
        for layer in model.layers:
            for name in PROJECTIONS:
                linear = getattr(layer, name)
                packed = packed_linear(linear.weight, linear.bias, batch_hint, large, gate_up=name == "gate_up_proj")
                setattr(layer, name, packed)
                done.append((layer, name))
        # compute_logits uses it when present; a tied embedding's lookup then reads its tiles (below)
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.logits_head = packed_linear(head, None, batch_hint)
        if model.lm_head is not None:
            model.lm_head = model.logits_head  # the dense original goes
    except Exception as exc:  # the op missing or refusing this build: plain nn.Linear, as before
        for layer, name in done:
            setattr(layer, name, unpacked(getattr(layer, name)))
        model.logits_head = None
        log(f"prepacked linear layers off ({type(exc).__name__}: {exc}); using nn.Linear")
        return False
    if model.lm_head is None and isinstance(model.logits_head, AMXLinear):
        model.embed_tokens = TiledEmbedding(model.logits_head)  # the lookup reads the tiles: one copy
    elif model.lm_head is None and isinstance(model.logits_head, PanelLinear):
        model.embed_tokens = PanelEmbedding(model.logits_head)  # the lookup reads the panels: one copy
    return True
