"""SamplingParams (what a request asks for) and the batched sampler that honours it.

Greedy rows take an argmax. Random rows draw with the exponential-race trick
(argmax of p / Exp(1)), where each seeded request owns a torch.Generator so its tokens do not
depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # return the chosen token's log-prob (and this many top ones)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (off) or a positive integer, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(f"logprobs must be between 0 and 20, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[float] | None]:
    """Pick one token per row of `logits` [n, vocab]; returns tokens and (if any row asks) log-probs."""
    logits = logits.float()
    n = logits.shape[0]
    want_logprobs = any(p.logprobs is not None for p in params)
    logprobs_full = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    tokens = torch.empty(n, dtype=torch.long)
    if greedy_rows:
        idx = torch.tensor(greedy_rows)
        tokens[idx] = logits[idx].argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = torch.tensor(random_rows)
        sub = logits[idx]
        temps = torch.tensor([params[i].temperature for i in random_rows]).unsqueeze(1)
        sub = sub / temps
        sub = _apply_top_k_top_p(sub, [params[i].top_k for i in random_rows], [params[i].top_p for i in random_rows])
        probs = torch.softmax(sub, dim=-1)
        noise = torch.empty_like(probs)
        # seeded requests draw from their own generator (reproducible whatever the batch); the
        # rest share the engine's, in one call
        shared = [row for row, i in enumerate(random_rows) if params[i].seed is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1]).exponential_(
                generator=generators[random_rows[shared[0]]]
            )
        for row, i in enumerate(random_rows):
            if params[i].seed is not None:
                noise[row].exponential_(generator=generators[i])
        tokens[idx] = (probs / noise).argmax(dim=-1)
    token_list = tokens.tolist()
    lp = None
    if logprobs_full is not None:
        lp = logprobs_full.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    return token_list, lp


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_k]).clamp(max=vocab).unsqueeze(1)
    positions = torch.arange(vocab).unsqueeze(0)
    mask = positions >= ks
    probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    cum = probs.cumsum(dim=-1)
    ps = torch.tensor(top_p).unsqueeze(1)
    # keep a token when the mass before it is below top_p (the first token is always kept)
    mask |= (cum - probs) >= ps
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
