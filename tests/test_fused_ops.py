"""The C++ element-wise ops (`engine/kernels/csrc/fused_ops.cpp`) against the reference's torch ops.

Tolerances proved here: RoPE and the residual add bit for bit in both dtypes. float32 RMSNorm and
SiLU-and-mul within 2e-6 relative (the C++ sums the squares in another order than torch, and its
exp is not torch's). bfloat16: bit-equal on at least 99.9 % of the elements, and everywhere within
one bf16 ulp for SiLU-and-mul, two for RMSNorm (its normalized value, rounded to bf16 before the
weight multiplies it, can be one ulp off; the product's rounding can make that two). Then the
whole engine on the C++ backend gives the reference's greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu, reference
from engine.model.llama import CausalLM
from engine.model.spec import ModelSpec
from tests.helpers import random_prompts

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu.load(), "the C++ CPU kernels did not build here"


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise distance in bf16 units in the last place (bits laid on one monotonic line)."""

    def line(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (line(a) - line(b)).abs()


def assert_matches(out: torch.Tensor, ref: torch.Tensor, bf16_ulps_max: int = 1) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
        return
    ulps = bf16_ulps(out, ref)
    assert int(ulps.max()) <= bf16_ulps_max, f"{int((ulps > bf16_ulps_max).sum())} elements too far off"
    assert float((ulps == 0).float().mean()) >= 0.999


def rope_cache(head_dim: int, dtype: torch.dtype, max_positions: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own cos/sin tables (`CausalLM.build_rope_cache`) for a head size."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    spec = ModelSpec(
        model_type="llama", vocab_size=16, hidden_size=64, intermediate_size=128, num_layers=0, num_heads=1,
        num_kv_heads=1, head_dim=head_dim, max_position_embeddings=max_positions, tie_word_embeddings=True,
        qkv_bias=False, qk_norm=False, rms_norm_eps=EPS, inv_freq=inv_freq, rope_scaling=1.0,
    )  # fmt: skip
    model = CausalLM(spec).to(dtype)
    model.build_rope_cache(max_positions)
    return model.cos_sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2048])
def test_rms_norm_matches_reference(dtype, tokens):
    torch.manual_seed(tokens)
    x = (3 * torch.randn(tokens, 576)).to(dtype)  # SmolLM2's hidden size
    weight = (1 + 0.2 * torch.randn(576)).to(dtype)
    assert_matches(cpu.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS), bf16_ulps_max=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rms_norm_per_head_on_a_strided_view(dtype, head_dim):
    """Qwen3's q/k norm: `[tokens, heads, dim]` views of the qkv projection, rows not contiguous."""
    torch.manual_seed(head_dim)
    qkv = torch.randn(37, (4 + 2 * 2) * head_dim).to(dtype)
    q = qkv[:, : 4 * head_dim].view(37, 4, head_dim)
    weight = (1 + 0.2 * torch.randn(head_dim)).to(dtype)
    assert not q.is_contiguous()
    assert_matches(cpu.rms_norm(q, weight, EPS), reference.rms_norm(q, weight, EPS), bf16_ulps_max=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2048])
