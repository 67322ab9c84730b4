"""The whole engine on the Triton kernels (interpreted on CPU) gives the reference's greedy tokens."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, SamplingParams
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
