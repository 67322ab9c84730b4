"""Prefill attention on the CPU for long prompt chunks: torch's CPU flash attention (SDPA) over
each sequence's own context, gathered from the paged cache, with the reference's signature.

The reference (`engine.kernels.reference.paged_prefill_attention`) pads every sequence to the
longest query and context and builds a boolean mask over all of them; SDPA then cannot skip a
tile. Here sequences that share (new tokens, context length) go through SDPA together, gathering
only their own blocks:
- a chunk that is the whole context (no cached prefix) is plain causal attention: `is_causal=True`
  lets the flash kernel skip the tiles above the diagonal, and no mask is built;
- a one-token chunk sees its whole context: no mask either;
- a chunk over a cached prefix of P tokens, where query i sees keys <= P + i, takes one [n, L] mask
  shared by the group. (Splitting it into an unmasked prefix part and a causal part merged by their
  log-sum-exp was slower unless the prefix is short next to the chunk: measured, not kept.)
GQA goes through `enable_gqa` (no copy of K/V per query head): faster than repeating K/V.
In bf16 where the CPU has AMX tiles, our own kernel (`csrc/amx_attention.cpp`) takes SDPA's place
for every group, masks included: its products run on the tiles, and a tile of queries stops at its
last visible key, where torch's flash kernel computed the causal half above the diagonal too. In
fp32 where the build has AVX-512, `csrc/fp32_attention.cpp` does the same with AVX-512 products
(SmolLM2, 8 prompts x 256: 3.7 ms a layer against SDPA's 5.8-6.8), and in bf16 on AVX-512 without
AMX the fp32 kernel takes upcast copies (7.4 ms a layer against SDPA's 12.5 in bf16) where the build
has no AVX512-BF16; with it (AMD Zen 4) the backend skips this module for `csrc/bf16_attention.cpp`
(`bf16_pairs_pay`).
Padding whole prompts of different lengths into one causal launch was slower (64 prompts of
20..44 tokens: SDPA's time grows with the padded length squared, 64 x 44 costs 2.4x 64 x 32), and
so was one launch per sequence when shapes repeat: measured, not kept.
Keys past a sequence's length are never passed to SDPA, so whatever stale data (even NaN) the
cache holds there cannot leak into the output. Quantized caches are dequantized by the
reference's `gather_kv`, so the semantics are the oracle's. `sdpa_pays` says when the launches
carry too little work each (many short prompts of different lengths) and the backend should keep
the in-place C++ kernel instead.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from engine.kernels.reference import gather_kv

# One SDPA launch costs ~0.2 ms before any work (the flash kernel's buffers); a launch per shape of
# short prompts then loses to the in-place C++ kernel, which has no such cost. Measured (CPU time,
# one thread, SmolLM2 heads): 32 prompts of 17 lengths, no prefix, average 32 tokens (~1,000
# attended pairs per launch): in-place 3.0 vs SDPA 6.0 ms fp32, 3.0 vs 4.2 bf16; average 64
# (~3,900): 10.2 vs 12.5 fp32, 11.4 vs 8.0 bf16; 12 new tokens over 100..500 cached, 16 lengths
# (~3,700): 4.3 vs 4.0; 64 prompts of 32 (one launch, 34,000): 4.3 vs 3.4.
MIN_PAIRS_PER_LAUNCH = 3000


def sdpa_pays(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """Whether SDPA's launches (one per shape) carry enough work each to beat the in-place kernel:
    the (query, key) pairs attended, per distinct (new tokens, context length), at least
    MIN_PAIRS_PER_LAUNCH."""
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    shapes = {(n, length) for n, length in zip(q_lens, lens, strict=True) if n}
    pairs = sum(n * (length - (n - 1) / 2) for n, length in zip(q_lens, lens, strict=True))
    return pairs >= MIN_PAIRS_PER_LAUNCH * len(shapes)


def sdpa_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens `q [total_q, num_heads, head_dim]` over each sequence's
    whole context in the cache (its cached prefix plus the new tokens, already stored)."""
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for s, length in enumerate(lens):
        n = starts[s + 1] - starts[s]
        if n > 0:
            groups.setdefault((n, length), []).append(s)
    out = q.new_empty(q.shape)
    caches = (k_cache, v_cache, k_scale, v_scale)
    for (n, length), seqs in groups.items():
        _attend_group(q, out, caches, block_tables, starts, seqs, n, length, float(scale))
    return out


