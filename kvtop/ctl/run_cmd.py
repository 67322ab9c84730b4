"""`kvctl run`: offline batch generation from a JSONL file, with a progress bar and a summary
(a typer shell over engine/batch.py; the engine, and torch, load only when the command runs, through
kvtop/ctl/engine_gate.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtop.ctl.engine_gate import load_engine
from kvtop.ctl.options import with_engine_options
from kvtop.entry import CLIError
from kvtop.fmt import ms
from kvtop.protocol.config import EngineConfig

out = Console()
err = Console(stderr=True)


@with_engine_options
def run(
    prompts: Annotated[
        Path, typer.Argument(help="JSONL: one object per line with prompt | messages | prompt_token_ids.")
    ],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write completions here as JSONL.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Default max_tokens for lines that set none.")] = 64,
    temperature: Annotated[float, typer.Option(help="Default temperature (0 = greedy).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Default top_p.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Default top_k (-1 = off).")] = -1,
    ignore_eos: Annotated[bool, typer.Option(help="Generate max_tokens even past EOS.")] = False,
    json_summary: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    *,
    config: EngineConfig,
) -> None:
    """Offline batch: generate for every prompt in a JSONL file, with a progress bar and a summary."""
    batch = load_engine("engine.batch", "run")
    if not prompts.exists():
        raise CLIError(f"no such prompts file: {prompts}")
    engine = load_engine("engine.llm_engine", "run").LLMEngine(config)
    defaults = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "ignore_eos": ignore_eos}  # fmt: skip
    specs = batch.read_prompts(prompts, engine, defaults)
    outputs, summary = _run_with_progress(batch, engine, specs)
    if output:
        with output.open("w") as f:
            for spec, o in zip(specs, outputs, strict=True):
                f.write(json.dumps(batch.output_record(spec, o)) + "\n")
    if json_summary:
        out.print_json(json.dumps(summary))
    else:
        out.print(summary_table(summary, output))


def _run_with_progress(batch, engine, specs) -> tuple[list, dict]:
    total_tokens = sum(s.params.max_tokens for s in specs)
    columns = (TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
               TextColumn("requests · {task.fields[tokens]} tokens"), TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task("run", total=len(specs), tokens=0)
        generated = 0

        def on_progress(new_tokens: int, finished: int) -> None:
            nonlocal generated
            generated += new_tokens
            progress.update(task, advance=finished, tokens=f"{generated}/≤{total_tokens}")

        return batch.run_batch(engine, specs, on_progress)


def summary_table(summary: dict, output: Path | None = None) -> Table:
    """The run in one table: requests, tokens, throughput, TTFT and ITL, preemptions, KV, prefix hits."""
    table = Table(title="kvctl run", show_header=False)
    reasons = ", ".join(f"{k}: {v}" for k, v in summary["finish_reasons"].items())
    table.add_row("requests", f"{summary['requests']} ({reasons})")
    table.add_row(
        "tokens",
        f"{summary['prompt_tokens']} prompt, {summary['generated_tokens']} generated in {summary['elapsed_s']:.2f} s",
    )
    table.add_row(
        "throughput",
        f"{summary['generation_tokens_per_s']:.1f} gen tok/s, {summary['total_tokens_per_s']:.1f} total tok/s",
    )
    for label, key in (("TTFT", "ttft_s"), ("ITL", "itl_s")):
        h = summary[key]
        table.add_row(f"{label} ms P50/P95/P99", " / ".join(ms(h[p], 1) for p in ("p50", "p95", "p99")))
    table.add_row("preemptions", str(summary["preemptions"]))
    table.add_row("peak KV usage", f"{summary['peak_kv_usage'] * 100:.1f} %")
    table.add_row("prefix hit rate", f"{summary['prefix_hit_rate'] * 100:.1f} % of prompt tokens")
    if output:
        table.add_row("written", str(output))
    return table
