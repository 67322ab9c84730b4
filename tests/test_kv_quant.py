"""Quantized KV through the engine: capacity doubles against 16-bit, tokens stay close."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import reference as ref


def test_capacity_roughly_doubles_against_16_bit(tiny_dir):
    sizes = {}
    for kvd in ("auto", "fp8_e4m3", "int8"):
        llm = LLM(str(tiny_dir), dtype="bfloat16", kv_cache_memory="4MiB", kv_cache_dtype=kvd, quiet=True)
        sizes[kvd] = llm.stats()["kv"]["num_blocks"]
    assert sizes["fp8_e4m3"] == 2 * sizes["auto"]
    # int8 carries one float32 scale per token per head: head_dim 16 -> 16 + 4 bytes vs 32
    assert 1.5 * sizes["auto"] <= sizes["int8"] < 2 * sizes["auto"]


@pytest.mark.slow
@pytest.mark.parametrize("kvd", ["fp8_e4m3", "int8"])
def test_quantized_smollm2_agrees_with_full_precision(smollm2_llm, kvd):
    """On the real model, greedy tokens with a quantized cache mostly match the fp32 cache
    (random-weight tiny models are too flat to say anything here)."""
    tok = smollm2_llm.tokenizer
    asks = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish.", "What is 2 + 2?",
            "Describe the sea in one sentence.", "Who wrote Hamlet?"]  # fmt: skip
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)
        for a in asks
    ]  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    full = smollm2_llm.generate(prompts, params)
    quant = LLM("smollm2-135m", dtype="float32", kv_cache_memory="64MiB", kv_cache_dtype=kvd, quiet=True)
    got = quant.generate(prompts, params)
    agree = sum(a == b for o, g in zip(full, got, strict=True) for a, b in zip(o.token_ids, g.token_ids, strict=True))
    assert agree / (8 * len(prompts)) >= 0.6
    assert sum(o.token_ids[0] == g.token_ids[0] for o, g in zip(full, got, strict=True)) >= len(prompts) - 1
    assert quant.stats()["kv"]["dtype"] == kvd


@pytest.mark.parametrize(("kvd", "bound"), [("int8", 0.01), ("fp8_e4m3", 0.07)])
def test_store_load_round_trip_error(kvd, bound):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 32, generator=gen) * 3
    dtype = torch.int8 if kvd == "int8" else torch.float8_e4m3fn
    k_cache = torch.zeros(8, 16, 2, 32, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    if kvd == "int8":
        ks, vs = torch.ones(8, 16, 2), torch.ones(8, 16, 2)
    else:
        ks, vs = torch.ones(1), torch.ones(1)
    slots = torch.randperm(128, generator=gen)[:64]
    ref.store_kv(x, x, k_cache, v_cache, slots, ks, vs)
    table = torch.arange(8, dtype=torch.int32).unsqueeze(0)
    back = ref.gather_kv(k_cache, table, 8, torch.float32, ks).view(128, 2, 32)[slots]
    rel = ((back - x).norm() / x.norm()).item()
    assert rel < bound
