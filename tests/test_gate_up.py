"""An MLP's gate/up projection on AMX tiles with SiLU-and-mul in the kernel's epilogue
(engine.model.packed_linear.AMXGateUp, csrc/amx_linear.cpp's amx_gate_up): bit for bit the separate
ops it replaces, for any row count, so the engine's tokens do not move."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.kernels import cpu
from engine.model.packed_linear import (
    LARGE_ROWS,
    AMXGateUp,
    AMXLinear,
    _pack_tiles,
    amx_available,
    packed_linear,
)

# Without AMX tiles (an AVX2 or pre-Sapphire-Rapids CPU) there is no AMXGateUp: gate/up is oneDNN's or
# nn.Linear and SiLU-and-mul stays its own op, which tests/test_packed_linear.py and test_fused_ops.py check.
pytestmark = pytest.mark.skipif(not amx_available(), reason="this CPU has no AMX tiles, so no gate/up epilogue")


def _gate_up(inter: int, in_features: int, bias: bool, scale: float = 0.05) -> nn.Linear:
    torch.manual_seed(1)
    linear = nn.Linear(in_features, 2 * inter, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.normal_(0.0, scale)
        if bias:
            linear.bias.normal_(0.0, 0.5)
    return linear.eval()


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 33, 64, 300, 2048])  # 1 or 2 A tiles, partial, several M blocks
@pytest.mark.parametrize("shape", [(1536, 576, False), (64, 70, True), (48, 1536, False)])  # SmolLM2's; K and bias
def test_the_epilogue_gives_silu_and_mul_of_the_plain_projection_bit_for_bit(rows, shape):
    inter, in_features, bias = shape
    linear = _gate_up(inter, in_features, bias)
    fused = AMXGateUp(linear.weight, linear.bias)
    plain = AMXLinear(linear.weight, linear.bias)  # the dense layout, as before the epilogue
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    with torch.inference_mode():
        dense = plain(x)
        assert torch.equal(fused(x), dense)  # the plain output comes back in the dense [gate, up] order
        want = cpu.silu_and_mul(dense)
        got = fused.silu_and_mul(x, cpu)
    assert got.shape == (rows, inter) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_large_gates_overflow_exp_as_the_separate_op_does():
    """Gates far past exp's range (|g| ~ 100): 0 and g itself, the same bits as silu_and_mul's."""
    linear = _gate_up(64, 64, False, scale=4.0)
    fused, plain = AMXGateUp(linear.weight, None), AMXLinear(linear.weight, None)
    x = torch.randn(40, 64).to(torch.bfloat16)
    with torch.inference_mode():
        dense = plain(x)
        assert dense.abs().max() > 90
        assert torch.equal(fused.silu_and_mul(x, cpu), cpu.silu_and_mul(dense))


def test_the_layer_reads_its_weight_back_in_the_dense_order():
    linear = _gate_up(48, 96, True)
    fused = AMXGateUp(linear.weight, linear.bias)
    assert torch.equal(fused.dense_weight(), linear.weight)
    assert torch.equal(fused.bias, linear.bias)
    assert not torch.equal(fused.weight, _pack_tiles(linear.weight))  # gate and up rows interleaved by 16
    x = torch.randn(3, 5, 96).to(torch.bfloat16)  # any leading shape
    with torch.inference_mode():
        assert fused.silu_and_mul(x, cpu).shape == (3, 5, 48)


def test_a_gate_up_weight_the_tiles_cannot_pair_stays_a_plain_amx_layer():
    """2I not a multiple of 32: gate and up columns would share a tile, so no epilogue."""
    linear = _gate_up(40, 64, False)
    assert type(packed_linear(linear.weight, None, gate_up=True)) is AMXLinear
    assert type(packed_linear(_gate_up(48, 64, False).weight, None, gate_up=True)) is AMXGateUp
    assert type(packed_linear(_gate_up(48, 64, False).weight, None)) is AMXLinear  # other projections


def test_other_kernels_take_the_separate_op_and_long_prefills_the_epilogue():
    """The reference kernels are the oracle: their own SiLU. A prefill step of LARGE_ROWS rows and
    more, which the other projections send to oneDNN's copy, stays on the tiles here: no copy."""
    from engine.kernels import reference

    linear = _gate_up(48, 64, False)
    fused = AMXGateUp(linear.weight, None, large=True)
    assert fused.large is None
    with torch.inference_mode():
        x = torch.randn(5, 64).to(torch.bfloat16)
        assert torch.equal(fused.silu_and_mul(x, reference), reference.silu_and_mul(fused(x)))
        big = torch.randn(LARGE_ROWS, 64).to(torch.bfloat16)
        assert torch.equal(fused.silu_and_mul(big, cpu), cpu.silu_and_mul(AMXLinear(linear.weight, None)(big)))
