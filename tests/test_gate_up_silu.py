"""An fp32 MLP's gate/up projection on the panels with SiLU-and-mul in the kernel's epilogue
(engine.model.panel_linear.PanelGateUp, csrc/fp32_gemm.cpp's fp32_gate_up_silu): bit for bit the
separate ops it replaces, for any row count, so the engine's tokens do not move; where the build has
no AVX-512 (an AVX2-only CPU) gate/up stays a plain panel layer and the op refuses in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.kernels import cpu, reference
from engine.model import fused_decode
from engine.model.packed_linear import ENV
from engine.model.panel_linear import PanelGateUp, PanelLinear, kernel_available
from tests.conftest import make_tiny_model
from tests.helpers import random_prompts

FUSED = cpu.says("fp32_gate_up_supported")
needs_fused = pytest.mark.skipif(not FUSED, reason="no AVX-512 in this build: no gate/up epilogue (test_placement)")


def _gate_up(inter: int, in_features: int, bias: bool, scale: float = 0.05) -> nn.Linear:
    torch.manual_seed(2)
    linear = nn.Linear(in_features, 2 * inter, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0.0, scale)
        if bias:
            linear.bias.normal_(0.0, 0.5)
    return linear.eval()


@needs_fused
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 63, 64, 65, 300, 2048])  # 8-row blocks, 64-row items
# SmolLM2's; a bias; a long K; K in three passes (AVX-512's pass is 1,536 of K)
@pytest.mark.parametrize("shape", [(1536, 576, False), (48, 70, True), (96, 1536, False), (96, 3100, True)])
def test_the_epilogue_gives_silu_and_mul_of_the_plain_projection_bit_for_bit(rows, shape):
    inter, in_features, bias = shape
    linear = _gate_up(inter, in_features, bias)
    fused = PanelGateUp(linear.weight, linear.bias)
    plain = PanelLinear(linear.weight, linear.bias)
    assert torch.equal(fused.weight, plain.weight)  # the same panels: gate's, then up's
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        dense = plain(x)
        assert torch.equal(fused(x), dense)  # forward is still the plain [gate, up] output
        got = fused.silu_and_mul(x, cpu)
        assert got.shape == (rows, inter) and got.dtype == torch.float32
        assert torch.equal(got, cpu.silu_and_mul(dense))
        # against nn.Linear (MKL, its own order of sums) and the reference SiLU: fp32 rounding apart
        torch.testing.assert_close(got, reference.silu_and_mul(linear(x)), rtol=1e-4, atol=1e-4)
        assert torch.equal(fused.silu_and_mul(x[-1:], cpu), got[-1:])  # a row's result is its own


@needs_fused
def test_large_gates_overflow_exp_as_the_separate_op_does():
    """Gates far past exp's range (|g| ~ 100): 0 and g itself, the same bits as silu_and_mul's."""
    linear = _gate_up(48, 64, False, scale=4.0)
    fused = PanelGateUp(linear.weight, None)
    x = torch.randn(40, 64)
    with torch.inference_mode():
        dense = fused(x)
        assert dense.abs().max() > 90
        assert torch.equal(fused.silu_and_mul(x, cpu), cpu.silu_and_mul(dense))


@needs_fused
def test_any_leading_shape_and_other_kernels_take_the_separate_op():
    linear = _gate_up(48, 96, True)
    fused = PanelGateUp(linear.weight, linear.bias)
    assert torch.equal(fused.dense_weight(), linear.weight)
    x = torch.randn(3, 5, 96)
    with torch.inference_mode():
        got = fused.silu_and_mul(x, cpu)
        assert got.shape == (3, 5, 48)
        assert torch.equal(got.reshape(15, 48), fused.silu_and_mul(x.reshape(15, 96), cpu))
        assert torch.equal(fused.silu_and_mul(x, reference), reference.silu_and_mul(fused(x)))  # the oracle's own


@needs_fused
def test_the_op_refuses_what_it_cannot_pair_in_one_line():
    linear = _gate_up(48, 64, False)
    fused = PanelGateUp(linear.weight, None)
    op = torch.ops.kvtop_cpu.fp32_gate_up_silu
    with pytest.raises(RuntimeError, match="multiple of 48"):
        op(torch.randn(2, 64), fused.weight, None, 40)
    with pytest.raises(RuntimeError, match="n does not match the packed weight"):
        op(torch.randn(2, 64), fused.weight, None, 96)
    with pytest.raises(RuntimeError, match="float32 CPU tensors"):
        op(torch.randn(2, 64).to(torch.bfloat16), fused.weight, None, 48)
    with pytest.raises(RuntimeError, match="last dim as K"):
        op(torch.randn(2, 63), fused.weight, None, 48)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        op(torch.randn(2, 64), fused.weight, torch.zeros(48), 48)
    assert op(torch.randn(0, 64), fused.weight, None, 48).shape == (0, 48)


@pytest.fixture(scope="module")
def tiny_96(tmp_path_factory, smollm2_dir):
    """A tiny llama whose intermediate size (96) pairs into panels of 48, as SmolLM2's 1,536 does."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny96"), smollm2_dir, intermediate_size=96)


