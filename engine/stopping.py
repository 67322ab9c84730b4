"""When a sequence stops, checked after each new token, in this order: an EOS or stop token id
(unless `ignore_eos`), a stop string in the decoded output (the text is cut where it starts),
`max_tokens`, then the context (`max_model_len`, or the whole KV cache)."""

from __future__ import annotations

from collections.abc import Callable

from engine.sequence import Sequence


def stop_reason(
    seq: Sequence,
    token: int,
    eos_token_ids: set[int],
    max_seq_len: int,
    max_model_len: int,
    decode: Callable[[list[int]], str],
) -> tuple[str, str] | None:
    """(finish_reason, detail) when `token` ends `seq`, else None. Sets `seq.stop_text_len` on a
    stop string."""
    p = seq.params
    if not p.ignore_eos and (token in eos_token_ids or token in p.stop_token_ids):
        return "stop", "eos"
    if p.stop and _hit_stop_string(seq, decode):
        return "stop", "stop string"
    if seq.num_output_tokens >= p.max_tokens:
        return "length", "max_tokens"
    if seq.num_tokens >= max_seq_len:
        return "length", "max_model_len" if seq.num_tokens >= max_model_len else "KV cache full"
    return None


def _hit_stop_string(seq: Sequence, decode: Callable[[list[int]], str]) -> bool:
    text = decode(seq.output_token_ids)
    cut = min((i for i in (text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
    if cut < 0:
        return False
    seq.stop_text_len = cut
    return True
