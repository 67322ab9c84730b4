"""The C++ CPU kernels (`engine.kernels.cpu`) against the torch reference (the oracle), and the
fallback to the reference when the kernel cannot be built.

Tolerances, stated once:
- float32 queries over a float32, int8 or fp8 cache: 2e-5 abs and rel (both accumulate in fp32;
  only the order of the sums differs; measured worst about 1.5e-6).
- bfloat16 (float16) queries over a bfloat16 (float16) cache: 2e-2 abs and rel (the kernel
  accumulates in fp32 and rounds once; the reference runs SDPA in the 16-bit dtype).
"""

from __future__ import annotations

import inspect
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu
from engine.kernels import reference as ref
from tests.test_triton_kernels import Paged, cu_seqlens, strided_q

pytestmark = pytest.mark.skipif(not cpu.load(), reason="the CPU attention kernel could not be built here")

FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}
# (num_heads, num_kv_heads): GQA ratios 1, 3 (SmolLM2's 9:3), 7 (Qwen2-0.5B's 14:2) and 8; the
# AVX-512 decode path unrolls groups of 1-4 and runs 5-8 in an 8-row kernel
HEADS = [(4, 4), (9, 3), (14, 2), (8, 1)]
KINDS = ["auto", "int8", "fp8"]


def decode_case(kind, heads, kv_heads, head_dim, block_size=16, dtype=torch.float32, seed=0):
    # 1 token, exactly one full block, ragged lengths that leave the last block part-filled, hundreds
    lens = [1, block_size, 45, 333, 130]
    cache = Paged(lens, block_size, kv_heads, head_dim, kind=kind, dtype=dtype, seed=seed)
    q = strided_q(len(lens), heads, head_dim, seed=seed + 1, dtype=dtype)
    return (q, *cache.cache_args(), cache.block_tables, cache.seq_lens, head_dim**-0.5), cache.scales()


def prefill_case(kind, heads, kv_heads, head_dim, block_size=16, dtype=torch.float32, seed=0):
    # (cached prefix, new tokens): a lone token, a fresh prompt longer than a query tile, and
    # prompts whose prefix is cached (one ending mid-block, one hundreds of tokens long)
    seqs = [(0, 1), (0, 45), (block_size + 5, 30), (200, 90), (7, 1)]
    lens = [p + n for p, n in seqs]
    cache = Paged(lens, block_size, kv_heads, head_dim, kind=kind, dtype=dtype, seed=seed)
    q_lens = [n for _, n in seqs]
    q = strided_q(sum(q_lens), heads, head_dim, seed=seed + 1, dtype=dtype)
    args = (q, *cache.cache_args(), cache.block_tables, cu_seqlens(q_lens), cache.seq_lens, head_dim**-0.5)
    return args, cache.scales()


# (case maker, the C++ kernel, its oracle)
PHASES = {
    "decode": (decode_case, cpu.paged_decode_attention, ref.paged_decode_attention),
    "prefill": (prefill_case, cpu.inplace_prefill_attention, ref.paged_prefill_attention),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_reference(kind, heads, kv_heads, head_dim):
    args, scales = decode_case(kind, heads, kv_heads, head_dim, seed=head_dim + heads)
    out = cpu.paged_decode_attention(*args, **scales)
    assert out.shape == args[0].shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref.paged_decode_attention(*args, **scales), **FP32_TOL)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("lens", [[333], [700, 129]])
def test_few_long_sequences_split_across_threads_match_reference(kind, heads, kv_heads, lens):
    """Fewer (sequence, KV head) items than twice the threads — one sequence's heads — run each
    item's keys in parts on every thread, merged after (paged_attention.cpp's decode_parts): the
    same result as one pass."""
    cache = Paged(lens, 16, kv_heads, 64, kind=kind, seed=len(lens))
    q = strided_q(len(lens), heads, 64, seed=heads)
    args = (q, *cache.cache_args(), cache.block_tables, cache.seq_lens, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # parts only where there are threads to share them
    try:
        out = cpu.paged_decode_attention(*args, **cache.scales())
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, ref.paged_decode_attention(*args, **cache.scales()), **FP32_TOL)


def test_decode_reads_int32_lengths_in_place_and_any_other_integer_dtype_alike():
    """The engine's int32 seq_lens are read where they lie (a strided view too); int64 ones go through
    a conversion: the same lengths, the same result; lengths that do not match the queries are refused."""
    lens = [1, 16, 45, 333, 130]
    cache = Paged(lens, 16, 3, 64, dtype=torch.bfloat16, seed=3)
    q = strided_q(len(lens), 9, 64, seed=3, dtype=torch.bfloat16)
    decode = torch.ops.kvtop_cpu.paged_decode
    rest = (*cache.cache_args(), cache.block_tables.to(torch.int32))
    want = decode(q, *rest, cache.seq_lens.to(torch.int32), 0.125, None, None)
    spread = torch.zeros(2 * len(lens), dtype=torch.int32)
    spread[::2] = cache.seq_lens
    for seq_lens in (cache.seq_lens.to(torch.int64), spread[::2]):
        assert torch.equal(decode(q, *rest, seq_lens, 0.125, None, None), want)
    with pytest.raises(RuntimeError, match="one seq_len per query token"):
        decode(q, *rest, cache.seq_lens[:-1].to(torch.int32), 0.125, None, None)


