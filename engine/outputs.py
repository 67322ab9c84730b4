"""RequestOutput: what the engine hands back for a request, after each step and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import RequestMetrics


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    new_token_ids: list[int] = field(default_factory=list)  # produced by the step that made this output
    text: str | None = None  # filled when finished (and by streaming detokenizers)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    finish_detail: str | None = None
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    metrics: RequestMetrics | None = None
