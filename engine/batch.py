"""Offline batch generation (`kvctl run`, kvtop/ctl/run_cmd.py): a JSONL of prompts in, a JSONL of
completions out.

Each input line is an object with one of `prompt` (text), `messages` (chat, rendered with the
model's chat template) or `prompt_token_ids`, and optionally its own sampling fields
(`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`, `ignore_eos`) and an `id`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from pathlib import Path

from engine import InvalidRequestError, LLMEngine, SamplingParams
from engine.llm import run_to_completion
from engine.outputs import RequestOutput

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


@dataclass
class PromptSpec:
    id: str
    prompt: str | list[int]
    params: SamplingParams


def read_prompts(path: Path, engine: LLMEngine, defaults: dict) -> list[PromptSpec]:
    """Parse and validate every line before any work starts, so a bad line costs nothing."""
    specs = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {path}: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise InvalidRequestError(f"{path}:{n}: each line must be a JSON object")
        if "messages" in obj:
            prompt = engine.tokenizer.apply_chat_template(obj["messages"], tokenize=False, add_generation_prompt=True)
        elif "prompt" in obj:
            prompt = obj["prompt"]
        elif "prompt_token_ids" in obj:
            prompt = obj["prompt_token_ids"]
        else:
            raise InvalidRequestError(f"{path}:{n}: needs one of 'prompt', 'messages' or 'prompt_token_ids'")
        sampling = {**defaults, **{k: v for k, v in obj.items() if k in SAMPLING_FIELDS}}
        try:
            params = SamplingParams(**sampling)
        except (InvalidRequestError, TypeError) as exc:
            raise InvalidRequestError(f"{path}:{n}: {exc}") from None
        specs.append(PromptSpec(str(obj.get("id", n)), prompt, params))
    if not specs:
        raise InvalidRequestError(f"{path} holds no prompts")
    return specs


def run_batch(engine: LLMEngine, specs: list[PromptSpec], on_progress=None) -> tuple[list[RequestOutput], dict]:
    """Generate for every spec; returns outputs in input order and a summary of the run."""
    t0 = time.time()
    ids = []
    for spec in specs:
        try:
            ids.append(engine.add_request(spec.prompt, spec.params, request_id=f"{spec.id}"))
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"prompt {spec.id}: {exc}") from None

    def progress(out: RequestOutput) -> None:
        if on_progress:
            on_progress(len(out.new_token_ids), int(out.finished))

    outputs = run_to_completion(engine, ids, progress)  # the loop of LLM.generate
    return outputs, summarize(engine, outputs, time.time() - t0)


def summarize(engine: LLMEngine, outputs: list[RequestOutput], elapsed: float) -> dict:
    frame = engine.stats()
    gen = sum(len(o.token_ids) for o in outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    lat = frame["latency"]
    return {
        "requests": len(outputs),
        "prompt_tokens": prompt,
        "generated_tokens": gen,
        "elapsed_s": elapsed,
        "generation_tokens_per_s": gen / elapsed if elapsed else 0.0,
        "total_tokens_per_s": (gen + prompt) / elapsed if elapsed else 0.0,
        "ttft_s": {k: lat["ttft"][k] for k in ("p50", "p95", "p99")},
        "itl_s": {k: lat["itl"][k] for k in ("p50", "p95", "p99")},
        "preemptions": frame["scheduler"]["preemptions_total"],
        "peak_kv_usage": frame["kv"]["peak_usage"],
        "prefix_hit_rate": frame["prefix"]["hit_rate"],
        "finish_reasons": _count(o.finish_reason for o in outputs),
    }


def _count(items) -> dict:
    out: dict = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def output_record(spec: PromptSpec, out: RequestOutput) -> dict:
    m = out.metrics
    return {
        "id": spec.id,
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "cached_tokens": out.cached_tokens,
        "ttft_s": m.ttft if m else None,
        "e2e_s": m.e2e if m else None,
    }