@pytest.mark.parametrize("block_size", [16, 8])  # 8: the general kernel, which takes float32 rows
@pytest.mark.parametrize("lens", [[1, 16, 45, 333, 130], [333]])
def test_a_bf16_query_gives_the_float32_querys_result_rounded_bit_for_bit(lens, block_size):
    """The fused decode hands the op a bf16 model's query as it is and takes its result in bf16
    (decode_layers.cpp), and so does the Python path: the same numbers as a float32 query's, rounded."""
    cache = Paged(lens, block_size, 3, 64, dtype=torch.bfloat16, seed=block_size)
    q = strided_q(len(lens), 9, 64, seed=len(lens), dtype=torch.bfloat16)
    rest = (*cache.cache_args(), cache.block_tables.to(torch.int32), cache.seq_lens, 0.125, None, None)
    direct = torch.ops.kvtop_cpu.paged_decode(q, *rest)
    assert direct.dtype == torch.bfloat16
    assert torch.equal(direct, torch.ops.kvtop_cpu.paged_decode(q.float(), *rest).bfloat16())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_with_cached_prefix_matches_reference(kind, heads, kv_heads, head_dim):
    args, scales = prefill_case(kind, heads, kv_heads, head_dim, seed=head_dim * heads)
    out = cpu.inplace_prefill_attention(*args, **scales)
    assert out.shape == args[0].shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref.paged_prefill_attention(*args, **scales), **FP32_TOL)


