"""Log-probs in the two OpenAI shapes, for the tokens that make up the returned text.

The engine gives each output token's log-prob with the step's k most likely tokens
(`sampling.Logprob`); `TokenCursor` (detokenize.py) says which tokens, and which piece of text
each one, belong to the text a client receives.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.outputs import RequestOutput

FLOOR = -9999.0


def completion_logprobs(
    out: RequestOutput, items: list[tuple[int, str, int]], k: int, offset0: int, token_text: Callable[[int], str]
) -> dict:
    """`{tokens, token_logprobs, top_logprobs, text_offset}`; offsets count from the choice's text start."""
    lps = out.logprobs or []
    return {
        "tokens": [text for _, text, _ in items],
        "token_logprobs": [_finite(lps[j]) for j, _, _ in items],
        "top_logprobs": [{token_text(t): _finite(v) for t, v in _top(lps[j])} for j, _, _ in items] if k > 0 else None,
        "text_offset": [offset0 + a for _, _, a in items],
    }


def chat_logprobs(out: RequestOutput, items: list[tuple[int, str, int]], token_text: Callable[[int], str]) -> dict:
    """`{content: [{token, logprob, bytes, top_logprobs: [...]}], refusal: null}`."""
    lps = out.logprobs or []
    content = []
    for j, text, _ in items:
        top = [_entry(token_text(t), v) for t, v in _top(lps[j])]
        content.append({**_entry(text, lps[j]), "top_logprobs": top})
    return {"content": content, "refusal": None}


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8", "surrogatepass"))}


def _finite(v: float) -> float:
    """-inf (a token the model rules out) is not JSON: vLLM's floor instead."""
    return max(float(v), FLOOR)


def _top(lp) -> tuple[tuple[int, float], ...]:
    return getattr(lp, "top", ())