def _attend_group(
    q: torch.Tensor,
    out: torch.Tensor,
    caches: tuple,
    block_tables: torch.Tensor,
    starts: list[int],
    seqs: list[int],
    n: int,
    length: int,
    scale: float,
) -> None:
    """Attention for the sequences `seqs`, each with `n` new tokens and `length` tokens of context."""
    k_cache, v_cache, k_scale, v_scale = caches
    g, first = len(seqs), seqs[0]
    # sequences packed one after another (the usual case): their queries and outputs are views
    packed = seqs == list(range(first, first + g))
    if packed:
        tables = block_tables[first : first + g]
        rows = slice(starts[first], starts[first] + g * n)
        queries = q[rows].unflatten(0, (g, n))
    else:
        tables = block_tables[torch.tensor(seqs, device=block_tables.device)]
        rows = torch.cat([torch.arange(starts[s], starts[s] + n) for s in seqs]).to(q.device)
        queries = q.index_select(0, rows).unflatten(0, (g, n))
    nblocks = -(-length // k_cache.shape[1])
    upcast = _upcast_attention(queries)
    kv_dtype = torch.float32 if upcast else q.dtype  # the upcast route gathers K/V straight to fp32
    k = gather_kv(k_cache, tables, nblocks, kv_dtype, k_scale)[:, :length]
    v = gather_kv(v_cache, tables, nblocks, kv_dtype, v_scale)[:, :length]
    if _amx_attention(queries, k):  # causal with the prefix's offset: query i sees keys <= length - n + i
        o = torch.ops.kvtop_cpu.amx_causal_attention(queries, k, v, scale)
    elif _fp32_attention(queries, k):  # the same contract in fp32
        o = torch.ops.kvtop_cpu.fp32_causal_attention(queries, k, v, scale)
    elif upcast:
        o = torch.ops.kvtop_cpu.fp32_causal_attention(queries.float(), k, v, scale).to(q.dtype)
    else:
        o = _sdpa(queries, k, v, n, length, scale)
    if packed:
        out[rows].unflatten(0, (g, n)).copy_(o)
    else:
        out.index_copy_(0, rows, o.reshape(g * n, *o.shape[2:]))


def _amx_attention(queries: torch.Tensor, k: torch.Tensor) -> bool:
    """bf16, a head size the kernel takes, and AMX here (asked of the kernel extension once)."""
    head_dim = queries.shape[-1]
    return queries.dtype == k.dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256 and _amx()


def _fp32_attention(queries: torch.Tensor, k: torch.Tensor) -> bool:
    """fp32, a head size the kernel takes, and AVX-512 in the extension's build (asked once)."""
    head_dim = queries.shape[-1]
    return queries.dtype == k.dtype == torch.float32 and head_dim % 16 == 0 and head_dim <= 256 and _avx512()


def bf16_pairs_pay(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """bf16 queries over a bf16 cache, a head size it takes, where the build has AVX512-BF16 and the
    CPU no AMX (AMD Zen 4): `csrc/bf16_attention.cpp` then serves a step's long chunks in one call over
    the paged cache, its products on bf16 pairs. SmolLM2's heads, 8 prompts x 256 on a 2-core Zen 4:
    3.5-3.9 ms a layer against 6.6-9.9 for the fp32 kernel on upcast copies (`_upcast_attention`,
    which keeps AVX-512 CPUs without BF16). With AMX the tile kernel keeps bf16 (`_amx_attention`)."""
    head_dim = q.shape[-1]
    if not (q.dtype == k_cache.dtype == torch.bfloat16 and head_dim % 16 == 0 and head_dim <= 256):
        return False
    return _ask("bf16_attention_supported") and not _amx()


def _upcast_attention(queries: torch.Tensor) -> bool:
    """bf16 where AMX will not take it but the fp32 kernel is built (AVX-512 without AMX: AMD Zen 4,
    Intel before Sapphire Rapids): that kernel on fp32 copies of q, K and V, the output rounded back
    to bf16. The backend reaches it only where `bf16_pairs_pay` says no (AVX-512 without BF16).
    SmolLM2's heads, 8 prompts x 256 on a 2-core Zen 4: 7.4 ms a layer against SDPA's 12.5 in bf16,
    and closer to fp64 (it sums in fp32 and rounds once)."""
    head_dim = queries.shape[-1]
    if queries.dtype != torch.bfloat16 or head_dim % 16 or head_dim > 256:
        return False
    return _avx512() and not (head_dim % 32 == 0 and _amx())  # the AMX kernel's head sizes, where it runs


_ANSWERS: dict[str, bool] = {}  # the extension's answers, once it is loaded


def _ask(question: str) -> bool:
    """The kernel extension's `question` op (amx_supported, fp32_attention_supported). The `cpu` backend
    loads the extension before any prefill reaches this module; where it is not loaded (never built
    from here), SDPA serves."""
    if question not in _ANSWERS:
        try:
            _ANSWERS[question] = bool(getattr(torch.ops.kvtop_cpu, question)())
        except (AttributeError, RuntimeError):  # the extension is not loaded (yet)
            return False
    return _ANSWERS[question]


def _amx() -> bool:
    """AMX tiles here, as the kernel extension says."""
    return _ask("amx_supported")


def _avx512() -> bool:
    """The extension was built with AVX-512 (its fp32 prefill attention)."""
    return _ask("fp32_attention_supported")


def _sdpa(queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, length: int, scale: float) -> torch.Tensor:
    mask = None
    if 1 < n < length:  # query i sits at position length - n + i and sees keys up to it
        positions = torch.arange(length, device=queries.device)
        mask = positions.unsqueeze(0) <= positions[length - n :].unsqueeze(1)
    return F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=n == length and n > 1,
        scale=scale,
        enable_gqa=queries.shape[2] != k.shape[2],
    ).transpose(1, 2)
