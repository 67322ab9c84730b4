"""kvctl: the operator's command line. Each command is a thin shell over a library function."""

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from engine.config import EngineConfig
from engine.errors import EngineError
from kvtop.options import with_engine_options

app = typer.Typer(
    name="kvctl",
    help="Run, watch and steer a kvtop engine: serve, run, status, drain, resume, evict, snapshot, replay, bench, plan.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit code `code`."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        from kvtop import __version__

        out.print(f"kvctl {__version__}")
        raise typer.Exit()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


@app.command()
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
    from engine import LLMEngine
    from kvtop.run import output_record, read_prompts, run_batch

    if not prompts.exists():
        raise CLIError(f"no such prompts file: {prompts}")
    engine = LLMEngine(config)
    defaults = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "ignore_eos": ignore_eos,
    }
    specs = read_prompts(prompts, engine, defaults)
    total_tokens = sum(s.params.max_tokens for s in specs)
    with Progress(
        TextColumn("[bold]generating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests · {task.fields[tokens]} tokens"),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    ) as progress:
        task = progress.add_task("run", total=len(specs), tokens=0)
        generated = 0

        def on_progress(new_tokens: int, finished: int) -> None:
            nonlocal generated
            generated += new_tokens
            progress.update(task, advance=finished, tokens=f"{generated}/≤{total_tokens}")

        outputs, summary = run_batch(engine, specs, on_progress)
    if output:
        with output.open("w") as f:
            for spec, o in zip(specs, outputs, strict=True):
                f.write(json.dumps(output_record(spec, o)) + "\n")
    if json_summary:
        out.print_json(json.dumps(summary))
        return
    table = Table(title="kvctl run", show_header=False)
    table.add_row(
        "requests", f"{summary['requests']} ({', '.join(f'{k}: {v}' for k, v in summary['finish_reasons'].items())})"
    )
    table.add_row(
        "tokens",
        f"{summary['prompt_tokens']} prompt, {summary['generated_tokens']} generated in {summary['elapsed_s']:.2f} s",
    )
    table.add_row(
        "throughput",
        f"{summary['generation_tokens_per_s']:.1f} gen tok/s, {summary['total_tokens_per_s']:.1f} total tok/s",
    )
    t, i = summary["ttft_s"], summary["itl_s"]
    table.add_row("TTFT ms P50/P95/P99", f"{_ms(t['p50'])} / {_ms(t['p95'])} / {_ms(t['p99'])}")
    table.add_row("ITL ms P50/P95/P99", f"{_ms(i['p50'])} / {_ms(i['p95'])} / {_ms(i['p99'])}")
    table.add_row("preemptions", str(summary["preemptions"]))
    table.add_row("peak KV usage", f"{summary['peak_kv_usage'] * 100:.1f} %")
    table.add_row("prefix hit rate", f"{summary['prefix_hit_rate'] * 100:.1f} % of prompt tokens")
    if output:
        table.add_row("written", str(output))
    out.print(table)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and a non-zero exit, never a traceback."""
    try:
        app(args=argv, standalone_mode=True)
    except CLIError as exc:
        err.print(f"[red]kvctl:[/red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.code)
    except EngineError as exc:
        err.print(f"[red]kvctl:[/red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err.print("kvctl: interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
