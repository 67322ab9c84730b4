"""Prepacked linear layers (engine.model.packed_linear) compute what nn.Linear computes, for any
number of rows, and the engine gives the same greedy tokens with and without them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.model.packed_linear import (
    ENV,
    LARGE_ENV,
    LARGE_ROWS,
    PROJECTIONS,
    AMXGateUp,
    AMXLinear,
    OneDNNLinear,
    TiledEmbedding,
    _pack_tiles,
    amx_available,
    applies,
    pack_model,
    packed_linear,
    second_copy_bytes,
)
from engine.model.panel_linear import PanelEmbedding, PanelLinear, kernel_available, pack_panels, unpanelled
from tests.helpers import random_prompts

# oneDNN's bf16 GEMM needs AVX-512 or AVX-NE-CONVERT; an AVX2-only CPU (CI's) keeps nn.Linear in bf16
BF16_PACKS = torch.ops.mkldnn._is_mkldnn_bf16_supported()
# our AMX tile kernel: Sapphire Rapids and later, with the kernel extension built for this CPU
AMX = amx_available()
# our bf16 panel kernel: AVX512-BF16 without AMX (AMD Zen 4), tests/test_bf16_panels.py
BF16_PANELS = kernel_available(torch.bfloat16)
BF16_KIND = AMXLinear if AMX else PanelLinear if BF16_PANELS else OneDNNLinear if BF16_PACKS else nn.Linear
# fp32: on AVX-512 or AVX2 our panel kernel (engine/model/panel_linear.py), elsewhere nn.Linear (MKL's sgemm)
PANELS = kernel_available()
FP32_KIND = PanelLinear if PANELS else nn.Linear

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


# 1 or 2 A tiles, partial, several M blocks; 2,048 rows are the full suite's (seconds at the logits head)
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 33, 64, 300, pytest.param(2048, marks=pytest.mark.slow)])
# (1000, 64): output rows that start off a cache line and end in a partial group of columns
@pytest.mark.parametrize(
    "shape", [(960, 576, True), (49152, 576, False), (100, 70, True), (576, 1536, False), (1000, 64, True)]
)
def test_the_bf16_layer_this_cpu_packs_matches_nn_linear(rows, shape, monkeypatch):
    """AMX tiles where the CPU has them (else our bf16 panels, else oneDNN's, else nn.Linear): within an ulp of nn.Linear for
    any row count, SmolLM2's shapes and ones that pad N and K, with and without a bias (each block's
    rows are written out while the next block multiplies: the last block, and a group's last block
    with its bias, too)."""
    monkeypatch.delenv(ENV, raising=False)
    out_features, in_features, bias = shape
    linear = _linear(torch.bfloat16, out_features, in_features, bias)
    if not BF16_PACKS:
        assert not applies(linear.weight)
        return
    packed = packed_linear(linear.weight, linear.bias)
    assert type(packed) is BF16_KIND
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    with torch.inference_mode():
        got, want = packed(x), linear(x)
    assert got.shape == want.shape == (rows, out_features) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **BF16_TOL)
    exact = x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)
    torch.testing.assert_close(got.float(), exact, **BF16_TOL)  # rounded once, from fp32 sums


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX: the test above checks the layer it gets instead")
def test_amx_layer_reads_its_weight_back_and_takes_any_leading_shape(monkeypatch):
    linear = _linear(torch.bfloat16, 100, 70, True)
    packed = AMXLinear(linear.weight, linear.bias)
    assert torch.equal(packed.dense_weight(), linear.weight)
    x = torch.randn(2, 3, 70).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), **BF16_TOL)
        torch.testing.assert_close(packed(x[:, 1]), linear(x[:, 1]), **BF16_TOL)  # rows not contiguous
        assert packed(x[:0, 0]).shape == (0, 100)
        with pytest.raises(RuntimeError, match="does not match the packed weight"):
            packed(torch.randn(4, 64).to(torch.bfloat16))
    monkeypatch.setenv(ENV, "onednn")  # to compare: oneDNN's even where AMX is there
    assert type(packed_linear(linear.weight, linear.bias)) is OneDNNLinear


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
    layer = llm.engine.model.layers[0]
    assert type(layer.down_proj) is BF16_KIND
    assert type(layer.gate_up_proj) is (AMXGateUp if AMX else BF16_KIND)  # SiLU-and-mul in its epilogue
    head = llm.engine.model.logits_head
    assert (type(head) is BF16_KIND) if BF16_PACKS else head is None  # no bf16 GEMM here (AVX2): F.linear
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
    assert model.logits_head is None
    assert [o.token_ids for o in llm.generate(prompts, params)] == before


def test_packing_lets_each_original_weight_go_before_the_next_is_packed(tiny_models, monkeypatch):
    """pack_model holds one original projection at a time: when a weight is packed, every one packed
    before it has been freed (holding them all to the end briefly doubled the weights: an 8B model's
    15 GB of bf16 needed 30 and was killed on a 24 GiB machine)."""
    import gc
    import weakref

    from engine.model import packed_linear as module
    from engine.model.llama import CausalLM
    from engine.model.loader import _read_weights
    from engine.model.spec import read_spec

    monkeypatch.delenv(ENV, raising=False)
    spec, _ = read_spec(tiny_models["smollm-tied"])
    with torch.device("meta"):
        net = CausalLM(spec)
    net = net.to_empty(device="cpu").to(torch.bfloat16)
    net.load_hf_state_dict(_read_weights(tiny_models["smollm-tied"]))
    originals = [weakref.ref(getattr(layer, name).weight) for layer in net.layers for name in PROJECTIONS]
    alive: list[int] = []
    real = module.packed_linear

    def counting(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in originals))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "packed_linear", counting)
    if not applies(net.embed_tokens.weight):
        pytest.skip("bf16 packing does not apply on this CPU (no oneDNN bf16)")
    assert pack_model(net)
    assert alive[: len(originals)] == [len(originals) - i for i in range(len(originals))]


def test_float16_keeps_nn_linear(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float16", kv_cache_memory="2MiB", quiet=True)
    assert type(llm.engine.model.layers[0].o_proj) is nn.Linear
    assert llm.engine.model.logits_head is None


def test_float32_gets_panel_layers_and_holds_its_weights_once(tiny_models, monkeypatch):
    """fp32 is not oneDNN-packed by default; on AVX-512 or AVX2 its projections and logits become PanelLinear,
    whose panels replace the originals: a tied embedding reads its rows from the head's panels."""
    monkeypatch.delenv(ENV, raising=False)
    llm = LLM(str(tiny_models["smollm-tied"]), dtype="float32", kv_cache_memory="2MiB", quiet=True)
    model = llm.engine.model
    assert type(model.layers[0].qkv_proj) is FP32_KIND
    monkeypatch.setenv(ENV, "0")
    plain = LLM(str(tiny_models["smollm-tied"]), dtype="float32", kv_cache_memory="2MiB", quiet=True)
    if not PANELS:
        return
    assert type(model.embed_tokens) is PanelEmbedding and model.embed_tokens.head is model.logits_head
    dense = plain.engine.model.embed_tokens.weight
    assert torch.equal(model.logits_head.dense_weight(), dense)
    ids = torch.tensor([[0, 47, 48], [dense.shape[0] - 1, 5, 95]])
    assert torch.equal(model.embed_tokens(ids), dense[ids])  # rows bit for bit, any id shape
    # one copy: the weights' size the stats report is the plain model's up to the panels' padding
    panel_bytes = sum(p.numel() * 4 for p in model.parameters())
    plain_bytes = sum(p.numel() * 4 for p in plain.engine.model.parameters())
    assert plain_bytes <= panel_bytes < plain_bytes * 1.05


