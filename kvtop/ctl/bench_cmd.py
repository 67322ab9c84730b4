"""`kvctl bench` and `kvctl bench compare`: typer shells over kvtop.ctl.bench."""

import asyncio
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtop.ctl import bench, bench_trace
from kvtop.entry import CLIError
from kvtop.fmt import ms
from kvtop.urls import checked_url

bench_app = typer.Typer(help="Load-test an OpenAI-compatible server; compare two runs.", no_args_is_help=False)
out = Console()
err = Console(stderr=True)

DATASETS = ("random", "shared-prefix", "long-context", "jsonl")
MAX_SCRAPE_INTERVAL_S = 3600.0


def _range(text: str, name: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        pair = (int(lo), int(hi or lo))
    except ValueError:
        raise typer.BadParameter("use N or MIN:MAX", param_hint=name) from None
    if pair[0] <= 0 or pair[1] < pair[0]:
        raise typer.BadParameter("use positive N or MIN:MAX with MIN <= MAX", param_hint=name)
    return pair


@bench_app.callback(invoke_without_command=True)
def bench_run(
    ctx: typer.Context,
    base_url: Annotated[
        str,
        typer.Option("--base-url", "--url", help="Server address, with or without the /v1 that `kvctl serve` prints."),
    ] = "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(help="Model id (default: the server's first).")] = None,
    dataset: Annotated[str, typer.Option(help=" | ".join(DATASETS))] = "random",
    num_prompts: Annotated[int, typer.Option(help="Requests to send.")] = 100,
    input_len: Annotated[str, typer.Option(help="Prompt length in words, N or MIN:MAX.")] = "64:256",
    output_len: Annotated[str, typer.Option(help="max_tokens, N or MIN:MAX.")] = "32:128",
    groups: Annotated[int, typer.Option(help="shared-prefix: distinct system prompts.")] = 4,
    system_len: Annotated[int, typer.Option(help="shared-prefix: system prompt words.")] = 512,
    question_len: Annotated[int, typer.Option(help="shared-prefix: question words.")] = 32,
    long_share: Annotated[float, typer.Option(help="long-context: share of long requests.")] = 0.1,
    long_factor: Annotated[int, typer.Option(help="long-context: how many times longer.")] = 8,
    file: Annotated[Path | None, typer.Option(help='jsonl: a file of {"prompt": ...} lines.')] = None,
    request_rate: Annotated[float, typer.Option(help="Requests/s (Poisson); inf sends all at once.")] = float("inf"),
    burstiness: Annotated[float, typer.Option(help="Gamma shape of arrivals: 1 Poisson, <1 burstier.")] = 1.0,
    max_concurrency: Annotated[int | None, typer.Option(help="Most requests in flight.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for prompts and arrivals.")] = 0,
    slo: Annotated[str | None, typer.Option(help="Goodput SLO in ms, e.g. ttft=500,tpot=50.")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Ask for exactly max_tokens (vLLM's extension).")] = True,
    api_key: Annotated[str | None, typer.Option(envvar="KVTOP_API_KEY", help="Bearer key.")] = None,
    scrape_interval: Annotated[
        float,
        typer.Option(
            help="Seconds between /metrics samples of a kvtop server's KV usage during the run (0: only "
            "before and after; each scrape costs the server CPU)."
        ),
    ] = bench.SCRAPE_INTERVAL,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
    trace: Annotated[Path | None, typer.Option(help="Replay a trace (.kvsnap or JSONL) at its arrivals.")] = None,
    trace_out: Annotated[Path | None, typer.Option(help="Write the run as a trace JSONL (docs/whatif.md).")] = None,
) -> None:
    """Send a workload, streaming, and report TTFT, TPOT, ITL, e2e (mean/P50/P95/P99), throughput,
    goodput, and the server's own view when it is kvtop."""
    if ctx.invoked_subcommand is not None:
        return
    work = Workload(dataset=dataset, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                    groups=groups, system_len=system_len, question_len=question_len, long_share=long_share,
                    long_factor=long_factor, file=file, trace=trace, seed=seed)  # fmt: skip
    load = bench.Load(request_rate=request_rate, burstiness=burstiness, max_concurrency=max_concurrency, seed=seed,
                      ignore_eos=ignore_eos, api_key=api_key, scrape_interval=scrape_interval)  # fmt: skip
    base_url, slo_s = _checked_inputs(base_url, work, load, slo)
    reqs = _workload(work)
    model = _served_model(base_url, model, api_key)
    results, duration, server = _with_progress(
        dataset, len(reqs), lambda on_done: bench.run_bench(base_url, model, reqs, load, on_done=on_done)
    )
    rep = bench.report(results, duration, server, slo_s, _meta(base_url, model, work, load))
    _write_outputs(rep, trace_out, json_path, lambda path: bench_trace.write_trace(path, reqs, results, ignore_eos))
    print_report(rep)
    if rep["completed"] == 0:
        raise typer.Exit(1)


@dataclass(frozen=True)
class Workload:
    """The requests `kvctl bench` sends, as its flags name them (lengths still `N` or `MIN:MAX`):
    a `dataset`'s `num_prompts` (the shape fields its own), or the requests of a `trace`."""

    dataset: str
    num_prompts: int
    input_len: str
    output_len: str
    groups: int  # shared-prefix
    system_len: int
    question_len: int
    long_share: float  # long-context
    long_factor: int
    file: Path | None  # jsonl
    trace: Path | None
    seed: int  # the prompts'


def _meta(base_url: str, model: str, work: Workload, load: bench.Load) -> dict:
    """What the report says of the run's inputs."""
    return {"base_url": base_url, "model": model, "dataset": work.dataset, "num_prompts": work.num_prompts,
            "request_rate": load.request_rate if load.request_rate != float("inf") else "inf",
            "burstiness": load.burstiness, "max_concurrency": load.max_concurrency, "seed": work.seed,
            "scrape_interval_s": load.scrape_interval}  # fmt: skip


def _write_outputs(rep: dict, trace_out: Path | None, json_path: Path | None, write_trace) -> None:
    """What --trace-out and --json asked for: the run as a trace, the report as JSON."""
    if trace_out:
        write_trace(trace_out)
    if json_path:
        json_path.write_text(json.dumps(rep, indent=2))


def _checked_inputs(base_url: str, work: Workload, load: bench.Load, slo: str | None) -> tuple[str, dict]:
    """The server's URL and the SLO in seconds, once every number is one the run can use; else
    the one-line error naming the flag."""
    try:
        base_url = checked_url(base_url, "--base-url")
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    _check_numbers(work.num_prompts, load.request_rate, load.burstiness, load.scrape_interval)
    try:
        return base_url, bench.parse_slo(slo)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--slo") from None


def _check_numbers(num_prompts: int, request_rate: float, burstiness: float, scrape_interval: float) -> None:
    """Comparisons written so that nan fails them too."""
    if num_prompts <= 0:
        raise typer.BadParameter("must be positive", param_hint="--num-prompts")
    if not request_rate > 0:  # inf is allowed: all at once
        raise typer.BadParameter("must be positive (inf sends all at once)", param_hint="--request-rate")
    if not 0 < burstiness < math.inf:
        raise typer.BadParameter("must be a positive number", param_hint="--burstiness")
    if not 0 <= scrape_interval <= MAX_SCRAPE_INTERVAL_S:
        raise typer.BadParameter(
            f"must be 0 or more, at most {MAX_SCRAPE_INTERVAL_S:g} s", param_hint="--scrape-interval"
        )


def _workload(w: Workload) -> list[bench.BenchRequest]:
    """The requests of `--dataset` (or of `--trace`), or BadParameter naming the flag that is wrong."""
    if w.trace:
        return bench_trace.trace_requests(w.trace)
    if w.dataset not in DATASETS:
        raise typer.BadParameter(f"use one of {', '.join(DATASETS)}", param_hint="--dataset")
    n, seed = w.num_prompts, w.seed
    ins, outs = _range(w.input_len, "--input-len"), _range(w.output_len, "--output-len")
    if w.dataset == "random":
        return bench.random_dataset(n, ins, outs, seed)
    if w.dataset == "shared-prefix":
        return bench.shared_prefix_dataset(n, w.groups, w.system_len, w.question_len, outs, seed)
    if w.dataset == "long-context":
        return bench.long_context_dataset(n, ins, outs, w.long_share, w.long_factor, seed)
    if w.file is None or not w.file.exists():
        raise typer.BadParameter("jsonl needs --file pointing at an existing file", param_hint="--file")
    try:
        return bench.jsonl_dataset(w.file, n, outs, seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--file") from None


def _served_model(base_url: str, model: str | None, api_key: str | None) -> str:
    """`model`, else the server's first; no server is one line and exit 2."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = httpx.get(f"{bench.api_base(base_url)}/v1/models", headers=headers, timeout=10).json()
        return model or models["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        raise CLIError(f"no OpenAI-compatible server answers at {base_url} (GET /v1/models failed)", 2) from None


def _with_progress(dataset: str, total: int, run: Callable) -> tuple[list[bench.RequestResult], float, dict]:
    """`run(on_done)` (a coroutine) under a progress bar that counts requests done and failed."""
    columns = (TextColumn(f"[bold]bench[/bold] {dataset}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("· {task.fields[failed]} failed"), TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=err) as progress:
        task = progress.add_task("bench", total=total, failed=0)
        failed = 0

        def on_done(r: bench.RequestResult) -> None:
            nonlocal failed
            failed += 0 if r.ok else 1
            progress.update(task, advance=1, failed=failed)

        return asyncio.run(run(on_done))


def print_report(rep: dict) -> None:
    t = Table(title=f"kvctl bench · {rep['dataset']} · {Path(rep['model']).name}", show_header=True)
    t.add_column("metric")
    for col in ("mean", "P50", "P95", "P99"):
        t.add_column(col, justify="right")
    for name, key in (("TTFT ms", "ttft_s"), ("TPOT ms", "tpot_s"), ("ITL ms", "itl_s"), ("e2e ms", "e2e_s")):
        s = rep[key]
        t.add_row(name, *(ms(s[k], 1) for k in ("mean", "p50", "p95", "p99")))
    out.print(t)
    lines = [
        f"completed {rep['completed']}, failed {rep['failed']} in {rep['duration_s']:.2f} s",
        f"throughput {rep['request_throughput']:.2f} req/s, {rep['input_token_throughput']:.1f} input tok/s, "
        f"{rep['output_token_throughput']:.1f} output tok/s",
    ]
    if rep.get("goodput_requests_per_s") is not None:
        slo = ", ".join(f"{k} ≤ {v:g} ms" for k, v in rep["slo"].items())
        lines.append(f"goodput {rep['goodput_requests_per_s']:.2f} req/s meeting {slo}")
    if rep.get("server"):
        s = rep["server"]
        lines.append(
            f"server: prefix hit rate {s['prefix_hit_rate'] * 100:.1f} %, preemptions {s['preemptions']:.0f}, "
            f"peak KV usage {s['peak_kv_usage'] * 100:.1f} %"
        )
    for error, count in rep.get("errors", {}).items():
        lines.append(f"[red]{count} × {error}[/red]")
    for line in lines:
        out.print(line, highlight=False)


COMPARE_ROWS = [
    ("output tok/s", ("output_token_throughput",), 1.0, True),
    ("requests/s", ("request_throughput",), 1.0, True),
    ("TTFT P50 ms", ("ttft_s", "p50"), 1000.0, False),
    ("TTFT P99 ms", ("ttft_s", "p99"), 1000.0, False),
    ("TPOT P50 ms", ("tpot_s", "p50"), 1000.0, False),
    ("ITL P99 ms", ("itl_s", "p99"), 1000.0, False),
    ("e2e P99 ms", ("e2e_s", "p99"), 1000.0, False),
    ("failed", ("failed",), 1.0, False),
]


@bench_app.command()
def compare(
    a: Annotated[Path, typer.Argument(help="Baseline report (--json of a bench run).")],
    b: Annotated[Path, typer.Argument(help="Report to compare against it.")],
) -> None:
    """Two bench reports side by side, with B/A ratios."""
    reps = []
    for p in (a, b):
        try:
            reps.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise typer.BadParameter(f"{p}: not a bench report ({exc})") from None
    t = Table(title=f"{a.name} → {b.name}")
    for col in ("metric", os.path.basename(a), os.path.basename(b), "B/A"):
        t.add_column(col, justify="right" if col != "metric" else "left")
    for label, path, scale, higher_better in COMPARE_ROWS:
        va, vb = (_dig(r, path) for r in reps)
        ratio = "-" if not va or vb is None else f"{vb / va:.2f}×"
        if va and vb is not None and vb != va:
            better = (vb > va) == higher_better
            ratio = f"[{'green' if better else 'red'}]{ratio}[/]"
        t.add_row(label, _fmt(va, scale), _fmt(vb, scale), ratio)
    out.print(t)


def _dig(rep: dict, path: tuple[str, ...]):
    v = rep
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v


def _fmt(v, scale: float) -> str:
    return "-" if v is None else f"{v * scale:.1f}"
