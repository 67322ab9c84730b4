"""Our Llama-family decoder forward over the paged KV cache.

One forward runs every scheduled sequence of a step as one packed batch of tokens (no padding):
`input_ids`/`positions` are `[num_tokens]`; attention reads and writes the paged cache through the
kernels in `engine.kernels` (`attention.paged_attention` picks decode or prefill), and the norms,
RoPE and SiLU-and-mul are that backend's element-wise ops too (fused C++ on the CPU, fused Triton
kernels with the Triton backend, the reference's torch ops with the reference's). Covers Llama
(incl. llama3 RoPE scaling), Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm) and SmolLM. Projections are fused at load time (qkv, gate+up) so a
layer is four matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.attention import AttentionBatch, Backend, paged_attention
from engine.kv.cache import KVLayer
from engine.model.fused_decode import fused_decode_for
from engine.model.spec import ModelSpec


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
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        kv: KVLayer,
        kernels: Backend,
        out_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` is the previous layer's MLP output, added here into the residual stream (or, for
        the first layer, with `residual` None, the embeddings, which become it); returns this
        layer's MLP output and the stream. So each residual add is one pass with the norm after it.
        `out_rows` (the last layer only): the rows whose output is wanted; every row's K and V are
        stored, and the others' o_proj and MLP are skipped.
        engine/kernels/csrc/decode_layers.cpp runs these same ops for decode-only steps on the `cpu`
        backend: a change here goes there too (tests/test_decode_layers.py compares them bit for bit)."""
        spec = self.spec
        n, eps = x.shape[0], spec.rms_norm_eps
        if residual is None:
            residual, h = x, kernels.rms_norm(x, self.input_layernorm, eps)
        else:
            h = kernels.fused_add_rms_norm(x, residual, self.input_layernorm, eps)
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.kv_size
        q, k, v = self.qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(n, spec.num_heads, spec.head_dim)
        k = k.view(n, spec.num_kv_heads, spec.head_dim)
        v = v.view(n, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm:
            q = kernels.rms_norm(q, self.q_norm, eps)
            k = kernels.rms_norm(k, self.k_norm, eps)
        q, k = kernels.rotary_embedding(q, k, cos, sin)
        attn = paged_attention(q, k, v, kv, batch, self.scale, kernels)
        if out_rows is not None:
            attn, residual, n = attn[out_rows], residual[out_rows], out_rows.numel()
            if n == 0:
                return attn.new_empty(0, spec.hidden_size), residual
        h = kernels.fused_add_rms_norm(
            self.o_proj(attn.reshape(n, q_size)), residual, self.post_attention_layernorm, eps
        )
        # a gate/up layer with SiLU-and-mul in its epilogue (AMXGateUp, PanelGateUp) offers it as a method
        fused = getattr(self.gate_up_proj, "silu_and_mul", None)
        act = fused(h, kernels) if fused else kernels.silu_and_mul(self.gate_up_proj(h))
        return self.down_proj(act), residual


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = nn.Parameter(torch.ones(spec.hidden_size))
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None  # a prepacked copy of the head on CPU (engine.model.packed_linear)
        self.cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fused_kernels, self.fused = None, None  # engine.model.fused_decode, built at the first step

    def build_rope_cache(self, max_positions: int) -> None:
        """cos/sin for every position, computed in float32 exactly as transformers does."""
        device, dtype = self.norm.device, self.norm.dtype  # the embedding may be packed by now
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
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states of every token, or of `out_rows` only (the rows that sample): the
        other rows skip the last layer's o_proj and MLP (on SmolLM2's 30 layers, 2.8 % of a prompt's
        linear work; 2,048-token prefill steps 3 % faster, bit-identical logits)."""
        x, residual = self.embed_tokens(input_ids), None
        cos_all, sin_all = self.cos_sin
        cos, sin = cos_all[positions], sin_all[positions]
        if self.fused_kernels is not kernels:  # gathered once per backend, after any packing
            self.fused_kernels, self.fused = kernels, fused_decode_for(self, kernels)
        if self.fused is not None and self.fused.covers(x, batch, kv_layers):
            x, residual = self.fused(x, cos, sin, batch, kv_layers)
            if out_rows is not None:  # a prompt's one-token chunk mid-prompt rode with the decodes
                x, residual = x[out_rows], residual[out_rows]
        else:
            last = len(self.layers) - 1
            for i, (layer, kv) in enumerate(zip(self.layers, kv_layers, strict=True)):
                x, residual = layer(x, residual, cos, sin, batch, kv, kernels, out_rows if i == last else None)
        if x.shape[0] == 0:
            return x
        return kernels.fused_add_rms_norm(x, residual, self.norm, self.spec.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_head is not None:
            return self.logits_head(hidden)
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