# 8-row blocks, 64-row items; 2,048 rows are the full suite's (seconds at the logits head)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 63, 64, 65, 300, pytest.param(2048, marks=pytest.mark.slow)])
# SmolLM2's qkv (bias), logits, down; N and K that pad; one short panel; K in three passes (AVX-512's
# pass is 1,536 of K, AVX2's 128), the bias added once
@pytest.mark.parametrize(
    "shape",
    [(960, 576, True), (49152, 576, False), (576, 1536, False), (100, 70, True), (33, 200, True), (50, 3100, True)],
)
def test_fp32_panel_layer_matches_nn_linear(rows, shape):
    out_features, in_features, bias = shape
    linear = _linear(torch.float32, out_features, in_features, bias)
    if not PANELS:  # neither AVX-512 nor AVX2: the engine keeps nn.Linear (checked above)
        return
    if rows == 2048 and out_features == 49152:
        rows = 300  # the logits never see a prefill's rows (only the rows that sample)
    layer = PanelLinear(linear.weight, linear.bias)
    assert torch.equal(layer.dense_weight(), linear.weight)
    x = torch.randn(rows, in_features)
    # fp32 rounding over K terms: the tolerance of SmolLM2's shapes, twice that past K = 1,536
    tol = FP32_TOL if in_features <= 1536 else dict(rtol=2e-5, atol=2e-5)
    with torch.inference_mode():
        got = layer(x)
        assert got.shape == (rows, out_features)
        torch.testing.assert_close(got, linear(x), **tol)
        exact = (x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)).float()
        torch.testing.assert_close(got, exact, **tol)
        torch.testing.assert_close(layer(x.reshape(1, rows, in_features)), got.reshape(1, rows, -1), **tol)
        # one fixed order of sums per output: a row's result does not depend on the batch around it
        assert torch.equal(layer(x[-1:]), got[-1:])
        assert torch.equal(layer(x[rows // 2 :]), got[rows // 2 :])


def test_fp32_panels_that_fail_leave_plain_nn_linear_and_one_log_line(tiny_models, capfd, monkeypatch):
    """A projection the panels cannot take (here the last layer's, in another dtype) after every layer
    before it was packed: the model is back on nn.Linear with the same weights, one `[kvtop]` line
    says why, and the tokens do not move."""
    monkeypatch.setenv(ENV, "0")
    llm = LLM(str(tiny_models["qwen2"]), dtype="float32", kv_cache_memory="2MiB", quiet=True)
    monkeypatch.delenv(ENV)
    prompts = random_prompts(2, (5, 20), seed=15)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = [o.token_ids for o in llm.generate(prompts, params)]
    model = llm.engine.model
    weights = [getattr(layer, n).weight.clone() for layer in model.layers for n in PROJECTIONS]
    last = model.layers[-1]
    down = last.down_proj
    last.down_proj = nn.Linear(down.in_features, down.out_features, bias=False, dtype=torch.float64)
    capfd.readouterr()
    assert pack_model(model) is False
    err = capfd.readouterr().err
    assert (err.count("\n") == 1 and "fp32 panel linear layers off" in err) or not PANELS
    last.down_proj = down
    assert all(type(getattr(layer, n)) is nn.Linear for layer in model.layers for n in PROJECTIONS)
    assert all(
        torch.equal(getattr(layer, n).weight, w)
        for (layer, n), w in zip([(lay, n) for lay in model.layers for n in PROJECTIONS], weights, strict=True)
    )
    assert model.logits_head is None
    assert [o.token_ids for o in llm.generate(prompts, params)] == before


def test_fp32_panel_layer_refuses_what_does_not_fit_and_unpacks():
    linear = _linear(torch.float32, 100, 70, True)
    if not PANELS:
        return
    layer = PanelLinear(linear.weight, linear.bias)
    assert layer.weight.shape == (3, 70, 48) and torch.equal(pack_panels(linear.weight), layer.weight)
    with torch.inference_mode():
        assert layer(torch.randn(0, 70)).shape == (0, 100)
        x = torch.randn(2, 3, 70)
        torch.testing.assert_close(layer(x[:, 1]), linear(x[:, 1]), **FP32_TOL)  # rows not contiguous
        with pytest.raises(RuntimeError, match="last dim as K"):
            layer(torch.randn(4, 64))
        with pytest.raises(RuntimeError, match="float32 CPU tensors"):
            layer(torch.randn(4, 70).to(torch.bfloat16))
    back = unpanelled(layer)
    assert type(back) is nn.Linear and torch.equal(back.weight, linear.weight) and back.bias is layer.bias


def test_fp32_engine_gives_the_same_greedy_tokens_with_and_without_the_panel_kernel(tiny_models, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    path = str(tiny_models["qwen2"])  # qkv bias
    prompts = random_prompts(5, (3, 70), seed=14)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ours, llm = _generate(path, "float32", prompts, params)
    assert type(llm.engine.model.layers[0].qkv_proj) is FP32_KIND
    monkeypatch.setenv(ENV, "0")
    plain, plain_llm = _generate(path, "float32", prompts, params)
    assert type(plain_llm.engine.model.layers[0].qkv_proj) is nn.Linear
    assert ours == plain


@pytest.mark.parametrize(
    "shape", [(49152, 576), (1000, 70), (33, 64)]
)  # SmolLM2's; padded N and K; one group and a bit
def test_tiled_embedding_reads_the_same_rows_as_the_dense_table(shape):
    """A tied embedding's lookup from the logits head's tile layout gives the dense table's rows bit
    for bit, every row for the small tables, ids in any shape."""
    vocab, hidden = shape
    torch.manual_seed(0)
    table = torch.randn(vocab, hidden).to(torch.bfloat16)
    head = SimpleNamespace(weight=_pack_tiles(table), out_features=vocab, in_features=hidden)
    embed = TiledEmbedding(head)  # only the tile layout, no AMX needed to read it
    ids = torch.arange(vocab) if vocab < 5000 else torch.randint(0, vocab, (3000,))
    assert torch.equal(embed(ids), table[ids])
    grid = ids[:12].reshape(3, 4)
    assert torch.equal(embed(grid), table[grid])


def test_a_tied_bf16_model_holds_its_embedding_once(tiny_models, monkeypatch):
    """Where the logits run on AMX tiles or bf16 panels, the lookup reads those: no dense [vocab,
    hidden] copy is left (SmolLM2: 54 MiB). The tokens stay the unpacked model's: the bf16 greedy
    test above."""
    monkeypatch.delenv(ENV, raising=False)
    llm = LLM(str(tiny_models["smollm-tied"]), dtype="bfloat16", kv_cache_memory="2MiB", quiet=True)
    model = llm.engine.model
    spec = model.spec
    dense = [
        n
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.shape == (spec.vocab_size, spec.hidden_size)
    ]
    if AMX:
        assert type(model.embed_tokens) is TiledEmbedding and dense == []
    elif BF16_PANELS:
        assert type(model.embed_tokens) is PanelEmbedding and dense == []
    elif BF16_PACKS:  # oneDNN's packed head cannot be read by rows: the lookup keeps the dense table
        assert dense == ["embed_tokens.weight", "logits_head.weight"]  # held twice (docs/engine.md)
    else:  # nn.Linear everywhere: one table serves the lookup and the logits
        assert dense == ["embed_tokens.weight"]


PREFILL_COPY = (AMX or BF16_PANELS) and BF16_PACKS
needs_prefill_copy = pytest.mark.skipif(
    not PREFILL_COPY,
    reason="this CPU has neither AMX nor AVX512-BF16 (or oneDNN has no bf16 here): no layer holds a prefill copy",
)


@needs_prefill_copy
@pytest.mark.parametrize("rows", [LARGE_ROWS - 16, LARGE_ROWS, 2048])
def test_a_long_prefill_step_runs_on_the_prefill_copy_and_matches_nn_linear(rows):
    """From LARGE_ROWS rows a projection on AMX tiles or bf16 panels that holds oneDNN's copy
    computes on that copy; below it, on its own kernel. Either way within an ulp of nn.Linear."""
    linear = _linear(torch.bfloat16, 960, 576, True)
    packed = packed_linear(linear.weight, linear.bias, large=True)
    assert isinstance(packed, AMXLinear if AMX else PanelLinear) and packed.large is not None
    x = torch.randn(rows, 576).to(torch.bfloat16)
    with torch.inference_mode():
        got = packed(x)
        torch.testing.assert_close(got, linear(x), **BF16_TOL)
        kernel = torch.ops.kvtop_cpu.amx_linear if AMX else torch.ops.kvtop_cpu.bf16_gemm
        own = kernel(x, packed.weight, packed.bias_fp32, packed.out_features)
        assert torch.equal(got, packed.large(x) if rows >= LARGE_ROWS else own)


@needs_prefill_copy
def test_the_prefill_copy_keeps_the_greedy_tokens_and_is_reported_beside_the_weights(tiny_models, monkeypatch):
    """A step of 1,600 prompt tokens (past LARGE_ROWS) with and without the copy: the same greedy
    tokens; the stats report the copy apart, and `weights` keeps the meaning `kvctl plan` gives it."""
    monkeypatch.delenv(ENV, raising=False)
    prompts = random_prompts(8, (200, 200), seed=13)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(LARGE_ENV, mode)
        llm = LLM(str(tiny_models["smollm-tied"]), dtype="bfloat16", kv_cache_memory="8MiB", quiet=True)
        runs[mode] = ([o.token_ids for o in llm.generate(prompts, params)], llm.stats()["memory"], llm)
    (with_copy, mem_copy, llm_copy), (without, mem_plain, _) = runs["1"], runs["0"]
    assert with_copy == without and all(len(t) == 6 for t in with_copy)
    qkv = llm_copy.engine.model.layers[0].qkv_proj
    assert mem_copy["prefill_copy"] == second_copy_bytes(llm_copy.engine.model) > 0 and qkv.large is not None
    assert mem_plain["prefill_copy"] == 0 and mem_copy["weights"] == mem_plain["weights"]
    assert "a oneDNN copy of the projections" in llm_copy.engine.summary()
