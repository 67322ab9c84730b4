"""The whole engine on the Triton kernels (interpreted on CPU) gives the reference's greedy tokens,
and its element-wise kernels give the tokens of the reference's torch element-wise ops."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, SamplingParams
from engine.kernels import ELEMENTWISE_ENV
from tests.helpers import random_prompts


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_on_triton_matches_reference(tiny_models, kv_cache_dtype):
    path = str(tiny_models["qwen2"])  # GQA 4:2, qkv bias
    # prompts that cross block boundaries, a chunked prefill (budget 32) and a cached prefix
    shared = list(range(500, 540))
    prompts = [shared + p for p in random_prompts(3, (3, 30), seed=5)] + random_prompts(2, (40, 70), seed=6)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = {}
    for backend in ("reference", "triton"):
        llm = LLM(path, dtype="float32", kv_cache_memory="2MiB", max_num_batched_tokens=32,
                  attention_backend=backend, kv_cache_dtype=kv_cache_dtype, quiet=True)  # fmt: skip
        llm.generate(prompts[:1], params)
        runs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.stats()["engine"]["attention_backend"] == backend
    assert runs["triton"] == runs["reference"]


def test_the_triton_elementwise_kernels_keep_the_greedy_tokens(tiny_models, monkeypatch):
    """The Triton backend with its RMSNorm (+ residual), RoPE and SiLU-and-mul kernels, against the
    same backend with the reference's torch ops in their place (KVTOP_TRITON_ELEMENTWISE=0). Qwen3:
    its per-head q/k norm runs on views of the qkv projection; a 40-token prompt is chunked."""
    from engine.kernels.triton import elementwise

    path = str(tiny_models["qwen3"])
    prompts = random_prompts(3, (5, 41), seed=9)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv(ELEMENTWISE_ENV, fused)
        llm = LLM(path, dtype="float32", kv_cache_memory="2MiB", max_num_batched_tokens=32,
                  attention_backend="triton", quiet=True)  # fmt: skip
        assert (llm.engine.runner.kernels.rms_norm is elementwise.rms_norm) == (fused == "1")
        runs[fused] = [o.token_ids for o in llm.generate(prompts, params)]
    assert runs["1"] == runs["0"]
