"""bf16 linear layers on our panel kernel (engine/model/panel_linear.py, csrc/bf16_gemm.cpp), the
layer a CPU with AVX512-BF16 and no AMX (AMD Zen 4) gets: within bf16 rounding of the exact product
for any row count, a row's result independent of the rows around it, the weight read back exactly,
a tied embedding looked up in the head's panels, and bad input refused. On a CPU without the kernel
the engine must not pick it (checked here too)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.kernels import cpu
from engine.model.packed_linear import ENV, AMXLinear, OneDNNLinear, amx_available, packed_linear
from engine.model.panel_linear import PanelEmbedding, PanelLinear, kernel_available, pack_panels, unpanelled

BF16_PANELS = kernel_available(torch.bfloat16)
AMX = amx_available()


def _linear(out_features: int, in_features: int, bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.05)  # a trained model's scale
        if bias:
            linear.bias.normal_(0.0, 0.5)
    return linear.eval()


def x_of(rows: int, in_features: int) -> torch.Tensor:
    return torch.randn(rows, in_features).to(torch.bfloat16)


def _within_one_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """`got` is the exact x @ w.T + b summed in fp32 (in any order) and rounded to bf16 once: at most
    half a bf16 step from the fp32 sum (a step at the exact value's magnitude allows for a sum across
    a power of two), which is itself within fp32's summation error of the exact value."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    terms = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    step = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.abs().clamp_min(1e-30)).exponent - 8)
    return bool(((got.double() - exact).abs() <= step + x.shape[-1] * 2.0**-24 * terms).all())


# 8-row blocks, 64-row items; the many items of 1,100 rows are the full suite's (seconds at the logits head)
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 17, 64, 67, 300, pytest.param(1100, marks=pytest.mark.slow)])
# SmolLM2's qkv (bias), logits, down; N that pads; a short panel only; K=2; K in three passes of up to
# 1,536, the bias added once
@pytest.mark.parametrize(
    "shape",
    [(960, 576, True), (49152, 576, False), (576, 1536, False), (100, 70, True), (33, 200, True), (50, 2, False),
     (50, 3100, True)],
)  # fmt: skip
def test_bf16_panel_layer_rounds_the_exact_product_once(rows, shape):
    out_features, in_features, bias = shape
    linear = _linear(out_features, in_features, bias)
    if not BF16_PANELS:  # the op, where the extension built without AVX512-BF16, says so
        if cpu.load():
            with pytest.raises(RuntimeError, match="no AVX512_BF16"):
                torch.ops.kvtop_cpu.bf16_gemm(x_of(1, in_features), pack_panels(linear.weight), None, out_features)
        return
    if out_features == 49152:
        rows = min(rows, 300)  # the logits never see a prefill's rows (only the rows that sample)
    layer = PanelLinear(linear.weight, linear.bias)
    assert torch.equal(layer.dense_weight(), linear.weight)
    x = x_of(rows, in_features)
    with torch.inference_mode():
        got = layer(x)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        assert _within_one_rounding(got, x, linear.weight, linear.bias)
        assert not _within_one_rounding(got + 0.05, x, linear.weight, linear.bias)  # the check can fail
        # one fixed order of sums per output: a row's result does not depend on the batch around it
        assert torch.equal(layer(x[-1:]), got[-1:])
        assert torch.equal(layer(x[rows // 2 :]), got[rows // 2 :])
        assert torch.equal(layer(x.reshape(1, rows, in_features)), got.reshape(1, rows, -1))


def test_bf16_panel_layer_refuses_what_does_not_fit_and_unpacks():
    linear = _linear(100, 70, True)
    if not BF16_PANELS:
        return
    layer = PanelLinear(linear.weight, linear.bias)
    assert layer.weight.shape == (3, 35, 48, 2) and torch.equal(pack_panels(linear.weight), layer.weight)
    assert layer.bias_fp32.dtype == torch.float32 and torch.equal(layer.bias_fp32, linear.bias.float())
    with torch.inference_mode():
        assert layer(torch.randn(0, 70).to(torch.bfloat16)).shape == (0, 100)
        x = torch.randn(2, 3, 70).to(torch.bfloat16)
        assert torch.equal(layer(x[:, 1]), layer(x[:, 1].contiguous()))  # rows not contiguous
        with pytest.raises(RuntimeError, match="last dim as K"):
            layer(torch.randn(4, 64).to(torch.bfloat16))
        with pytest.raises(RuntimeError, match="bfloat16 CPU tensors"):
            layer(torch.randn(4, 70))
    with pytest.raises(TypeError, match="no panel kernel"):
        PanelLinear(_linear(10, 7, False).weight, None)  # K odd: no pairs
    back = unpanelled(layer)
    assert type(back) is nn.Linear and torch.equal(back.weight, linear.weight) and back.bias is layer.bias


def test_packed_linear_picks_the_bf16_panels_only_where_they_run(monkeypatch):
    """AMX first; then the panels on AVX512-BF16 for an even K; oneDNN's for an odd K, with
    KVTOP_PACKED_LINEAR=onednn, and on CPUs without the kernel."""
    monkeypatch.delenv(ENV, raising=False)
    linear = _linear(96, 64, True)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert not BF16_PANELS  # the panels need AVX512-BF16, which oneDNN's bf16 needs less than
        return
    picked = type(packed_linear(linear.weight, linear.bias))
    assert picked is (AMXLinear if AMX else PanelLinear if BF16_PANELS else OneDNNLinear)
    assert type(packed_linear(_linear(96, 63, False).weight, None)) in (AMXLinear, OneDNNLinear)
    monkeypatch.setenv(ENV, "onednn")
    assert type(packed_linear(linear.weight, linear.bias)) is OneDNNLinear


@pytest.mark.parametrize("shape", [(49152, 576), (1000, 70), (33, 64)])  # SmolLM2's; N that pads; one short panel
def test_panel_embedding_reads_the_same_rows_as_the_dense_bf16_table(shape):
    """A tied embedding's lookup from the bf16 head's panels ([N/48, K/2, 48, 2]) gives the dense
    table's rows bit for bit, every row of the small tables, ids in any shape. Only the layout is
    read: no kernel needed."""
    vocab, hidden = shape
    torch.manual_seed(0)
    table = torch.randn(vocab, hidden).to(torch.bfloat16)
    head = nn.Module()
    head.weight, head.out_features, head.in_features = pack_panels(table), vocab, hidden
    embed = PanelEmbedding(head)
    ids = torch.arange(vocab) if vocab < 5000 else torch.randint(0, vocab, (3000,))
    assert torch.equal(embed(ids), table[ids])
    grid = ids[:12].reshape(3, 4)
    assert torch.equal(embed(grid), table[grid])
