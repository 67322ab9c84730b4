"""Linear layers on the CPU with their weight packed in column panels (issue #13).

fp32, on AVX-512 or AVX2 with FMA: a loaded fp32 model's four projections per layer and its logits
matmul become `PanelLinear`: the weight packed once as panels of 48 output columns ([ceil(N/48), K,
48], one contiguous stream each, zero-padded), multiplied by our kernel
(engine/kernels/csrc/fp32_gemm.cpp) for any number of rows. It replaces MKL's sgemm, which repacks
the weight on every call and, at a decode step's 16-64 rows with the weights coming from DRAM, left
the FMA units idle while they streamed: SmolLM2-135M's linears (benchmarks/linear.py --dtype
float32) 1.5-1.7x faster at 4-16 rows, 1.35-1.4x at 64, even from 256 rows to a 2,048-token
prefill, 0.9-1.0x at one row (MKL's GEMV) (benchmarks/HISTORY.md, "Tenth pass").

bf16, on AVX512-BF16 without AMX (AMD Zen 4): the same panels with K in pairs ([ceil(N/48), K/2,
48, 2], VDPBF16PS's operand), engine/kernels/csrc/bf16_gemm.cpp, in place of oneDNN's packed GEMM
(`packed_linear.packed_linear` chooses; AMX, where the CPU has it, comes first): 1.3-1.6x oneDNN at
1-16 rows, about even from 64 (both near the two cores' VDPBF16PS peak) (benchmarks/HISTORY.md,
"Twelfth pass").

The panels replace the original (one copy); a tied embedding looks its rows up in the head's
panels. `KVTOP_PACKED_LINEAR=0` keeps nn.Linear; `=onednn` keeps oneDNN's for bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu
from engine.runtime.log import log

PANEL = 48  # output columns per panel (csrc/fp32_gemm.cpp's and csrc/bf16_gemm.cpp's kNR)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """The dense [N, K] weight as panels of 48 columns. fp32: [ceil(N/48), K, 48], panel p row k
    holds W[48p : 48p + 48, k]; bf16: [ceil(N/48), K/2, 48, 2], row j holds the pairs W[48p + c, 2j : 2j + 2]."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -n % PANEL))
    if weight.dtype == torch.bfloat16:
        return padded.view(-1, PANEL, k // 2, 2).transpose(1, 2).contiguous()
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """`pack_panels` undone: the dense [N, K] weight."""
    count, rows = panels.shape[:2]
    k = rows * 2 if panels.dim() == 4 else rows
    return panels.transpose(1, 2).reshape(count * PANEL, k)[:out_features].contiguous()


def kernel_available(dtype: torch.dtype = torch.float32) -> bool:
    """The kernel extension built here with the panel GEMM for this dtype: fp32 on AVX-512 or AVX2
    with FMA, bf16 on AVX512-BF16."""
    if dtype == torch.bfloat16:
        return cpu.says("bf16_linear_supported")
    return dtype == torch.float32 and cpu.says("fp32_linear_supported")


def fits(weight: torch.Tensor) -> bool:
    """A weight the panel kernel takes: fp32, or bf16 with K even (pairs)."""
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0)


