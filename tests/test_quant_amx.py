"""GGUF blocks in a bf16 model on AMX (csrc/amx_linear.cpp's amx_quant_linear): many bf16 rows are
multiplied on AMX tiles de-quantized a group of 32 columns at a time — the tiles the de-quantized
weight in bf16 would be packed into, so the results are amx_linear's on that weight bit for bit —
while a decode's few rows keep the blocks' exact values (quant_gemv). Without AMX the op refuses
in one line and QuantLinear's bf16 rows take the bf16 panels (AVX512-BF16: test_quant_bf16_panels)
or its fp32 kernels (the AVX2 build's run of this file checks that)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.kernels import cpu
from engine.model.packed_linear import _pack_tiles
from engine.model.quant_linear import KERNEL_FORMATS, QuantLinear, gemv_rows, kernel_available
from tests.test_quant_linear import chat_prompts, greedy_tokens, random_blocks, whole_blocks

AMX = kernel_available() and cpu.load() and torch.ops.kvtop_cpu.amx_supported()
needs_amx = pytest.mark.skipif(
    not AMX, reason="no AMX here: test_without_amx_the_op_refuses_in_one_line_and_bf16_rows_take_another_kernel runs"
)
GEMV_ROWS = gemv_rows() if kernel_available() else 4

# (rows, N, K): just past the decode rows, a partial 16-row tile, two 256-row blocks and a short one;
# N not a multiple of 32 (a group padded with zero columns); K an odd number of 32-blocks (256-blocks
# for Q4_K and Q6_K: whole_blocks). 33 to 64 rows take a group at a time in the shadow of the group
# before where groups are small (K = 160), a K chunk at a time in L1 where they are large (K = 1,792);
# prefill's rows each thread its own where they fit its L2 (300 and 600 rows), slabs shared by the
# threads where not (700 x 4,096: 2.9 MB of rows a thread on 2 threads, 1.6 on 4)
SHAPES = [
    (GEMV_ROWS + 1, 7, 32),
    (17, 50, 96),
    (33, 97, 160),
    (40, 48, 1792),
    (300, 193, 576),
    (600, 40, 1536),
    (700, 40, 4096),
]


@needs_amx
@pytest.mark.parametrize("fmt", KERNEL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_many_bf16_rows_give_amx_linears_results_on_the_bf16_weight_bit_for_bit(fmt, shape):
    m, n, k = shape
    k = whole_blocks(fmt, k)
    layer = QuantLinear(random_blocks(fmt, n, k, seed=m + n), fmt, k, bias=torch.randn(n))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    packed = _pack_tiles(layer.dense_weight().bfloat16())
    expected = torch.ops.kvtop_cpu.amx_linear(x, packed, layer.bias, n)
    assert torch.equal(layer(x), expected)
    assert torch.equal(torch.ops.kvtop_cpu.amx_quant_linear(x, layer.blocks, int(fmt), n, None),
                       torch.ops.kvtop_cpu.amx_linear(x, packed, None, n))  # fmt: skip


@needs_amx
@pytest.mark.parametrize("fmt", KERNEL_FORMATS, ids=lambda f: f.name)
def test_a_decodes_few_bf16_rows_keep_the_blocks_exact_values(fmt):
    """Up to GEMV_ROWS rows are computed in fp32 on the blocks' own values (the file's, not rounded
    to bf16): the fp32 kernel's result, rounded once."""
    n, k = 61, whole_blocks(fmt, 96)
    layer = QuantLinear(random_blocks(fmt, n, k, seed=3), fmt, k)
    x = torch.randn(GEMV_ROWS, k).bfloat16()
    assert torch.equal(layer(x), layer(x.float()).bfloat16())


@pytest.mark.skipif(not kernel_available() or AMX, reason="AMX here: the op runs (the tests above)")
def test_without_amx_the_op_refuses_in_one_line_and_bf16_rows_take_another_kernel():
    """The layer's bf16 rows go to the bf16 panels where the build has AVX512-BF16
    (test_quant_bf16_panels), else to the fp32 kernel."""
    fmt = KERNEL_FORMATS[0]
    n, k = 40, whole_blocks(fmt, 64)
    layer = QuantLinear(random_blocks(fmt, n, k, seed=1), fmt, k)
    x = torch.randn(GEMV_ROWS + 3, k).bfloat16()
    with pytest.raises(RuntimeError, match="amx_quant_linear: this CPU or kernel does not allow AMX"):
        torch.ops.kvtop_cpu.amx_quant_linear(x, layer.blocks, int(fmt), n, None)
    if cpu.says("quant_bf16_panels_supported"):
        expected = torch.ops.kvtop_cpu.quant_bf16_gemm(x, layer.blocks, int(fmt), n, None)
    else:
        expected = layer(x.float()).bfloat16()
    assert torch.equal(layer(x), expected)


@pytest.mark.slow
@needs_amx
def test_smollm2_in_bf16_keeps_the_blocks_and_answers_as_the_dequantized_bf16_model(smollm2_dir):
    """The GGUF's blocks in a bf16 model (prefill on AMX tiles, decode on the blocks) against the same
    file de-quantized to bf16: 63 of 64 prompts' 32 greedy tokens equal on the AMX Xeon; the issue's
    bar for the quantized path, 60."""
    ours = LLM("smollm2-135m", dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False,
               quantization="auto", quiet=True)  # fmt: skip
    assert ours.engine.weights_format == "Q4_1, Q8_0, bfloat16"
    dense = LLM("smollm2-135m", dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False,
                quantization="none", quiet=True)  # fmt: skip
    prompts = chat_prompts(ours.tokenizer)
    a, b = greedy_tokens(ours, prompts), greedy_tokens(dense, prompts)
    assert sum(x == y for x, y in zip(a, b, strict=True)) >= 60
