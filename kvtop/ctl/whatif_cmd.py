"""`kvctl whatif`: a recorded workload under another configuration — a typer shell over
engine.whatif.compare (docs/whatif.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvtop.ctl.engine_gate import load_engine
from kvtop.fmt import ms, pct

out = Console()
err = Console(stderr=True)
_P = "What-if configuration (unset: as recorded)"

# (label, figure, format): one row each, in this order
ROWS = [
    *((f"TTFT P{p} ms", f"ttft_p{p}_s", "ms") for p in (50, 95, 99)),
    *((f"ITL P{p} ms", f"itl_p{p}_s", "ms") for p in (50, 95, 99)),
    *((f"TPOT P{p} ms", f"tpot_p{p}_s", "ms") for p in (50, 99)),
    *((f"e2e P{p} ms", f"e2e_p{p}_s", "ms") for p in (50, 95, 99)),
    *((f"queue P{p} ms", f"queue_p{p}_s", "ms") for p in (50, 99)),
    ("preemptions", "preemptions", "int"),
    ("peak KV blocks", "peak_kv_blocks", "int"),
    ("peak KV usage", "peak_kv_usage", "pct"),
    ("prefix hit rate", "prefix_hit_rate", "pct"),
    ("concurrency (mean)", "concurrency_mean", "f1"),
    ("output tok/s", "output_tokens_per_s", "f1"),
    ("requests/s", "requests_per_s", "f2"),
    ("completed", "completed", "int"),
    ("rejected", "rejected", "int"),
    ("duration s", "duration_s", "f1"),
]
CHECK_LABELS = {"ttft_p50_s": "TTFT P50", "e2e_p50_s": "e2e P50", "output_tokens_per_s": "output tok/s"}


def format_figure(value, kind: str) -> str:
    if value is None:
        return "—"
    if kind == "ms":
        return ms(value, 1)
    if kind == "pct":
        return pct(value)
    if kind == "int":
        return f"{value:,.0f}"
    return f"{value:,.{kind[1]}f}"


def whatif_command(
    source: Annotated[Path, typer.Argument(help="A .kvsnap snapshot of a kvtop engine, or a trace JSONL.")],
    kv_cache_memory: Annotated[str | None, typer.Option(help="KV cache size, e.g. 512MiB.", rich_help_panel=_P)] = None,
    kv_cache_dtype: Annotated[str | None, typer.Option(help="auto | int8 | fp8_e4m3.", rich_help_panel=_P)] = None,
    block_size: Annotated[int | None, typer.Option(help="Tokens per KV block.", rich_help_panel=_P)] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Most sequences at once.", rich_help_panel=_P)] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="Token budget a step.", rich_help_panel=_P)] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Longest prompt + output.", rich_help_panel=_P)] = None,
    enable_prefix_caching: Annotated[
        bool | None,
        typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="Prefix cache.", rich_help_panel=_P),
    ] = None,
    schedule_policy: Annotated[str | None, typer.Option(help="fcfs | lpm.", rich_help_panel=_P)] = None,
    preemption_mode: Annotated[str | None, typer.Option(help="recompute | swap.", rich_help_panel=_P)] = None,
    cpu_offload_memory: Annotated[str | None, typer.Option(help="CPU KV tier, e.g. 1GiB.", rich_help_panel=_P)] = None,
    load: Annotated[str, typer.Option(help="Arrivals this many times as dense, e.g. 1.5x.")] = "1x",
    calibration: Annotated[
        Path | None, typer.Option(help="Step-time model from `kvctl calibrate` (else fitted to the recording).")
    ] = None,
    sweep: Annotated[
        str | None,
        typer.Option(help="One knob over a range, e.g. kv-cache-memory=64MiB..2GiB (or max-num-seqs, load)."),
    ] = None,
    points: Annotated[int, typer.Option(help="--sweep: settings tried.")] = 8,
    slo: Annotated[str | None, typer.Option(help="--sweep: objectives, e.g. ttft_p99=2s,itl_p99=200ms.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the three columns as JSON.")] = False,
) -> None:
    """Replay a recorded workload through the engine's own scheduler and block manager under another
    configuration: what happened, the recorded configuration simulated (the self-check), the what-if."""
    from kvtop.protocol.trace_file import load_trace

    whatif, timing_model = load_engine("engine.whatif.compare", "whatif"), load_engine("engine.whatif.timing", "whatif")

    overrides = {"kv_cache_memory": kv_cache_memory, "kv_cache_dtype": kv_cache_dtype, "block_size": block_size,
                 "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                 "max_model_len": max_model_len, "enable_prefix_caching": enable_prefix_caching,
                 "schedule_policy": schedule_policy, "preemption_mode": preemption_mode,
                 "cpu_offload_memory": cpu_offload_memory}  # fmt: skip
    factor = whatif.parse_load(load)
    trace = load_trace(source)
    timing = timing_model.StepTimeModel.load(calibration) if calibration else None
    if sweep:
        return run_sweep(trace, sweep, points, slo, overrides, factor, timing, json_out)
    result = whatif.compare(trace, overrides, factor, timing)
    if json_out:
        doc = {**result.columns(), "self_check": result.self_check(), "timing": result.timing.describe(),
               "recorded_config": result.recorded_config.describe(), "whatif_config": result.whatif_config.describe(),
               "load": factor, "notes": result.notes}  # fmt: skip
        out.print_json(json.dumps(doc))
        return
    print_comparison(result, source)


def print_comparison(result, source: Path) -> None:
    t = Table(title=f"kvctl whatif · {source.name} · {result.recorded['requests']} requests")
    t.add_column("")
    for name in (
        "recorded",
        "simulated (self-check)",
        f"what-if{'' if result.load == 1 else f' at {result.load:g}x load'}",
    ):
        t.add_column(name, justify="right")
    cols = result.columns()
    for label, key, kind in ROWS:
        t.add_row(label, *(format_figure(cols[c].get(key), kind) for c in ("recorded", "simulated", "whatif")))
    out.print(t)
    out.print(f"recorded: {result.recorded_config.describe()}", highlight=False)
    out.print(f"what-if:  {result.whatif_config.describe()}", highlight=False)
    out.print(f"timing:   {result.timing.describe()}", highlight=False)
    check = ", ".join(f"{CHECK_LABELS[k]} {v * 100:+.1f} %" for k, v in result.self_check().items() if v is not None)
    if check:
        out.print(f"self-check (simulated vs recorded): {check}", highlight=False)
    for note in result.notes:
        out.print(f"note: {note}", highlight=False)


def run_sweep(trace, spec: str, points: int, slo_text: str | None, overrides: dict, load: float, timing,
              json_out: bool) -> None:  # fmt: skip
    """--sweep: the what-if at each setting, a bar of TTFT P99 each, and the smallest meeting --slo."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    sw = load_engine("engine.whatif.sweep", "whatif")
    knob, values = sw.parse_sweep(spec, points)
    slo = sw.parse_slo(slo_text)
    load_engine("engine.whatif.compare", "whatif").require_config(trace)
    timing = timing or load_engine("engine.whatif.timing", "whatif").fit(trace.steps, trace.source)
    with Progress(TextColumn(f"[bold]whatif[/bold] {knob}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:  # fmt: skip
        task = progress.add_task("sweep", total=len(values))
        rows = sw.sweep(trace, knob, values, {k: v for k, v in overrides.items() if v is not None}, timing, load,
                        lambda done, _: progress.update(task, completed=done))  # fmt: skip
    best = sw.smallest_meeting(rows, slo, knob) if slo else None
    if json_out:
        out.print_json(json.dumps({"knob": knob, "points": rows, "slo": slo, "meets": best and best["label"]}))
        return
    _print_sweep(knob, rows, slo, best)


def _print_sweep(knob: str, rows: list[dict], slo: dict, best: dict | None) -> None:
    sw = load_engine("engine.whatif.sweep", "whatif")
    top = max((r.get("ttft_p99_s") or 0.0 for r in rows), default=0.0) or 1.0
    t = Table(title=f"kvctl whatif --sweep {knob} (latencies in ms, output in tokens/s)")
    for col in (knob, "TTFT P99", "", "ITL P99", "e2e P50", "preempt", "peak KV", "tok/s"):
        t.add_column(col, justify="left" if col == "" else "right")
    if slo:
        t.add_column("SLO")
    for r in rows:
        if "error" in r:
            t.add_row(r["label"], "—", "cannot hold a request", *["—"] * 5, *(["no"] if slo else []))
            continue
        bar = "█" * max(1, round(10 * (r["ttft_p99_s"] or 0.0) / top))
        cells = [format_figure(r["ttft_p99_s"], "ms"), bar, format_figure(r["itl_p99_s"], "ms"), format_figure(r["e2e_p50_s"], "ms"),
                 format_figure(r["preemptions"], "int"), format_figure(r["peak_kv_usage"], "pct"), format_figure(r["output_tokens_per_s"], "f1")]  # fmt: skip
        verdict = "yes" if sw.meets(r, slo) else (f"no: {r['rejected']} refused" if r["rejected"] else "no")
        t.add_row(r["label"], *cells, *([verdict] if slo else []))
    out.print(t)
    if slo:
        goal = ", ".join(f"{k.removesuffix('_s')} ≤ {v * 1000:g} ms" for k, v in slo.items())
        found = f"{best['label']} is the smallest setting that meets it" if best else "no setting in the range meets it"
        out.print(f"{goal}: {found}", highlight=False)
