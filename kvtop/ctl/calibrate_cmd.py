"""`kvctl calibrate`: a short synthetic run of the real engine on this machine and model, its steps
fitted into the step-time model `kvctl whatif --calibration FILE` takes (docs/whatif.md) — for a
recording with too few steps of its own to fit."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Annotated

import typer

from kvtop.ctl.engine_gate import load_engine
from kvtop.ctl.options import with_engine_options


@with_engine_options
def calibrate_command(
    config,
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the model (JSON).")] = Path(
        "step-times.json"
    ),
    requests: Annotated[int, typer.Option(help="Requests in the run (in 3 waves).")] = 48,
    max_prompt: Annotated[int, typer.Option(help="Longest prompt, tokens.")] = 512,
    max_output: Annotated[int, typer.Option(help="Longest output, tokens.")] = 64,
    prompt_seed: Annotated[int, typer.Option(help="Seed of the synthetic prompts.")] = 0,
) -> None:
    """Run waves of synthetic requests (mixed prompt and output lengths) through the real engine and
    fit its steps: t = a + b·prefill tokens + c·decodes + d·context tokens."""
    llm_engine, sampling = load_engine("engine.llm_engine", "calibrate"), load_engine("engine.sampling", "calibrate")
    llm, timing = load_engine("engine.llm", "calibrate"), load_engine("engine.whatif.timing", "calibrate")
    if requests < 3 or max_prompt < 2 or max_output < 1:
        raise typer.BadParameter("need at least 3 requests, prompts of 2 tokens and outputs of 1")
    engine = llm_engine.LLMEngine(config, quiet=True)
    rng = random.Random(prompt_seed)
    top = min(max_prompt, engine.max_seq_len - max_output - 1)
    for wave in range(3):
        ids = []
        for _ in range(requests // 3):
            prompt = [rng.randrange(1, engine.spec.vocab_size) for _ in range(rng.randint(2, max(2, top)))]
            params = sampling.SamplingParams(max_tokens=rng.randint(1, max_output), ignore_eos=True)
            ids.append(engine.add_request(prompt, params))
        llm.run_to_completion(engine, ids)
        typer.echo(f"wave {wave + 1}/3: {len(engine.trace.steps)} steps so far", err=True)
    model = timing.fit(list(engine.trace.steps), f"kvctl calibrate ({config.model} on {engine.device})")
    model.save(output)
    typer.echo(f"{output}: {model.describe()}")
