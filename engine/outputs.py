"""RequestOutput: what the engine hands back for a request, after each step and at the end, and
`request_output`, which makes one from a sequence (a finished one's text detokenised here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sequence import RequestMetrics, Sequence


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


def request_output(seq: Sequence, new_tokens: list[int], decode: Callable[[list[int]], str]) -> RequestOutput:
    """`seq` as it stands, `new_tokens` what this step gave it; once finished, its text (`decode`
    of its output, cut where a stop string began)."""
    text = None
    if seq.is_finished:
        text = decode(seq.output_token_ids)
        if seq.stop_text_len is not None:
            text = text[: seq.stop_text_len]
    return RequestOutput(
        request_id=seq.seq_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=seq.output_token_ids,
        new_token_ids=new_tokens,
        text=text,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        finish_detail=seq.finish_detail,
        cached_tokens=seq.num_cached_tokens,
        logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
        metrics=seq.metrics,
    )
