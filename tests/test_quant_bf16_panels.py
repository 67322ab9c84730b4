"""GGUF blocks in a bf16 model on AVX512-BF16 without AMX (AMD Zen 4 and later: csrc/quant_gemm.cpp's
quant_bf16_gemm): past the decode rows, each panel of 48 columns is de-quantized into the bf16 pairs
the de-quantized bf16 model's panels hold and multiplied with bf16_gemm's blocks (VDPBF16PS), so the
results are bf16_gemm's on that weight bit for bit — from the packed tiles or the file's layout alike.
The op is built wherever the target has AVX512-BF16 (an AMX Xeon too, where the layers route to AMX
first); without it the op refuses in one line and bf16 rows take the fp32 kernels."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu
from engine.model.panel_linear import pack_panels
from engine.model.quant_linear import KERNEL_FORMATS, PACKED_FORMATS, QuantLinear, gemv_rows, kernel_available
from tests.test_quant_linear import random_blocks, whole_blocks

BF16_PANELS = kernel_available() and cpu.says("quant_bf16_panels_supported")
AMX = BF16_PANELS and cpu.says("amx_supported")
needs_bf16_panels = pytest.mark.skipif(
    not BF16_PANELS, reason="no AVX512-BF16 in this build: test_without_avx512_bf16_the_op_refuses_in_one_line runs"
)
GEMV_ROWS = gemv_rows() if kernel_available() else 4

# (rows, N, K): just past the decode rows; a partial 8-row block and N not a multiple of 48 (a panel's
# columns past N zero); 64 rows (one item's register blocks) against K past two passes of 1,536 (an
# odd number of 32-blocks); 300 rows (two items of up to 256) against SmolLM2's K = 576. A packed
# weight's next panel is de-quantized while the one before multiplies: one panel for many row chunks
# (none to make), and a thread's run going on from a chunk's last panel to the next chunk's first
SHAPES = [
    (GEMV_ROWS + 1, 16, 32),
    (17, 80, 96),
    (64, 48, 3104),
    (300, 208, 576),
    (300, 48, 64),
    (520, 144, 64),
]


def bf16_panel_result(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The oracle: bf16_gemm on the de-quantized weight rounded to bf16, as the bf16 model holds it."""
    return torch.ops.kvtop_cpu.bf16_gemm(
        x, pack_panels(layer.dense_weight().bfloat16()), layer.bias, layer.out_features
    )


@needs_bf16_panels
@pytest.mark.parametrize("fmt", KERNEL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_many_bf16_rows_give_bf16_gemms_results_on_the_bf16_weight_bit_for_bit(fmt, shape):
    m, n, k = shape
    k = whole_blocks(fmt, k)
    layer = QuantLinear(random_blocks(fmt, n, k, seed=m + n), fmt, k, bias=torch.randn(n))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    expected = bf16_panel_result(layer, x)
    op = torch.ops.kvtop_cpu.quant_bf16_gemm
    assert torch.equal(op(x, layer.blocks, layer.kernel_format, n, layer.bias), expected)  # the file's layout
    layer.pack()
    assert layer.packed == (fmt in PACKED_FORMATS)
    assert torch.equal(op(x, layer.blocks, layer.kernel_format, n, layer.bias), expected)
    if not AMX:  # the layer's own route (AMX's tiles come first where the CPU has them: test_quant_amx)
        assert torch.equal(layer(x), expected)


@needs_bf16_panels
@pytest.mark.skipif(AMX, reason="AMX here: bf16 rows take its tiles (test_quant_amx)")
def test_a_decodes_few_bf16_rows_keep_the_blocks_exact_values_and_more_take_the_panels():
    """Up to GEMV_ROWS rows are computed in fp32 on the blocks' own values (the file's, not rounded to
    bf16); one more row and the layer gives the bf16 model's panels' result."""
    fmt = KERNEL_FORMATS[0]
    n, k = 48, whole_blocks(fmt, 96)
    layer = QuantLinear(random_blocks(fmt, n, k, seed=3), fmt, k)
    layer.pack()
    few = torch.randn(GEMV_ROWS, k).bfloat16()
    assert torch.equal(layer(few), layer(few.float()).bfloat16())
    more = torch.randn(GEMV_ROWS + 1, k).bfloat16()
    assert torch.equal(layer(more), bf16_panel_result(layer, more))


@pytest.mark.skipif(not kernel_available() or BF16_PANELS, reason="AVX512-BF16 here: the op runs (the tests above)")
def test_without_avx512_bf16_the_op_refuses_in_one_line():
    fmt = KERNEL_FORMATS[0]
    n, k = 40, whole_blocks(fmt, 64)
    layer = QuantLinear(random_blocks(fmt, n, k, seed=1), fmt, k)
    x = torch.randn(GEMV_ROWS + 3, k).bfloat16()
    with pytest.raises(RuntimeError, match="quant_bf16_gemm: this build has no AVX512-BF16"):
        torch.ops.kvtop_cpu.quant_bf16_gemm(x, layer.blocks, int(fmt), n, None)
    assert torch.equal(layer(x), layer(x.float()).bfloat16())
