"""The torch reference kernels against a naive per-sequence attention written from the definition."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels import reference as ref


def naive_attention(q, k, v, causal_offset: int) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, KVH, D]; query j sees keys 0..causal_offset + j."""
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    for h in range(heads):
        kh, vh = k[:, h // group], v[:, h // group]
        for j in range(q.shape[0]):
            scores = (kh[: causal_offset + j + 1] @ q[j, h]) / math.sqrt(q.shape[-1])
            out[j, h] = torch.softmax(scores, 0) @ vh[: causal_offset + j + 1]
    return out


def build_cache(contexts, kv_heads, head_dim, block_size, num_blocks, gen):
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, ks, vs = [], [], []
    for length in contexts:
        nb = -(-length // block_size)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(length, kv_heads, head_dim, generator=gen)
        v = torch.randn(length, kv_heads, head_dim, generator=gen)
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(length)])
        ref.store_kv(k, v, k_cache, v_cache, slots)
        ks.append(k)
        vs.append(v)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, bt, ks, vs


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_decode_matches_naive(heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    contexts = [1, 17, 40, 5]
    k_cache, v_cache, bt, ks, vs = build_cache(contexts, kv_heads, 16, 8, 32, gen)
    q = torch.randn(len(contexts), heads, 16, generator=gen)
    out = ref.paged_decode_attention(q, k_cache, v_cache, bt, torch.tensor(contexts, dtype=torch.int32), 16**-0.5)
    for i, length in enumerate(contexts):
        expected = naive_attention(q[i : i + 1], ks[i], vs[i], causal_offset=length - 1)
        torch.testing.assert_close(out[i : i + 1], expected, rtol=1e-5, atol=1e-5)


def test_prefill_over_cached_prefix_matches_naive():
    gen = torch.Generator().manual_seed(1)
    contexts = [30, 9, 64]
    new = [12, 9, 1]  # first: 18 cached + 12 new; second: all new; third: a decode token
    k_cache, v_cache, bt, ks, vs = build_cache(contexts, 2, 16, 16, 16, gen)
    q = torch.randn(sum(new), 4, 16, generator=gen)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    out = ref.paged_prefill_attention(q, k_cache, v_cache, bt, cu, torch.tensor(contexts, dtype=torch.int32), 0.25)
    for i, (length, n) in enumerate(zip(contexts, new, strict=True)):
        expected = naive_attention(q[cu[i] : cu[i + 1]], ks[i], vs[i], causal_offset=length - n)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], expected, rtol=1e-5, atol=1e-5)


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 1, 8)
    ref.store_kv(key, key * 2, k_cache, v_cache, torch.tensor([0, -1, 5]))
    flat = k_cache.view(8, 8)
    assert flat[0].eq(1).all() and flat[5].eq(1).all()
    assert flat[[1, 2, 3, 4, 6, 7]].eq(0).all()