def test_fused_add_rms_norm_updates_the_residual_in_place(dtype, tokens):
    torch.manual_seed(tokens + 1)
    x = torch.randn(tokens, 576).to(dtype)
    residual = (4 * torch.randn(tokens, 576)).to(dtype)
    weight = (1 + 0.2 * torch.randn(576)).to(dtype)
    expected_residual = residual.clone()
    expected = reference.fused_add_rms_norm(x, expected_residual, weight, EPS)
    before = residual.clone()
    out = cpu.fused_add_rms_norm(x, residual, weight, EPS)
    # the residual stream now holds residual + x, rounded as torch's own add rounds it
    assert torch.equal(residual, before + x)
    assert torch.equal(residual, expected_residual)
    assert out.data_ptr() != residual.data_ptr()
    assert_matches(out, expected, bf16_ulps_max=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (2048, 9, 3, 64), (5, 4, 1, 128), (300, 8, 8, 128)]
)
def test_rotary_embedding_equals_reference_bit_for_bit(dtype, tokens, heads, kv_heads, head_dim):
    """In place on the q and k views `qkv.split` makes; v beside them untouched."""
    torch.manual_seed(tokens)
    cos_all, sin_all = rope_cache(head_dim, dtype)
    positions = torch.randint(0, cos_all.shape[0], (tokens,))
    cos, sin = cos_all[positions], sin_all[positions]
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size).to(dtype)
    v_before = qkv[:, q_size + kv_size :].clone()
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    ref_q, ref_k = reference.rotary_embedding(q.clone(), k.clone(), cos, sin)
    out_q, out_k = cpu.rotary_embedding(q, k, cos, sin)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert out_q.data_ptr() == qkv.data_ptr()  # rotated where it lies
    assert torch.equal(qkv[:, :q_size], ref_q.reshape(tokens, q_size))
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,intermediate", [(1, 1536), (2048, 1536), (3, 64)])
def test_silu_and_mul_matches_reference(dtype, tokens, intermediate):
    torch.manual_seed(intermediate + tokens)
    gate_up = (3 * torch.randn(tokens, 2 * intermediate)).to(dtype)
    # the tails of exp: overflow (exp(100) is inf, silu -0), near overflow, underflow
    gate_up[0, :6] = torch.tensor([-100.0, -88.5, -87.0, 0.0, 87.0, 100.0])
    assert_matches(cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_keeps_denormals_and_nans(dtype):
    """A vector of 16 with a denormal or a NaN in it takes the exact rounding path (the fast bf16
    conversion would flush the one to zero and keep the other's payload)."""
    torch.manual_seed(7)
    inter = 64
    gate_up = torch.randn(4, 2 * inter).to(dtype)
    gate_up[0, :16] = 2e-39  # silu(x) ~ x / 2: a denormal in fp32 and in bf16
    gate_up[0, inter : inter + 16] = 1.0
    gate_up[1, 3] = float("nan")  # in the gate
    gate_up[2, inter + 5] = float("nan")  # in the up half
    out, ref = cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)
    assert torch.equal(out.isnan(), ref.isnan()) and int(ref.isnan().sum()) == 2
    assert (out[0, :16] != 0).all() and (out[0, :16] > 0).all()  # not flushed
    assert_matches(out.nan_to_num(), ref.nan_to_num())


def test_float16_takes_the_reference_ops():
    x = torch.randn(8, 64, dtype=torch.float16)
    weight = torch.rand(64, dtype=torch.float16)
    assert torch.equal(cpu.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))
    assert torch.equal(cpu.silu_and_mul(x), reference.silu_and_mul(x))


def test_a_mismatched_weight_is_an_error_not_a_crash():
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="weight"):
        cpu.rms_norm(x, torch.ones(32), EPS)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), EPS)


def _greedy(path: str, backend: str, dtype: str) -> list[list[int]]:
    llm = LLM(
        path, dtype=dtype, attention_backend=backend, kv_cache_memory="2MiB", max_num_batched_tokens=32, quiet=True
    )
    assert llm.stats()["engine"]["attention_backend"] == backend
    prompts = random_prompts(4, (3, 50), seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("family", ["qwen3", "llama3-rope", "mistral"])
def test_engine_on_the_fused_ops_gives_the_reference_tokens(tiny_models, family):
    """fp32, chunked prompts beside decodes; qwen3 also runs its per-head q/k norm through the op."""
    path = str(tiny_models[family])
    assert _greedy(path, "cpu", "float32") == _greedy(path, "reference", "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 15, 1024, 1025, 3000, 49152])  # one block, its edges, SmolLM2's vocabulary
def test_argmax_rows_is_torch_max_indices(dtype, width):
    """Greedy sampling's argmax (`engine.sampling._argmax` on the CPU): the first maximal index per
    row, the first NaN where a row holds one, index 0 for a row of -inf, as `x.max(dim=-1).indices`."""
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(12, width + 3, generator=g) * 3).to(dtype)[:, 3:]  # rows not starting at a row stride of width
    x[1, : (width + 1) // 2] = 100.0  # ties over half the row: the first wins
    x[2, width - 1] = float("nan")
    x[3] = float("-inf")
    x[4, width // 3 :] = float("nan")
    x[5] = 0.0
    x[6, -1] = 1e30  # the maximum in the last element
    x[7, 0] = float("inf")
    got = torch.ops.kvtop_cpu.argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, x.max(dim=-1).indices)
