"""A whole model in a Q5 format (engine.model.quant_linear's KERNEL_FORMATS; csrc/quant_blocks.h): what
llama.cpp's Q4_K_M writes for SmolLM2's 576-wide rows (Q5_0) and Q5_K_M (Q5_1). The file, made by
benchmarks/requantize_gguf.py, loads with every layer's weights kept in its blocks — about the file's
bytes, the format said — and generates the de-quantized model's greedy tokens: in fp32, and in bf16 where
AMX multiplies the prompts' rows on the weights rounded to bf16, as the de-quantized bf16 model holds
them (elsewhere bf16 rows multiply the blocks' exact values: more exact, not the same numbers — 26 and
29 of 64 prompts agree on the AVX2 build). The script refuses in one line what would lose a file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine import LLM
from engine.kernels import cpu
from engine.model.quant_linear import QuantLinear, kernel_available
from tests.test_quant_linear import chat_prompts, gguf_tensor_bytes, greedy_tokens

SCRIPT = "benchmarks/requantize_gguf.py"
needs_kernel = pytest.mark.skipif(not kernel_available(), reason="the quantized kernel is not built on this CPU")


@pytest.fixture(scope="module", params=["Q5_0", "Q5_1"])
def q5_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("q5") / f"smollm2-{request.param.lower()}.gguf"
    # a ceiling against a hang, not a wait: the rewrite takes seconds
    subprocess.run([sys.executable, SCRIPT, "--type", request.param, "--out", str(path)], check=True, timeout=600)
    return request.param, path


# AMX's tiles, or the bf16 panels of AVX512-BF16 without it: the weights of a bf16 model's batched rows
# rounded to bf16, as the de-quantized model holds them
BF16_WEIGHTS = kernel_available() and (cpu.says("amx_supported") or cpu.says("quant_bf16_panels_supported"))
BF16 = pytest.param(
    "bfloat16",
    marks=pytest.mark.skipif(
        not BF16_WEIGHTS,
        reason="without AMX or AVX512-BF16 a bf16 model's quantized layers multiply the blocks' exact values, not "
        "the weights rounded to bf16 that the de-quantized model holds: not the same numbers to compare tokens with",
    ),
)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", BF16])
def test_a_q5_file_loads_quantized_and_generates_the_dequantized_models_tokens(q5_file, dtype, monkeypatch):
    """Against the same file de-quantized, on the same kernels: without the bf16 model's oneDNN copy for
    steps of 1,536+ rows, whose other summation order alone moves tokens (test_quant_packed)."""
    monkeypatch.setenv("KVTOP_LARGE_GEMM", "0")
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


def requantize(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, "--type", "Q5_0", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.integration
def test_requantize_refuses_in_one_line_what_would_lose_or_break_a_file(tmp_path):
    """The output named as the source would truncate the file being read: refused, the source intact;
    a file that is not a GGUF, or no directory for the output: one line each, exit 1, no half file."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF" + bytes(60))
    same = requantize("--model", str(source), "--out", str(tmp_path / "." / "model.gguf"))
    assert same.returncode == 1 and same.stderr.strip().splitlines() == [
        f"--out {tmp_path / '.' / 'model.gguf'} is the source file: write the copy elsewhere"
    ]
    assert source.read_bytes() == b"GGUF" + bytes(60)
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a model")
    bad = requantize("--model", str(junk), "--out", str(tmp_path / "out.gguf"))
    assert bad.returncode == 1 and bad.stderr.strip() == f"could not rewrite {junk}: GGUF magic invalid"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.gguf", "model.gguf"]
    nowhere = requantize("--model", str(junk), "--out", str(tmp_path / "missing" / "out.gguf"))
    assert nowhere.returncode == 1 and nowhere.stderr.strip() == f"no directory {tmp_path / 'missing'} for --out"
