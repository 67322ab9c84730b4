"""Our Llama-family decoder forward over the paged KV cache.

One forward runs every scheduled sequence of a step as one packed batch of tokens (no padding):
`input_ids`/`positions` are `[num_tokens]`; attention reads and writes the paged cache through the
kernels in `engine.kernels` (`attention.paged_attention` picks decode or prefill). Covers Llama
(incl. llama3 RoPE scaling), Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm) and SmolLM. Projections are fused at load time (qkv, gate+up) so a
layer is four matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.attention import AttentionBatch, Backend, paged_attention
from engine.kv.cache import KVLayer
from engine.model.spec import ModelSpec


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
        kernels: Backend,
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
        attn = paged_attention(q, k, v, kv, batch, self.scale, kernels)
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
        kernels: Backend,
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
