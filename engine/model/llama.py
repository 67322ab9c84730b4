"""Our Llama-family decoder forward over the paged KV cache.

One forward runs every scheduled sequence of a step as one packed batch of tokens (no padding):
`input_ids`/`positions` are `[num_tokens]`; attention reads and writes the paged cache through the
kernels in `engine.kernels`. Covers Llama (incl. llama3 RoPE scaling), Mistral, Qwen2 (qkv bias),
Qwen3 (per-head q/k RMSNorm) and SmolLM. Projections are fused at load time (qkv, gate+up) so a
layer is four matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelSpec:
    """What the engine needs to know about a model's shape, read from its HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    inv_freq: torch.Tensor
    rope_scaling: float

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class AttentionBatch:
    """Per-step attention inputs, built once by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decodes: int  # the first num_decodes tokens are one-token decodes, one per sequence
    decode_tables: torch.Tensor | None  # int32 [num_decodes, max_blocks]
    decode_lens: torch.Tensor  # int32 [num_decodes]: tokens in cache after this step
    prefill_tables: torch.Tensor | None  # int32 [num_prefills, max_blocks]
    prefill_lens: torch.Tensor  # int32 [num_prefills]
    prefill_cu_seqlens_q: torch.Tensor  # int32 [num_prefills + 1], over the tokens after the decodes


class KVLayer:
    """One layer's view into the KV allocation (and its scales when quantized)."""

    __slots__ = ("calibrating", "k", "k_scale", "v", "v_scale")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, k_scale=None, v_scale=None) -> None:
        self.k, self.v, self.k_scale, self.v_scale = k, v, k_scale, v_scale
        self.calibrating = False  # fp8: set the per-tensor scales from the K/V this forward sees

    def calibrate(self, k: torch.Tensor, v: torch.Tensor, fp8_max: float = 448.0, headroom: float = 2.0) -> None:
        self.k_scale.fill_(max(float(k.abs().max()) * headroom / fp8_max, 1e-8))
        self.v_scale.fill_(max(float(v.abs().max()) * headroom / fp8_max, 1e-8))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # same order of operations as transformers' LlamaRMSNorm, so bf16 rounds the same way
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.kv_size
        self.qkv_proj = nn.Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(spec.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(spec.hidden_size))
        if spec.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(spec.head_dim))
            self.k_norm = nn.Parameter(torch.ones(spec.head_dim))
        self.scale = spec.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        kv: KVLayer,
        kernels: ModuleType,
    ) -> torch.Tensor:
        spec = self.spec
        n = x.shape[0]
        h = rms_norm(x, self.input_layernorm, spec.rms_norm_eps)
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.kv_size
        q, k, v = self.qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(n, spec.num_heads, spec.head_dim)
        k = k.view(n, spec.num_kv_heads, spec.head_dim)
        v = v.view(n, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm:
            q = rms_norm(q, self.q_norm, spec.rms_norm_eps)
            k = rms_norm(k, self.k_norm, spec.rms_norm_eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if kv.calibrating:
            kv.calibrate(k, v)
        kernels.store_kv(k, v, kv.k, kv.v, batch.slot_mapping, kv.k_scale, kv.v_scale)
        nd = batch.num_decodes
        parts = []
        if nd:
            parts.append(
                kernels.paged_decode_attention(
                    q[:nd], kv.k, kv.v, batch.decode_tables, batch.decode_lens, self.scale, kv.k_scale, kv.v_scale
                )
            )
        if batch.prefill_tables is not None:
            parts.append(
                kernels.paged_prefill_attention(
                    q[nd:],
                    kv.k,
                    kv.v,
                    batch.prefill_tables,
                    batch.prefill_cu_seqlens_q,
                    batch.prefill_lens,
                    self.scale,
                    kv.k_scale,
                    kv.v_scale,
                )
            )
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        x = x + self.o_proj(attn.reshape(n, q_size))
        h = rms_norm(x, self.post_attention_layernorm, spec.rms_norm_eps)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = nn.Parameter(torch.ones(spec.hidden_size))
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def build_rope_cache(self, max_positions: int) -> None:
        """cos/sin for every position, computed in float32 exactly as transformers does."""
        device = self.embed_tokens.weight.device
        dtype = self.embed_tokens.weight.dtype
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = pos[:, None] * self.spec.inv_freq.to(device=device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.spec.rope_scaling).to(dtype)
        sin = (emb.sin() * self.spec.rope_scaling).to(dtype)
        self.cos_sin = (cos, sin)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_layers: list[KVLayer],
        kernels: ModuleType,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_all, sin_all = self.cos_sin
        cos = cos_all[positions].unsqueeze(1)
        sin = sin_all[positions].unsqueeze(1)
        for layer, kv in zip(self.layers, kv_layers, strict=True):
            x = layer(x, cos, sin, batch, kv, kernels)
        return rms_norm(x, self.norm, self.spec.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy transformers-named weights in, fusing q/k/v and gate/up."""
        get = tensors.pop
        dtype = self.embed_tokens.weight.dtype
        # safetensors' save_model keeps only one name of tied weights, sometimes lm_head's
        embed = tensors.pop("model.embed_tokens.weight", None)
        self.embed_tokens.weight.copy_(embed if embed is not None else tensors["lm_head.weight"])
        self.norm.copy_(get("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(get("lm_head.weight"))
        tensors.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            layer.qkv_proj.weight.copy_(
                torch.cat([get(attn + "q_proj.weight"), get(attn + "k_proj.weight"), get(attn + "v_proj.weight")])
            )
            if self.spec.qkv_bias:
                layer.qkv_proj.bias.copy_(
                    torch.cat([get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias")])
                )
            layer.o_proj.weight.copy_(get(attn + "o_proj.weight"))
            layer.gate_up_proj.weight.copy_(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
            layer.down_proj.weight.copy_(get(p + "mlp.down_proj.weight"))
            layer.input_layernorm.copy_(get(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.copy_(get(p + "post_attention_layernorm.weight"))
            if self.spec.qk_norm:
                layer.q_norm.copy_(get(attn + "q_norm.weight"))
                layer.k_norm.copy_(get(attn + "k_norm.weight"))
        leftovers = [k for k in tensors if not k.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise ValueError(f"unexpected weights in checkpoint: {leftovers[:5]}")
        self.to(dtype)