class PanelLinear(nn.Module):
    """fp32 or bf16 linear on the panel kernel: `weight` holds the panels (same bytes as the original
    up to padding N to 48); `dense_weight()` reads the original back. bf16 adds its bias in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if not fits(weight):
            raise TypeError(f"no panel kernel for a {weight.dtype} [{weight.shape[0]}, {weight.shape[1]}] weight")
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(pack_panels(weight), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # the bf16 kernel adds the bias in fp32: converted once here, not on every call
        bf16_bias = bias is not None and weight.dtype == torch.bfloat16
        self.register_buffer("bias_fp32", bias.detach().float() if bf16_bias else None, persistent=False)
        # engine/model/packed_linear.py may give a bf16 layer oneDNN's packed copy for inputs of at
        # least `large_rows` rows (long prefill steps), where oneDNN's GEMM keeps more of the peak
        self.large: nn.Module | None = None
        self.large_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.large is not None and x.numel() >= self.large_rows * self.in_features:
            return self.large(x)
        if self.weight.dim() == 4:  # bf16 pairs
            return torch.ops.kvtop_cpu.bf16_gemm(x, self.weight, self.bias_fp32, self.out_features)
        return torch.ops.kvtop_cpu.fp32_gemm(x, self.weight, self.bias, self.out_features)

    def dense_weight(self) -> torch.Tensor:
        return unpack_panels(self.weight, self.out_features)


class PanelGateUp(PanelLinear):
    """An fp32 MLP's gate/up projection on the panels with SiLU-and-mul in the kernel's epilogue
    (csrc/fp32_gemm.cpp's fp32_gate_up_silu, AVX-512): a work item multiplies a gate panel and its up
    panel and writes their 48 products, so the [rows, 2I] output is never written nor read back (a
    2,048-token step's SiLU-and-mul read 25 MB of it and took ~6 % of the step). Same panels as
    PanelLinear (the gate's I columns, then the up's); bit for bit `silu_and_mul(forward(x))`. I must
    be a multiple of 48 (`fits_gate_up`)."""

    @staticmethod
    def fits_gate_up(weight: torch.Tensor) -> bool:
        return weight.dtype == torch.float32 and weight.shape[0] % (2 * PANEL) == 0

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.inter = self.out_features // 2

    def silu_and_mul(self, x: torch.Tensor, kernels) -> torch.Tensor:
        """`kernels.silu_and_mul(self(x))`; in the epilogue where that is the cpu kernels' op."""
        if kernels is not cpu:
            return kernels.silu_and_mul(self(x))
        return torch.ops.kvtop_cpu.fp32_gate_up_silu(x, self.weight, self.bias, self.inter)


class PanelEmbedding(nn.Module):
    """A tied embedding looked up in its logits head's panels, so the table is held once: row n is
    column n % 48 of panel n // 48 (one strided gather)."""

    def __init__(self, head: PanelLinear) -> None:
        super().__init__()
        self.head = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.reshape(-1)
        rows = self.head.weight[n // PANEL, :, n % PANEL]  # [ids, K] (bf16: [ids, K/2, 2])
        return rows.reshape(*ids.shape, self.embedding_dim)


def to_panels(model: nn.Module, projections: tuple[str, ...]) -> bool:
    """Swap an fp32 CPU model's projections and logits matmul for PanelLinear, in place, where the
    kernel built here has AVX-512 or AVX2. Each original goes as soon as its panels exist (loading never holds
    two copies); on any failure (one log line) the model is back on nn.Linear. True when swapped."""
    if not kernel_available():
        return False
    fused = cpu.says("fp32_gate_up_supported")
    done: list[tuple[nn.Module, str]] = []
    try:
        for layer in model.layers:
            for name in projections:
                linear = getattr(layer, name)
                if linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
                    raise TypeError(f"{name} holds a {linear.weight.dtype} {linear.weight.device.type} weight")
                gate_up = fused and name == "gate_up_proj" and PanelGateUp.fits_gate_up(linear.weight)
                setattr(layer, name, (PanelGateUp if gate_up else PanelLinear)(linear.weight, linear.bias))
                done.append((layer, name))
                if len(done) == 1:  # an op that fails on this CPU fails here, not mid-step
                    getattr(layer, name)(linear.weight.new_zeros(1, linear.in_features))
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.logits_head = PanelLinear(head, None)
    except Exception as exc:  # the op refusing this build: plain nn.Linear, as before
        for layer, name in done:
            setattr(layer, name, unpanelled(getattr(layer, name)))
        model.logits_head = None
        log(f"fp32 panel linear layers off ({type(exc).__name__}: {exc}); using nn.Linear")
        return False
    if model.lm_head is None:
        model.embed_tokens = PanelEmbedding(model.logits_head)  # the lookup reads the panels: one copy
    else:
        model.lm_head = model.logits_head  # the dense original goes
    return True


def unpanelled(layer: PanelLinear) -> nn.Linear:
    """The plain nn.Linear a PanelLinear came from (same weight values and bias)."""
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    linear.weight = nn.Parameter(layer.dense_weight(), requires_grad=False)
    if layer.bias is not None:
        linear.bias = layer.bias
    return linear
