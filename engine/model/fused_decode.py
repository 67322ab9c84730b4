"""A decode-only step's decoder layers as one C++ op (issue #13).

On the CPU a decode step of a small model is short (SmolLM2-135M, 64 sequences, bf16: ~55 ms), and
its ~600 op calls from Python cost 10-20 us each on the main thread while the other OpenMP worker
waits: 21 % of the main thread's time went outside the kernels. `kvtop_cpu::decode_layers`
(engine/kernels/csrc/decode_layers.cpp) runs the same kernels in the same order from C++ — results
bit for bit the Python loop's — for the steps it covers: every token a one-token decode, the `cpu`
attention backend, float32 or bfloat16, a KV cache of the model's dtype (int8/fp8 caches and fp8
calibration keep the Python loop), and projections of the layer classes `packed_linear` makes, or
`quant_linear.QuantLinear` (a GGUF's blocks).
Anything else, and `KVTOP_FUSED_DECODE=0`, runs the Python loop.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.attention import AttentionBatch
from engine.kv.cache import KVLayer
from engine.model import packed_linear as pl
from engine.model.panel_linear import PanelGateUp, PanelLinear
from engine.model.quant_linear import QuantGateUp, QuantLinear
from engine.runtime.knobs import knob

ENV = "KVTOP_FUSED_DECODE"
_DTYPES = (torch.float32, torch.bfloat16)
QUANT_KIND = 1000  # decode_layers.cpp's kQuantKind: a QuantLinear's kind is this + its kernel format
QUANT_GATE_UP_KIND = 2000  # its kQuantGateUpKind: a QuantGateUp's (SiLU-and-mul on its tile pairs)


def _kind(module: nn.Module) -> tuple[int, torch.Tensor, torch.Tensor | None] | None:
    """decode_layers.cpp's kind for this projection, the weight and bias it takes; None: not covered."""
    if isinstance(module, pl.AMXGateUp):  # gate/up with SiLU-and-mul in its epilogue
        return 4, module.weight, module.bias_fp32
    if isinstance(module, PanelGateUp):  # the same, on the fp32 panels
        return 6, module.weight, module.bias
    if isinstance(module, pl.AMXLinear):
        return 0, module.weight, module.bias_fp32
    if isinstance(module, pl.OneDNNLinear):
        return 1, module.weight, module.bias
    if isinstance(module, PanelLinear) and module.weight.dim() == 4:  # bf16 pairs, the bias in fp32
        return 5, module.weight, module.bias_fp32
    if isinstance(module, PanelLinear):
        return 2, module.weight, module.bias
    if type(module) is nn.Linear:
        return 3, module.weight, module.bias
    if isinstance(module, QuantGateUp):
        return QUANT_GATE_UP_KIND + module.kernel_format, module.blocks, module.bias
    if isinstance(module, QuantLinear) and module.use_kernel:  # quant_linear on its GGUF blocks
        return QUANT_KIND + module.kernel_format, module.blocks, module.bias
    return None


class FusedDecode:
    """The per-layer tensors the op takes, gathered once from a loaded (and packed) model."""

    def __init__(self, model: nn.Module) -> None:
        spec = model.spec
        self.spec = spec
        self.norms: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor | None] = []
        self.kinds: list[int] = []
        self.qk_norms: list[torch.Tensor] = []
        self.max_rows = 1 << 62  # AMX layers with oneDNN's copy hand LARGE_ROWS and more to it
        for layer in model.layers:
            self.norms += [layer.input_layernorm, layer.post_attention_layernorm]
            if spec.qk_norm:
                self.qk_norms += [layer.q_norm, layer.k_norm]
            for name in pl.PROJECTIONS:
                module = getattr(layer, name)
                kind = _kind(module)
                if kind is None:
                    raise TypeError(f"{type(module).__name__} is not a projection decode_layers takes")
                self.kinds.append(kind[0])
                self.weights.append(kind[1])
                self.biases.append(kind[2])
                if isinstance(module, pl.AMXLinear) and module.large is not None:
                    self.max_rows = pl.LARGE_ROWS - 1
        first = model.layers[0]
        self.out_features = [getattr(first, name).out_features for name in pl.PROJECTIONS]
        self.scale = first.scale

    def covers(self, x: torch.Tensor, batch: AttentionBatch, kv_layers: list[KVLayer]) -> bool:
        """This step is one the op runs exactly as the Python loop would."""
        n = x.shape[0]
        if not 0 < n <= self.max_rows or batch.num_decodes != n or batch.prefill_tables is not None:
            return False
        if x.dtype not in _DTYPES or x.device.type != "cpu":
            return False
        # one allocation holds every layer's K/V; a cache without scales is never calibrated (fp8 only)
        first = kv_layers[0]
        return first.k.dtype == x.dtype and first.k_scale is None

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch, kv_layers: list[KVLayer]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        hidden, residual = torch.ops.kvtop_cpu.decode_layers(
            x, cos, sin, self.norms, self.weights, self.biases, self.kinds, self.out_features, self.qk_norms,
            [kv.k for kv in kv_layers], [kv.v for kv in kv_layers], batch.slot_mapping, batch.decode_tables,
            batch.decode_lens, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps, self.scale,
        )  # fmt: skip
        return hidden, residual  # what the loop leaves: the last layer's MLP output, the residual stream


def fused_decode_for(model: nn.Module, kernels) -> FusedDecode | None:
    """The fused decode for this model and attention backend, or None where it does not apply."""
    from engine.kernels import cpu

    if knob(ENV) == "0" or kernels is not cpu or not cpu.load():
        return None
    if model.norm.device.type != "cpu":
        return None
    try:
        return FusedDecode(model)
    except TypeError:
        return None
