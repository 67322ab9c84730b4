"""Test helpers that are not fixtures: transformers as the oracle, prompt makers."""

from __future__ import annotations

import http.server
import random

import torch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """transformers `generate` for one prompt, greedy, cut after the first EOS like our engine."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos if eos is not None else 0,
        )
    tokens = out[0, len(prompt_ids) :].tolist()
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return tokens


def random_prompts(n: int, lengths: tuple[int, int], vocab: int = 49152, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


# Causal prefill attention cases, (sequences, new tokens, keys): one token, a partial block, whole
# prompts of several blocks and of two 256-query tasks (300), a chunk over a cached prefix (the first
# keys), one token over a prefix
CAUSAL_SHAPES = [
    (1, 1, 1),
    (2, 5, 5),
    (1, 17, 17),
    (3, 100, 100),
    (2, 256, 256),
    (1, 300, 300),
    (2, 12, 200),
    (1, 1, 77),
]


def causal_inputs(seqs, n, length, heads, kv_heads, head_dim, seed=0, dtype=torch.float32):
    """Random q [S, N, Hq, D], k and v [S, L, Hkv, D] for the causal prefill kernels."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seqs, n, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(seqs, length, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(seqs, length, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v


def causal_oracle(q, k, v, scale: float, compute: torch.dtype = torch.float32) -> torch.Tensor:
    """Query i of a sequence (the last N of its L tokens) sees keys 0 .. L - N + i: SDPA in `compute`,
    returned in fp32."""
    n, length = q.shape[1], k.shape[1]
    positions = torch.arange(length)
    mask = positions.unsqueeze(0) <= positions[length - n :].unsqueeze(1)
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).to(compute) for t in (q, k, v)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2).float()


def widget_text(widget) -> str:
    """The plain text a Textual Static-like widget shows."""
    content = widget.content
    return content.plain if hasattr(content, "plain") else str(content)


class PageHandler(http.server.BaseHTTPRequestHandler):
    """A loopback HTTP server's handler that answers recorded pages: `reply`, and no request log."""

    def reply(self, status: int, body: bytes, content_type: str | None = None) -> None:
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


async def until(pilot, condition, what: str, timeout: float = 30.0) -> None:
    """Wait in a Pilot test until `condition()` holds, polling every 0.1 s; fail naming `what`."""
    for _ in range(int(timeout * 10)):
        if condition():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