def test_placement(tiny_96, tiny_models):
    """fp32 models on AVX-512 get the epilogue where I is a multiple of 48 (the tiny models' 128 is
    not: a plain panel layer); an AVX2 build has none, and its op says so."""

    def kind(path) -> type:
        llm = LLM(str(path), dtype="float32", kv_cache_memory="2MiB", quiet=True)
        return type(llm.engine.model.layers[0].gate_up_proj)

    kinds = {"96": kind(tiny_96), "128": kind(tiny_models["llama"])}
    if not kernel_available():
        assert kinds == {"96": nn.Linear, "128": nn.Linear}
        return
    assert kinds == {"96": PanelGateUp if FUSED else PanelLinear, "128": PanelLinear}
    if not FUSED:
        with pytest.raises(RuntimeError, match="no AVX-512"):
            torch.ops.kvtop_cpu.fp32_gate_up_silu(torch.randn(2, 64), torch.zeros(2, 64, 48), None, 48)


@needs_fused
def test_the_engine_gives_the_same_greedy_tokens_as_plain_nn_linear(tiny_96, monkeypatch):
    prompts = random_prompts(5, (3, 90), seed=16)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    monkeypatch.delenv(ENV, raising=False)
    llm = LLM(str(tiny_96), dtype="float32", kv_cache_memory="2MiB", quiet=True)
    assert all(type(layer.gate_up_proj) is PanelGateUp for layer in llm.engine.model.layers)
    fused = [o.token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setenv(ENV, "0")
    plain = LLM(str(tiny_96), dtype="float32", kv_cache_memory="2MiB", quiet=True)
    assert type(plain.engine.model.layers[0].gate_up_proj) is nn.Linear
    assert fused == [o.token_ids for o in plain.generate(prompts, params)]


@needs_fused
def test_the_fused_decode_step_runs_the_epilogue_with_the_loops_results(tiny_96, monkeypatch):
    """A decode-only step's C++ op (decode_layers) takes PanelGateUp as its own kind and calls the
    epilogue op: the decode steps' tokens and log-probs are the Python loop's, bit for bit."""
    llm = LLM(str(tiny_96), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=8, enable_prefix_caching=False,
              quiet=True)  # fmt: skip
    model = llm.engine.model
    assert fused_decode.FusedDecode(model).kinds[2::4] == [6] * len(model.layers)  # each layer's gate/up
    prompts = random_prompts(6, (3, 60), seed=17)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    results = {}
    for fused in ("1", "0"):
        monkeypatch.setenv(fused_decode.ENV, fused)
        model.fused_kernels = None  # gathered again under this setting at the next step
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outs = llm.generate(prompts, params)
        calls = {e.key: e.count for e in prof.key_averages()}
        results[fused] = ([o.token_ids for o in outs], [o.logprobs for o in outs])
        if fused == "1":  # every decode-only step took the op, whose gate/up ran the epilogue
            assert calls.get("kvtop_cpu::decode_layers", 0) >= params.max_tokens - 1
            assert calls.get("kvtop_cpu::fp32_gate_up_silu", 0) >= calls["kvtop_cpu::decode_layers"] * len(model.layers)
    assert results["1"] == results["0"]
