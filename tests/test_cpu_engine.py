"""The whole engine on the C++ CPU attention kernels gives the reference backend's greedy tokens."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers import random_prompts


def _generate(path: str, backend: str, prompts, params: SamplingParams, **config) -> list[list[int]]:
    llm = LLM(path, dtype="float32", attention_backend=backend, quiet=True, **config)
    assert llm.stats()["engine"]["attention_backend"] == backend
    llm.generate(prompts[:1], params)  # a second pass below then meets a cached prefix
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    "family,kv_cache_dtype",
    [("qwen2", "auto"), ("qwen2", "int8"), ("smollm-tied", "auto"), ("llama", "fp8_e4m3")],
)
def test_engine_on_cpu_kernels_matches_reference(tiny_models, family, kv_cache_dtype):
    path = str(tiny_models[family])  # qwen2: GQA 4:2 with qkv bias; smollm-tied: GQA 4:1
    # prompts that cross block boundaries, a chunked prefill (budget 32), decodes beside prompt
    # chunks in one step, and a cached prefix
    shared = list(range(500, 540))
    prompts = [shared + p for p in random_prompts(3, (3, 30), seed=5)] + random_prompts(2, (40, 70), seed=6)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    config = dict(kv_cache_memory="2MiB", max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype)
    runs = {backend: _generate(path, backend, prompts, params, **config) for backend in ("reference", "cpu")}
    assert runs["cpu"] == runs["reference"]
    assert all(len(tokens) == 8 for tokens in runs["cpu"])


def test_auto_picks_the_cpu_kernels_on_cpu(tiny_llm):
    assert tiny_llm.stats()["engine"]["attention_backend"] == "cpu"


@pytest.mark.slow
def test_smollm2_on_cpu_kernels_matches_reference(smollm2_llm):
    """SmolLM2-135M fp32 (GQA 9:3, head_dim 64), 64-sequence-like decode batches and long prompts."""
    assert smollm2_llm.stats()["engine"]["attention_backend"] == "cpu"
    shared = random_prompts(1, (120, 120), seed=40)[0]
    prompts = [shared + p for p in random_prompts(6, (5, 60), seed=41)] + random_prompts(6, (100, 300), seed=42)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cpu = [o.token_ids for o in smollm2_llm.generate(prompts, params)]
    ref = LLM("smollm2-135m", dtype="float32", kv_cache_memory="64MiB", attention_backend="reference", quiet=True)
    assert [o.token_ids for o in ref.generate(prompts, params)] == cpu
