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