@pytest.mark.parametrize("new_tokens", [1, cpu.SHORT_CHUNK, cpu.SHORT_CHUNK + 1, 40])
def test_prefill_on_either_side_of_the_short_chunk_rule_matches_reference(new_tokens):
    """The backend's prefill takes the C++ kernel for short chunks and the reference's SDPA for
    long ones; either way, the reference's output."""
    lens = [new_tokens, 37 + new_tokens, 300 + new_tokens]
    cache = Paged(lens, 16, 3, 64, seed=new_tokens)
    q = strided_q(3 * new_tokens, 9, 64, seed=new_tokens)
    args = (q, *cache.cache_args(), cache.block_tables, cu_seqlens([new_tokens] * 3), cache.seq_lens, 0.125)
    torch.testing.assert_close(cpu.paged_prefill_attention(*args), ref.paged_prefill_attention(*args), **FP32_TOL)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(phase, block_size):
    case, kernel, oracle = PHASES[phase]
    args, _ = case("auto", 9, 3, 64, block_size=block_size, seed=block_size)
    torch.testing.assert_close(kernel(*args), oracle(*args), **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_16_bit_matches_reference(phase, dtype):
    case, kernel, oracle = PHASES[phase]
    args, _ = case("auto", 9, 3, 64, dtype=dtype, seed=3)
    out = kernel(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), oracle(*args).float(), **BF16_TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_never_reads_past_seq_len(kind):
    """Unwritten slots and the blocks that padding table entries point at hold NaN: the kernels
    must not read them (a masked-out NaN still poisons a softmax or a P·V product)."""
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    lens, q_lens = [5, 40, 67], [5, 9, 1]
    cache = Paged(lens, block_size, kv_heads, head_dim, kind=kind, seed=31)
    clean = {"k": cache.k_cache.clone(), "v": cache.v_cache.clone()}
    clean_scales = {n: None if s is None else s.clone() for n, s in cache.scales().items()}
    rows = cache.k_cache.shape[0] * block_size
    live = torch.zeros(rows, dtype=torch.bool)
    for s, n in enumerate(lens):
        pos = torch.arange(n)
        live[cache.block_tables[s, pos // block_size].long() * block_size + pos % block_size] = True
    if kind == "auto":
        for t in (cache.k_cache, cache.v_cache):
            t.view(rows, -1)[~live] = float("nan")
    elif kind == "int8":
        for t in (cache.k_scale, cache.v_scale):
            t.view(rows, -1)[~live] = float("nan")
    else:
        for t in (cache.k_cache, cache.v_cache):
            t.view(torch.uint8).view(rows, -1)[~live] = 0x7F  # fp8 NaN
    q = strided_q(sum(q_lens), heads, head_dim, seed=32)
    tables, seq_lens = cache.block_tables, cache.seq_lens
    out = cpu.paged_decode_attention(q[: len(lens)], *cache.cache_args(), tables, seq_lens, 0.125, **cache.scales())
    want = ref.paged_decode_attention(q[: len(lens)], clean["k"], clean["v"], tables, seq_lens, 0.125, **clean_scales)
    torch.testing.assert_close(out, want, **FP32_TOL)
    cu = cu_seqlens(q_lens)
    out = cpu.inplace_prefill_attention(q, *cache.cache_args(), tables, cu, seq_lens, 0.125, **cache.scales())
    want = ref.paged_prefill_attention(q, clean["k"], clean["v"], tables, cu, seq_lens, 0.125, **clean_scales)
    torch.testing.assert_close(out, want, **FP32_TOL)


@pytest.mark.parametrize("name", ["paged_decode_attention", "paged_prefill_attention", "inplace_prefill_attention"])
def test_the_cpu_kernels_take_the_reference_arguments_by_name(name):
    """One signature for both backends (the C++ wrappers bind the reference's own): a caller may
    name every argument, in any order, and gets the reference's output."""
    oracle_name = name.replace("inplace_", "paged_")
    case = decode_case if "decode" in name else prefill_case
    args, scales = case("int8", 9, 3, 64, seed=7)
    names = list(inspect.signature(getattr(ref, oracle_name)).parameters)
    assert list(inspect.signature(getattr(cpu, name)).parameters) == names
    by_name = dict(reversed(list(zip(names, args, strict=False)))) | scales
    out = getattr(cpu, name)(**by_name)
    torch.testing.assert_close(out, getattr(ref, oracle_name)(*args, **scales), **FP32_TOL)


def test_an_empty_batch_gives_an_empty_output():
    args, _ = decode_case("auto", 4, 4, 64)
    q, k, v, tables, lens, scale = args
    out = cpu.paged_decode_attention(q[:0], k, v, tables[:0], lens[:0], scale)
    assert out.shape == (0, 4, 64)


def test_every_file_the_kernels_include_is_in_the_build_key():
    """A cached build is reused while its key holds: a header left out of the key would keep running
    the old code after an edit to it (bf16_panel.h once was)."""
    keyed = {path.name for path in cpu.SOURCES + cpu.HEADERS}
    for path in cpu.SOURCES + cpu.HEADERS:
        for included in re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.MULTILINE):
            assert included in keyed, f"{path.name} includes {included}, which the build key does not read"


def test_a_failed_build_falls_back_to_the_reference(tiny_dir, tmp_path):
    """A compiler that fails (a real build failure, in a fresh cache) costs one line on stderr; the
    engine then runs on the reference kernels, says so in its stats, and generates."""
    script = (
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_dir)!r}, dtype='float32', kv_cache_memory='2MiB', attention_backend='cpu', quiet=True)\n"
        "out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))\n"
        "print(llm.stats()['engine']['attention_backend'], len(out[0].token_ids))\n"
    )
    env = {**os.environ, "KVTOP_CACHE": str(tmp_path), "CXX": "/bin/false"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["reference", "4"]
    assert "Traceback" not in proc.stderr
    failures = [line for line in proc.stderr.splitlines() if "could not be built" in line]
    assert len(failures) == 1 and "using the reference kernels" in failures[0]


@pytest.mark.slow  # a second build of the kernels, for AVX2: minutes
@pytest.mark.skipif(platform.machine() != "x86_64" or cpu.ARCH != "native", reason="an x86-64 build for this machine")
def test_the_avx2_build_matches_the_reference_too(tmp_path):
    """Machines differ: an AVX2-only CPU (AMD Zen 3) compiles none of the AVX-512 paths. The same
    comparisons, on a build for x86-64-v3 (AVX2, FMA; no AVX-512), in a fresh cache."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "KVTOP_CACHE": str(tmp_path), "KVTOP_CPU_ARCH": "x86-64-v3"}
    tests = [
        "tests/test_cpu_kernels.py",
        "tests/test_fused_ops.py",
        # the fp32 panel GEMM's AVX2 block (2 rows x 6 vectors), layer by layer and on a whole engine
        "tests/test_packed_linear.py::test_fp32_panel_layer_matches_nn_linear",
        "tests/test_packed_linear.py::test_fp32_engine_gives_the_same_greedy_tokens_with_and_without_the_panel_kernel",
        # no gate/up epilogue without AVX-512: gate/up stays a plain panel layer, the op refuses
        "tests/test_gate_up_silu.py::test_placement",
        # no AVX512-BF16 in this build: the bf16 panel op refuses, bf16 layers go to oneDNN's
        "tests/test_bf16_panels.py",
        # nor the bf16 prefill attention on bf16 pairs: the op refuses, the backend's other routes serve
        "tests/test_bf16_attention.py::test_placement",
        # nor AMX nor the bf16 panels: the quantized layers' bf16 rows stay on the fp32 kernels, both ops refuse
        "tests/test_quant_amx.py::test_without_amx_the_op_refuses_in_one_line_and_bf16_rows_take_another_kernel",
        "tests/test_quant_bf16_panels.py::test_without_avx512_bf16_the_op_refuses_in_one_line",
        # the packed GGUF blocks' 8-lane kernels (csrc/quant_packed_avx2.h); no gate/up tile pairs
        *(
            f"tests/test_quant_packed.py::test_{name}"
            for name in (
                "packing_keeps_the_bytes_and_unpacks_to_the_files_blocks_bit_for_bit",
                "decode_rows_on_the_tiles_compute_the_blocks_values_up_to_summation_order",
                "one_hot_decode_rows_read_each_columns_values_back",
                "more_rows_get_what_the_files_layout_gives_bit_for_bit",
                "the_layers_and_a_q8_0_head_are_packed_and_the_tied_embedding_reads_the_same_rows",
                "fused_decode_runs_the_packed_layers_bit_for_bit_as_the_python_loop",
                "without_avx512_a_gate_up_stays_a_packed_layer_and_the_pair_op_refuses",
            )
        ),
    ]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *tests,
        "-k",
        "not avx2_build and not failed_build",
    ]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-500:]
    built = list(tmp_path.glob("kernels/cpu-attention-*/kvtop_cpu_attention.so"))
    assert len(built) == 1
    # the fp32 tests above ran on the panels, not on a quiet fallback to nn.Linear; bf16 has none here
    says = "import torch; from engine.model.panel_linear import kernel_available as k; print(k(), k(torch.bfloat16))"
    check = subprocess.run([sys.executable, "-c", says], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert check.stdout.split() == ["True", "False"], check.stderr[-2000:]
    # that build really has no AVX-512 code: no zmm register in the library
    if shutil.which("objdump"):
        dump = subprocess.run(["objdump", "-d", str(built[0])], capture_output=True, text=True, check=True)
        assert "zmm" not in dump.stdout


def test_a_table_that_does_not_cover_the_context_is_an_error_not_a_crash():
    args, _ = decode_case("auto", 4, 4, 64)
    q, k, v, tables, lens, scale = args
    with pytest.raises(RuntimeError, match="block table"):
        cpu.paged_decode_attention(q, k, v, tables[:, :2], lens, scale)  # 333 tokens need 21 blocks
    bad = tables.clone()
    bad[3, 0] = k.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        cpu.paged_decode_attention(q, k, v, bad, lens, scale)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16", "int8", "fp8"])
def test_store_kv_writes_what_the_reference_writes(kind):
    """The C++ copy per token (caches of k's dtype) and the reference's quantizing store (int8, fp8):
    the same bytes in every slot, -1 slots skipped, k and v taken as the qkv split's strided views."""
    torch.manual_seed(5)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(kind, torch.float32)
    cache_dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(kind, dtype)
    tokens, kv_heads, head_dim, num_blocks, block_size = 37, 3, 64, 8, 16
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim).to(dtype)
    q_size, kv_size = 9 * head_dim, kv_heads * head_dim
    _, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[[0, 5, 36]] = -1  # padding
    scales = (
        (torch.ones(num_blocks, block_size, kv_heads), torch.ones(num_blocks, block_size, kv_heads))
        if kind == "int8"
        else (torch.tensor(0.05), torch.tensor(0.07))
        if kind == "fp8"
        else (None, None)
    )
    caches = {}
    for name, backend in (("cpu", cpu), ("ref", ref)):
        kc = torch.zeros(num_blocks, block_size, kv_heads, head_dim).to(cache_dtype)
        vc = torch.zeros_like(kc)
        sc = tuple(s.clone() if s is not None and s.dim() else s for s in scales)
        backend.store_kv(k, v, kc, vc, slots, *sc)
        caches[name] = (kc, vc, sc)
    for got, want in zip(caches["cpu"][:2], caches["ref"][:2], strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert int(caches["cpu"][0].view(torch.uint8).count_nonzero()) > 0  # something was written
    if kind == "int8":
        assert all(torch.equal(a, b) for a, b in zip(caches["cpu"][2], caches["ref"][2], strict=True))


def test_store_kv_refuses_a_slot_outside_the_cache():
    k = torch.randn(2, 3, 64)
    kc = torch.zeros(4, 16, 3, 64)
    with pytest.raises(RuntimeError, match="not a slot of the cache"):
        cpu.store_kv(k, k, kc, kc.clone(), torch.tensor([3, 64]))
