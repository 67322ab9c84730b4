"""A whole model in a Q5 format (engine.model.quant_linear's KERNEL_FORMATS; csrc/quant_blocks.h): what
llama.cpp's Q4_K_M writes for SmolLM2's 576-wide rows (Q5_0) and Q5_K_M (Q5_1). The file, made by
benchmarks/requantize_gguf.py, loads with every layer's weights kept in its blocks — about the file's
bytes, the format said — and generates the de-quantized model's greedy tokens: in fp32, and in bf16 where
AMX multiplies the prompts' rows on the weights rounded to bf16, as the de-quantized bf16 model holds
them (elsewhere bf16 rows multiply the blocks' exact values: more exact, not the same numbers — 26 and
29 of 64 prompts agree on the AVX2 build)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine import LLM
from engine.kernels import cpu
from engine.model.quant_linear import QuantLinear, kernel_available
from tests.test_quant_linear import chat_prompts, gguf_tensor_bytes, greedy_tokens

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernel_available(), reason="the quantized kernel is not built on this CPU"),
]


@pytest.fixture(scope="module", params=["Q5_0", "Q5_1"])
def q5_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("q5") / f"smollm2-{request.param.lower()}.gguf"
    script = ["benchmarks/requantize_gguf.py", "--type", request.param, "--out", str(path)]
    subprocess.run([sys.executable, *script], check=True, capture_output=True, timeout=600)
    return request.param, path


AMX = kernel_available() and cpu.load() and torch.ops.kvtop_cpu.amx_supported()
BF16 = pytest.param("bfloat16", marks=pytest.mark.skipif(not AMX, reason="bf16 rows take the bf16 weights on AMX only"))


@pytest.mark.parametrize("dtype", ["float32", BF16])
def test_a_q5_file_loads_quantized_and_generates_the_dequantized_models_tokens(q5_file, dtype):
    kind, path = q5_file
    quantized = LLM(str(path), dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=False, quiet=True)
    layers = quantized.engine.model.layers
    assert all(isinstance(layer.o_proj, QuantLinear) and layer.o_proj.fmt.name == kind for layer in layers)
    assert quantized.engine.weights_format == f"{kind}, Q8_0, {dtype}"
    weights = quantized.stats()["memory"]["weights"]
    assert weights <= 1.1 * gguf_tensor_bytes(path)  # the blocks, not a de-quantized copy
    dense = LLM(str(path), dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=False, quantization="none",
                quiet=True)  # fmt: skip
    assert dense.stats()["memory"]["weights"] > 2 * weights
    prompts = chat_prompts(quantized.tokenizer)
    ours, reference = greedy_tokens(quantized, prompts), greedy_tokens(dense, prompts)
    same = sum(a == b for a, b in zip(ours, reference, strict=True))
    assert same >= 60, f"{same} of 64 prompts agree"
    assert all(len(t) == 32 for t in ours)
