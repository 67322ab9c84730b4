"""The Triton kernels against the torch reference (`engine.kernels.reference`, the oracle).

Without a GPU they run under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is
imported), in float32 and on small shapes: the interpreter runs every program in Python. With a
GPU the same tests run compiled, plus bf16 cases.

Tolerances and bounds, stated once:
- float32, Triton vs reference: 1e-5 (abs and rel) under the interpreter; 1e-4 compiled, where
  fp32 tiles are multiplied as three-pass tf32 on the tensor cores.
- quantized caches, Triton vs reference on the same quantized cache: the same fp32 tolerance;
  `store_kv` writes the same bytes and scales as the reference, bit for bit.
- store/load round trip: int8 |x - x̂| <= scale / 2 (scale = absmax / 127 per token and KV head);
  fp8_e4m3 |x - x̂| <= max(|x| * 2^-4, scale * 2^-10) (3 mantissa bits, subnormal step 2^-9).
- attention over a quantized cache vs fp32 attention over the unquantized K/V (q, K, V ~ N(0, 1),
  softmax scale 1/sqrt(d)): int8 max abs error <= 0.05 and relative (Frobenius) error <= 0.02;
  fp8 max abs <= 0.4 and relative <= 0.06 (measured worst over 20 draws: 0.014 / 0.0075 and
  0.15 / 0.030).
- bf16 (GPU only) vs fp32 reference on the same cache: abs 3e-2, rel 3e-2.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from engine.kernels import reference as ref
from engine.kernels import triton as tk

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
FP32_TOL = {"atol": 1e-4, "rtol": 1e-4} if CUDA else {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}
QUANT_BOUNDS = {"int8": (0.05, 0.02), "fp8": (0.4, 0.06)}  # (max abs, relative Frobenius)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# (num_heads, num_kv_heads): GQA ratios 1, 3, 4 and 8
HEADS = [(2, 2), (6, 2), (4, 1), (8, 1)]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Paged:
    """A paged KV cache holding random K/V in every slot (stale data where no sequence owns it),
    optionally quantized, with the fp32 K/V it was made from, and random block tables."""

    def __init__(
        self,
        seq_lens: list[int],
        block_size: int,
        kv_heads: int,
        head_dim: int,
        kind: str = "auto",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        need = [cdiv(n, block_size) for n in seq_lens]
        num_blocks = sum(need) + 4
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_fp32 = torch.randn(shape, generator=gen)
        self.v_fp32 = torch.randn(shape, generator=gen)
        self.k_scale = self.v_scale = None
        if kind == "auto":
            self.k_cache = self.k_fp32.to(dtype)
            self.v_cache = self.v_fp32.to(dtype)
        else:
            cache_dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
            self.k_cache = torch.empty(shape, dtype=cache_dtype)
            self.v_cache = torch.empty(shape, dtype=cache_dtype)
            if kind == "int8":
                self.k_scale = torch.empty(shape[:3])
                self.v_scale = torch.empty(shape[:3])
            else:  # a calibrated per-tensor scale: the largest value maps to FP8_MAX
                self.k_scale = (self.k_fp32.abs().max() / ref.FP8_MAX).view(1)
                self.v_scale = (self.v_fp32.abs().max() / ref.FP8_MAX).view(1)
            every_slot = torch.arange(num_blocks * block_size)
            rows = (num_blocks * block_size, kv_heads, head_dim)
            ref.store_kv(
                self.k_fp32.view(rows), self.v_fp32.view(rows), self.k_cache, self.v_cache,
                every_slot, self.k_scale, self.v_scale,
            )  # fmt: skip
        # blocks in random order; block 0 is never owned, and the padding entries (0) point at it
        order = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
        self.block_tables = torch.zeros(len(seq_lens), max(need) + 2, dtype=torch.int32)
        start = 0
        for s, n in enumerate(need):
            self.block_tables[s, :n] = order[start : start + n]
            start += n
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.block_size = block_size
        self.to(DEVICE)

    def to(self, device: torch.device) -> Paged:
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    def cache_args(self) -> tuple:
        return self.k_cache, self.v_cache

    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def strided_q(tokens: int, heads: int, head_dim: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Queries as the engine sees them: a slice of a fused qkv projection (not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, heads + 4, head_dim, generator=gen).to(DEVICE, dtype)
    return qkv[:, :heads]


def cu_seqlens(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


@pytest.fixture
def force_splits(monkeypatch: pytest.MonkeyPatch):
    def force(n: int) -> None:
        monkeypatch.setattr(tk, "decode_num_splits", lambda *args: n)

    return force


# ---------------------------------------------------------------------------------------------
# decode


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_reference(head_dim, heads, kv_heads, block_size, splits, force_splits):
    force_splits(splits)
    # 1 token, exactly one full block, and ragged lengths that leave the last block part-filled
    lens = [1, block_size, 45, 333]
    cache = Paged(lens, block_size, kv_heads, head_dim, seed=head_dim + heads + block_size)
    q = strided_q(len(lens), heads, head_dim, seed=splits)
    args = (q, *cache.cache_args(), cache.block_tables, cache.seq_lens, head_dim**-0.5)
    out = tk.paged_decode_attention(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref.paged_decode_attention(*args), **FP32_TOL)


def test_decode_chooses_splits_for_a_long_context():
    """The default heuristic (no forcing) splits one long sequence, and the merge is exact."""
    lens = [700]
    cache = Paged(lens, 16, 1, 64, seed=7)
    num_sms = tk._num_sms(DEVICE)
    assert tk.decode_num_splits(1, 1, cache.block_tables.shape[1] * 16, num_sms) > 1
    q = strided_q(1, 4, 64, seed=7)
    args = (q, *cache.cache_args(), cache.block_tables, cache.seq_lens, 0.125)
    torch.testing.assert_close(tk.paged_decode_attention(*args), ref.paged_decode_attention(*args), **FP32_TOL)


def test_decode_num_splits_heuristic():
    sms = 132
    # enough (sequence, KV head) programs to fill the GPU: no split
    assert tk.decode_num_splits(256, 8, 32768, sms) == 1
    # a short context is never split, however idle the GPU
    assert tk.decode_num_splits(1, 8, 200, sms) == 1
    # one long sequence: split up to the cap, pieces never shorter than MIN_TOKENS_PER_SPLIT
    long_one = tk.decode_num_splits(1, 8, 32768, sms)
    assert 1 < long_one <= tk.MAX_SPLITS
    assert 32768 // long_one >= tk.MIN_TOKENS_PER_SPLIT
    # more sequences need fewer splits; longer contexts allow more; always a power of two
    for batch in (1, 2, 4, 16, 64):
        for length in (256, 1000, 4096, 32768):
            n = tk.decode_num_splits(batch, 8, length, sms)
            assert n & (n - 1) == 0
            assert n >= tk.decode_num_splits(batch * 2, 8, length, sms)
            assert n <= tk.decode_num_splits(batch, 8, length * 2, sms)
    # few SMs (the interpreter's stand-in): few splits
    assert tk.decode_num_splits(1, 1, 100_000, tk._INTERPRETER_SMS) <= 4 * tk._INTERPRETER_SMS


# ---------------------------------------------------------------------------------------------
# prefill


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_matches_reference(head_dim, heads, kv_heads, block_size):
    # (cached prefix, new tokens): a lone token, a fresh prompt, and prompts whose prefix is cached
    seqs = [(0, 1), (0, 45), (block_size + 5, 30), (200, 90)]
    lens = [p + n for p, n in seqs]
    cache = Paged(lens, block_size, kv_heads, head_dim, seed=head_dim * heads + block_size)
    q_lens = [n for _, n in seqs]
    q = strided_q(sum(q_lens), heads, head_dim, seed=heads)
    args = (q, *cache.cache_args(), cache.block_tables, cu_seqlens(q_lens), cache.seq_lens, head_dim**-0.5)
    out = tk.paged_prefill_attention(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref.paged_prefill_attention(*args), **FP32_TOL)


@pytest.mark.parametrize("block_size", [16, pytest.param(32, marks=pytest.mark.slow)])  # 32: the full suite's
def test_chunked_prefill_equals_one_shot(block_size):
    """Two prompts prefilled in two chunks each (K/V stored chunk by chunk through `store_kv`)
    give the outputs of one shot."""
    heads, kv_heads, head_dim = 6, 2, 64
    lens, cuts = [150, 77], [90, 40]
    gen = torch.Generator().manual_seed(block_size)
    k = [torch.randn(n, kv_heads, head_dim, generator=gen).to(DEVICE) for n in lens]
    v = [torch.randn(n, kv_heads, head_dim, generator=gen).to(DEVICE) for n in lens]
    q = [torch.randn(n, heads, head_dim, generator=gen).to(DEVICE) for n in lens]
    layout = Paged(lens, block_size, kv_heads, head_dim, seed=3)  # for its block tables
    tables = layout.block_tables

    def slots(s: int, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi, device=DEVICE)
        return (tables[s, pos // block_size].long() * block_size + pos % block_size).long()

    def run(chunks: list[list[tuple[int, int]]]) -> list[torch.Tensor]:
        """chunks[c][s] = (lo, hi): the new tokens of sequence s in step c."""
        k_cache = torch.zeros_like(layout.k_cache)
        v_cache = torch.zeros_like(layout.v_cache)
        outs: list[list[torch.Tensor]] = [[] for _ in lens]
        for step in chunks:
            tk.store_kv(
                torch.cat([k[s][lo:hi] for s, (lo, hi) in enumerate(step)]),
                torch.cat([v[s][lo:hi] for s, (lo, hi) in enumerate(step)]),
                k_cache, v_cache, torch.cat([slots(s, lo, hi) for s, (lo, hi) in enumerate(step)]),
            )  # fmt: skip
            q_lens = [hi - lo for lo, hi in step]
            seq_lens = torch.tensor([hi for _, hi in step], dtype=torch.int32, device=DEVICE)
            packed = torch.cat([q[s][lo:hi] for s, (lo, hi) in enumerate(step)])
            args = (packed, k_cache, v_cache, tables, cu_seqlens(q_lens), seq_lens, head_dim**-0.5)
            out = tk.paged_prefill_attention(*args)
            torch.testing.assert_close(out, ref.paged_prefill_attention(*args), **FP32_TOL)
            for s, part in enumerate(out.split(q_lens)):
                outs[s].append(part)
        return [torch.cat(o) for o in outs]

    one_shot = run([[(0, n) for n in lens]])
    chunked = run([[(0, c) for c in cuts], [(c, n) for c, n in zip(cuts, lens)]])
    for a, b in zip(chunked, one_shot):
        torch.testing.assert_close(a, b, **FP32_TOL)


# ---------------------------------------------------------------------------------------------
# store_kv


@pytest.mark.parametrize("kind", ["auto", "int8", "fp8"])
def test_store_kv_matches_reference_and_skips_padding(kind):
    num_blocks, block_size, kv_heads, head_dim, n = 12, 16, 3, 64, 40
    gen = torch.Generator().manual_seed(11)
    # key/value as slices of a fused projection: rows not contiguous
    kv = (torch.randn(n, 2 * kv_heads + 1, head_dim, generator=gen) * 3).to(DEVICE)
    key, value = kv[:, :kv_heads], kv[:, kv_heads : 2 * kv_heads]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[::5] = -1  # padding tokens
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    if kind == "auto":
        k_cache = torch.randn(shape, generator=gen).to(DEVICE)
        v_cache = torch.randn(shape, generator=gen).to(DEVICE)
        k_scale = v_scale = None
    else:
        dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
        k_cache = torch.randint(-100, 100, shape, generator=gen, dtype=torch.int8).to(DEVICE)
        v_cache = torch.randint(-100, 100, shape, generator=gen, dtype=torch.int8).to(DEVICE)
        if dtype == torch.float8_e4m3fn:  # random finite fp8 bytes (0x7f / 0xff are NaN)
            k_cache = (k_cache.view(torch.uint8) & 0x77).view(dtype)
            v_cache = (v_cache.view(torch.uint8) & 0x77).view(dtype)
        if kind == "int8":
            k_scale = torch.rand(shape[:3], generator=gen).to(DEVICE)
            v_scale = torch.rand(shape[:3], generator=gen).to(DEVICE)
        else:
            k_scale = torch.tensor([0.02], device=DEVICE)
            v_scale = torch.tensor([0.03], device=DEVICE)
    per_slot = [k_cache, v_cache] + ([k_scale, v_scale] if kind == "int8" else [])
    before = [t.clone() for t in per_slot]
    expected = [t.clone() for t in before]
    exp_scales = expected[2:] if kind == "int8" else [k_scale, v_scale]
    tk.store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    ref.store_kv(key, value, expected[0], expected[1], slots, *exp_scales)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    for got, want, old in zip(per_slot, expected, before):
        # the same bytes as the reference (quantized values and int8 scales included)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        # and nothing but the written slots changed
        rows_got = got.reshape(num_blocks * block_size, -1)[~written]
        rows_old = old.reshape(num_blocks * block_size, -1)[~written]
        assert torch.equal(rows_got.view(torch.uint8), rows_old.view(torch.uint8))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_store_load_round_trip(kind):
    n, kv_heads, head_dim = 64, 2, 128
    gen = torch.Generator().manual_seed(5)
    # magnitudes spread over decades, so fp8 meets its subnormals too
    x = torch.randn(n, kv_heads, head_dim, generator=gen) * 10 ** torch.empty(n, 1, 1).uniform_(-3, 1, generator=gen)
    x = x.to(DEVICE)
    shape = (n // 16, 16, kv_heads, head_dim)
    dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    k_cache, v_cache = torch.empty(shape, dtype=dtype, device=DEVICE), torch.empty(shape, dtype=dtype, device=DEVICE)
    if kind == "int8":
        k_scale, v_scale = torch.empty(shape[:3], device=DEVICE), torch.empty(shape[:3], device=DEVICE)
    else:
        k_scale = v_scale = (x.abs().max() / ref.FP8_MAX).view(1)
    tk.store_kv(x, x, k_cache, v_cache, torch.arange(n, device=DEVICE), k_scale, v_scale)
    tables = torch.arange(n // 16, dtype=torch.int32, device=DEVICE).view(1, -1)
    back = ref.gather_kv(k_cache, tables, n // 16, torch.float32, k_scale).view(n, kv_heads, head_dim)
    err = (back - x).abs()
    if kind == "int8":
        scale = k_scale.view(n, kv_heads, 1)
        torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / ref.INT8_MAX)
        assert bool((err <= scale / 2 * (1 + 1e-6)).all())
    else:
        bound = torch.maximum(x.abs() * 2.0**-4, k_scale * 2.0**-10)
        assert bool((err <= bound * (1 + 1e-6)).all())


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_attention(kind, phase, force_splits):
    force_splits(2)
    heads, kv_heads, head_dim, block_size = 8, 2, 128, 16
    if phase == "decode":
        lens, q_lens = [1, 100, 190], [1, 1, 1]
    else:
        lens, q_lens = [20, 100, 190], [20, 40, 7]
    quant = Paged(lens, block_size, kv_heads, head_dim, kind=kind, seed=21)
    q = strided_q(sum(q_lens), heads, head_dim, seed=22)
    tables, scale = quant.block_tables, head_dim**-0.5
    if phase == "decode":
        q = q.view(len(lens), heads, head_dim)

        def attend(module, k, v, **scales):
            return module.paged_decode_attention(q, k, v, tables, quant.seq_lens, scale, **scales)
    else:
        cu = cu_seqlens(q_lens)

        def attend(module, k, v, **scales):
            return module.paged_prefill_attention(q, k, v, tables, cu, quant.seq_lens, scale, **scales)

    out = attend(tk, *quant.cache_args(), **quant.scales())
    # the kernels dequantize as the reference does
    torch.testing.assert_close(out, attend(ref, *quant.cache_args(), **quant.scales()), **FP32_TOL)
    # and the quantization error stays within the stated bounds of fp32 attention
    exact = attend(ref, quant.k_fp32, quant.v_fp32)
    max_abs, rel = QUANT_BOUNDS[kind]
    assert (out - exact).abs().max().item() <= max_abs
    assert ((out - exact).norm() / exact.norm()).item() <= rel


# ---------------------------------------------------------------------------------------------
# what the kernels must not read


@pytest.mark.parametrize("kind", ["auto", "int8", "fp8"])
def test_attention_never_reads_past_seq_len(kind, force_splits):
    """Unwritten slots and the blocks that padding table entries point at hold NaN: the kernels
    must not read them (a masked-out NaN still poisons a softmax or a P·V product)."""
    force_splits(2)
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 16
    lens, q_lens = [5, 40, 67], [5, 9, 1]
    cache = Paged(lens, block_size, kv_heads, head_dim, kind=kind, seed=31)
    clean = [t.clone() for t in (cache.k_cache, cache.v_cache)] + [
        None if s is None else s.clone() for s in (cache.k_scale, cache.v_scale)
    ]
    num_blocks = cache.k_cache.shape[0]
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    for s, n in enumerate(lens):
        pos = torch.arange(n, device=DEVICE)
        live[cache.block_tables[s, pos // block_size].long() * block_size + pos % block_size] = True
    dead = ~live
    if kind == "auto":
        for t in (cache.k_cache, cache.v_cache):
            t.view(num_blocks * block_size, -1)[dead] = float("nan")
    elif kind == "int8":
        for t in (cache.k_scale, cache.v_scale):
            t.view(num_blocks * block_size, -1)[dead] = float("nan")
    else:
        for t in (cache.k_cache, cache.v_cache):
            t.view(torch.uint8).view(num_blocks * block_size, -1)[dead] = 0x7F  # fp8 NaN

    q = strided_q(sum(q_lens), heads, head_dim, seed=32)
    clean_scales = {"k_scale": clean[2], "v_scale": clean[3]}
    tables, seq_lens = cache.block_tables, cache.seq_lens
    dq = q[: len(lens)]
    out = tk.paged_decode_attention(dq, *cache.cache_args(), tables, seq_lens, 0.125, **cache.scales())
    want = ref.paged_decode_attention(dq, clean[0], clean[1], tables, seq_lens, 0.125, **clean_scales)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, want, **FP32_TOL)
    cu = cu_seqlens(q_lens)
    out = tk.paged_prefill_attention(q, *cache.cache_args(), tables, cu, seq_lens, 0.125, **cache.scales())
    want = ref.paged_prefill_attention(q, clean[0], clean[1], tables, cu, seq_lens, 0.125, **clean_scales)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, want, **FP32_TOL)


# ---------------------------------------------------------------------------------------------
# bf16, compiled (GPU only: the interpreter has no bf16 arithmetic)


@needs_cuda
@pytest.mark.parametrize("kind", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64), (8, 1, 128)])
def test_bf16_decode_and_prefill(heads, kv_heads, head_dim, kind):
    lens = [1, 17, 300, 1000, 4100]
    cache = Paged(lens, 16, kv_heads, head_dim, kind=kind, dtype=torch.bfloat16, seed=41)
    scales = cache.scales()
    q = strided_q(len(lens), heads, head_dim, seed=42, dtype=torch.bfloat16)
    args = (cache.block_tables, cache.seq_lens, head_dim**-0.5)
    # the fp32 reference over the same cache (a bf16 one upcast; a quantized one dequantized to fp32)
    fp32_cache = cache.cache_args() if kind != "auto" else (cache.k_cache.float(), cache.v_cache.float())
    out = tk.paged_decode_attention(q, *cache.cache_args(), *args, **scales)
    assert out.dtype == torch.bfloat16
    want = ref.paged_decode_attention(q.float(), *fp32_cache, *args, **scales)
    torch.testing.assert_close(out.float(), want, **BF16_TOL)

    q_lens = [1, 17, 100, 1000, 64]
    qp = strided_q(sum(q_lens), heads, head_dim, seed=43, dtype=torch.bfloat16)
    args = (cache.block_tables, cu_seqlens(q_lens), cache.seq_lens, head_dim**-0.5)
    out = tk.paged_prefill_attention(qp, *cache.cache_args(), *args, **scales)
    want = ref.paged_prefill_attention(qp.float(), *fp32_cache, *args, **scales)
    torch.testing.assert_close(out.float(), want, **BF16_TOL)


@needs_cuda
def test_bf16_store_kv_matches_reference():
    n, kv_heads, head_dim = 300, 8, 128
    key = torch.randn(n, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn(n, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device=DEVICE)[:n]
    slots[::7] = -1
    for dtype in (torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        caches = [torch.zeros(64, 16, kv_heads, head_dim, device=DEVICE).to(dtype) for _ in range(4)]
        if dtype == torch.int8:
            scales = [torch.zeros(64, 16, kv_heads, device=DEVICE) for _ in range(4)]
        elif dtype == torch.float8_e4m3fn:
            scales = [torch.tensor([0.01], device=DEVICE)] * 4
        else:
            scales = [None] * 4
        tk.store_kv(key, value, caches[0], caches[1], slots, scales[0], scales[1])
        ref.store_kv(key, value, caches[2], caches[3], slots, scales[2], scales[3])
        for got, want in ((caches[0], caches[2]), (caches[1], caches[3]), (scales[0], scales[2])):
            if got is not None:
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
