"""Prepacked linear layers (engine.model.packed_linear) compute what nn.Linear computes, for any
number of rows, and the engine gives the same greedy tokens with and without them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.model.packed_linear import ENV, PROJECTIONS, OneDNNLinear, applies, pack_model
from tests.helpers import random_prompts

# oneDNN's bf16 GEMM needs AVX-512 or AVX-NE-CONVERT; an AVX2-only CPU (CI's) keeps nn.Linear in bf16
BF16_PACKS = torch.ops.mkldnn._is_mkldnn_bf16_supported()

# fp32: the packed GEMM sums in another order than nn.Linear's; outputs here are O(1)
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
# bf16: both round their fp32 sums to bf16 (8-bit mantissa): at most an ulp or so apart
BF16_TOL = dict(rtol=1.6e-2, atol=1e-2)


def _linear(dtype: torch.dtype, out_features: int, in_features: int, bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.05)  # a trained model's scale
        if bias:
            linear.bias.normal_(0.0, 0.5)
    return linear.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 2048])
@pytest.mark.parametrize("bias", [False, True])  # Qwen2's qkv projection has a bias
def test_packed_layer_matches_nn_linear(dtype, rows, bias, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    linear = _linear(dtype, 960, 576, bias)
    if dtype == torch.bfloat16 and not BF16_PACKS:
        assert not applies(linear.weight)  # this CPU: the model keeps nn.Linear in bf16
        return
    packed = OneDNNLinear(linear.weight, linear.bias, batch_hint=64)  # rows other than the hint too
    x = torch.randn(rows, 576).to(dtype)
    with torch.inference_mode():
        got, want = packed(x), linear(x)
    assert got.shape == want.shape == (rows, 960) and got.dtype == dtype
    torch.testing.assert_close(got, want, **(FP32_TOL if dtype == torch.float32 else BF16_TOL))
    # anything that reads the weight back gets the original
    assert packed.weight.shape == linear.weight.shape and torch.equal(packed.weight.to_dense(), linear.weight)


def _generate(path: str, dtype: str, prompts, params: SamplingParams) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype=dtype, kv_cache_memory="2MiB", max_num_batched_tokens=32, quiet=True)
    return [o.token_ids for o in llm.generate(prompts, params)], llm


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied lm_head; tied embedding + qkv bias
def test_engine_gives_the_same_greedy_tokens_with_and_without_packing(tiny_models, family, monkeypatch):
    monkeypatch.setenv(ENV, "all")  # fp32 packs only when asked (it measured slower end to end)
    path = str(tiny_models[family])
    prompts = random_prompts(5, (3, 70), seed=11)  # chunked prefills beside decodes: many row counts
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    packed, llm = _generate(path, "float32", prompts, params)
    assert isinstance(llm.engine.model.layers[0].qkv_proj, OneDNNLinear)
    monkeypatch.setenv(ENV, "0")
    plain, plain_llm = _generate(path, "float32", prompts, params)
    assert isinstance(plain_llm.engine.model.layers[0].qkv_proj, nn.Linear)
    assert packed == plain
    assert all(len(tokens) == 10 for tokens in packed)
    # the weights' size the stats and `kvctl plan` report does not change with the layout
    assert llm.stats()["memory"]["weights"] == plain_llm.stats()["memory"]["weights"]


def test_bf16_engine_gives_the_same_greedy_tokens_with_and_without_packing(tiny_models, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    prompts = random_prompts(3, (5, 40), seed=12)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    packed, llm = _generate(str(tiny_models["smollm-tied"]), "bfloat16", prompts, params)
    assert isinstance(llm.engine.model.layers[0].gate_up_proj, OneDNNLinear) == BF16_PACKS
    monkeypatch.setenv(ENV, "0")
    plain, _ = _generate(str(tiny_models["smollm-tied"]), "bfloat16", prompts, params)
    assert packed == plain


def test_a_layer_the_op_refuses_leaves_plain_nn_linear_and_one_log_line(tiny_models, capfd, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    llm = LLM(str(tiny_models["qwen2"]), dtype="float32", kv_cache_memory="2MiB", quiet=True)
    monkeypatch.setenv(ENV, "all")
    prompts = random_prompts(2, (5, 20), seed=13)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = [o.token_ids for o in llm.generate(prompts, params)]
    model = llm.engine.model
    last = model.layers[-1]
    down = last.down_proj
    last.down_proj = nn.Linear(down.in_features, down.out_features, bias=False, device="meta")  # the op refuses it
    capfd.readouterr()
    assert pack_model(model) is False  # after packing every layer before it
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "prepacked linear layers off" in err
    last.down_proj = down
    assert all(type(getattr(layer, n)) is nn.Linear for layer in model.layers for n in PROJECTIONS)
    assert getattr(model, "logits_head", None) is None
    assert [o.token_ids for o in llm.generate(prompts, params)] == before


def test_float16_keeps_nn_linear(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float16", kv_cache_memory="2MiB", quiet=True)
    assert type(llm.engine.model.layers[0].o_proj) is nn.Linear
    assert getattr(llm.engine.model, "logits_head", None) is None


def test_float32_keeps_nn_linear_unless_asked(tiny_models, monkeypatch):
    """By default fp32 stays on nn.Linear (MKL's GEMM), which measured faster end to end than packed."""
    monkeypatch.delenv(ENV, raising=False)
    llm = LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory="2MiB", quiet=True)
    assert type(llm.engine.model.layers[0].qkv_proj) is nn.Linear
