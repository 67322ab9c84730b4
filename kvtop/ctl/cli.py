"""kvctl: the operator's command line. Each command is a thin shell over a library function."""

import importlib
import json
import sys
import time
from pathlib import Path
from typing import Annotated, ClassVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from typer.core import TyperGroup

from engine.config import EngineConfig
from engine.errors import EngineError
from engine.server.config import TRIGGERS, ServerConfig
from kvtop.client import EngineClient, EngineRequestError, EngineUnavailable
from kvtop.ctl.options import with_engine_options


class _Commands(TyperGroup):
    """kvctl's command group, with commands whose modules import torch loaded only when used
    (run, or listed by --help), so that `kvctl status`, `drain` or a completion stay instant."""

    LAZY: ClassVar[dict[str, tuple[str, str]]] = {
        "plan": ("kvtop.ctl.plan_cmd", "plan_command"),
        "record": ("kvtop.ctl.record", "record_command"),  # issue #15: any engine's /metrics into a .kvsnap
    }

    def list_commands(self, ctx) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.LAZY})

    def get_command(self, ctx, name: str):
        if name in self.LAZY and name not in self.commands:
            module, attr = self.LAZY[name]
            single = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
            single.command(name)(getattr(importlib.import_module(module), attr))
            self.commands[name] = typer.main.get_command(single)
        return super().get_command(ctx, name)


app = typer.Typer(
    cls=_Commands,
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


def _print_version(value: bool) -> None:
    """Eager: answers before the group looks for a command (otherwise "Missing command")."""
    if value:
        from kvtop import __version__

        print(f"kvctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", is_eager=True, callback=_print_version)
    ] = False,
) -> None:
    pass


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
    from kvtop.ctl.run import output_record, read_prompts, run_batch

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


from kvtop.ctl.bench_cmd import bench_app  # noqa: E402

# `plan` is registered in _Commands.LAZY: kvtop.ctl.plan_cmd imports torch
app.add_typer(bench_app, name="bench")


# ---- serving ---------------------------------------------------------------------------
_SERVER = ServerConfig.__dataclass_fields__
_S = "Server"


def _default(name: str):
    f = _SERVER[name]
    return f.default


SocketOption = Annotated[
    Path | None,
    typer.Option(
        "--socket", help="Control socket (default: $KVTOP_SOCKET, else $XDG_RUNTIME_DIR/kvtop-$UID/engine.sock)."
    ),
]


@app.command()
@with_engine_options
def serve(
    host: Annotated[str, typer.Option(help="Address of the OpenAI API.", rich_help_panel=_S)] = _default("host"),
    port: Annotated[int, typer.Option(help="Port of the OpenAI API (0: any free one).", rich_help_panel=_S)] = _default(
        "port"
    ),
    socket: SocketOption = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="KVTOP_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1.", rich_help_panel=_S),
    ] = None,
    max_queue: Annotated[
        int, typer.Option(help="Requests that may wait beyond max-num-seqs; more get 429.", rich_help_panel=_S)
    ] = _default("max_queue"),
    stats_interval: Annotated[
        float, typer.Option(help="Seconds between flight-recorder frames.", rich_help_panel=_S)
    ] = _default("stats_interval"),
    history: Annotated[
        float, typer.Option(help="Seconds of frames the flight recorder keeps.", rich_help_panel=_S)
    ] = _default("history"),
    drain_timeout: Annotated[
        float, typer.Option(help="On SIGTERM: drain this long, abort the rest, exit.", rich_help_panel=_S)
    ] = _default("drain_timeout"),
    snapshot_dir: Annotated[
        Path | None, typer.Option(help="Where snapshots go (default: $KVTOP_CACHE/snapshots).", rich_help_panel=_S)
    ] = None,
    snapshot_on: Annotated[
        str | None,
        typer.Option(help=f"Automatic snapshots, comma-separated: {', '.join(TRIGGERS)}.", rich_help_panel=_S),
    ] = None,
    storm_preemptions: Annotated[
        int, typer.Option(help="preemption-storm: this many preemptions ...", rich_help_panel=_S)
    ] = _default("storm_preemptions"),
    storm_window: Annotated[float, typer.Option(help="... within this many seconds.", rich_help_panel=_S)] = _default(
        "storm_window"
    ),
    slo_ttft: Annotated[
        float, typer.Option(help="slo-breach: TTFT P99 over the last minute above this (s).", rich_help_panel=_S)
    ] = _default("slo_ttft"),
    slo_itl: Annotated[
        float, typer.Option(help="slo-breach: ITL P99 over the last minute above this (s).", rich_help_panel=_S)
    ] = _default("slo_itl"),
    snapshot_cooldown: Annotated[
        float, typer.Option(help="Seconds before the same trigger fires again.", rich_help_panel=_S)
    ] = _default("snapshot_cooldown"),
    max_request_body: Annotated[
        str, typer.Option(help="Largest request body (bytes or e.g. 8MiB); more gets 413.", rich_help_panel=_S)
    ] = "8MiB",
    read_timeout: Annotated[
        float, typer.Option(help="Seconds a client may stall mid-request before it is cut off.", rich_help_panel=_S)
    ] = _default("read_timeout"),
    max_connections: Annotated[
        int, typer.Option(help="Open connections; beyond them new requests get 503.", rich_help_panel=_S)
    ] = _default("max_connections"),
    log_level: Annotated[str, typer.Option(help="uvicorn log level.", rich_help_panel=_S)] = "warning",
    *,
    config: EngineConfig,
) -> None:
    """Serve the OpenAI API, Prometheus metrics and the stats/control socket until SIGTERM."""
    from engine.server.app import serve as run_server

    server = ServerConfig(
        host=host,
        port=port,
        socket=socket,
        api_key=api_key or None,
        max_queue=max_queue,
        stats_interval=stats_interval,
        history=history,
        drain_timeout=drain_timeout,
        snapshot_on=ServerConfig.parse_triggers(snapshot_on),
        storm_preemptions=storm_preemptions,
        storm_window=storm_window,
        slo_ttft=slo_ttft,
        slo_itl=slo_itl,
        snapshot_cooldown=snapshot_cooldown,
        max_request_body=max_request_body,
        read_timeout=read_timeout,
        max_connections=max_connections,
        **({"snapshot_dir": snapshot_dir.expanduser().resolve()} if snapshot_dir else {}),
    )
    raise typer.Exit(run_server(config, server, log_level=log_level))


# ---- control ---------------------------------------------------------------------------
def _client(socket: Path | None) -> EngineClient:
    return EngineClient(socket)


@app.command()
def status(
    socket: SocketOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the whole stats frame as JSON.")] = False,
    url: Annotated[
        list[str] | None,
        typer.Option("--url", help="Read any engine's Prometheus /metrics instead (vLLM, SGLang, llama.cpp, kvtop)."),
    ] = None,
    engine: Annotated[
        str | None, typer.Option("--engine", help="With --url: vllm, sglang, llamacpp or kvtop (default: detected).")
    ] = None,
) -> None:
    """What the engine is doing now: state, KV blocks, requests, prefix hits, latency."""
    from kvtop.ctl.summary import render_status

    if url and len(url) > 1:  # a fleet: one line per engine
        _fleet_status(url, engine, socket, json_out)
        return
    if url or engine is not None:
        frame = _metrics_frame(url[0] if url else None, engine, socket)
        print(json.dumps(frame, indent=2)) if json_out else out.print(render_status(frame, out.width))
        return
    with _client(socket) as c:
        frame = c.stats()
        if json_out:
            print(json.dumps(frame, indent=2))
            return
        # the last seconds of the flight recorder, so rate findings (preemptions/s…) can be made
        history = c.history(since=frame["ts"] - 10.0).get("frames", [])
    out.print(render_status(frame, out.width, history))


def _metrics_frame(url: str | None, engine: str | None, socket: Path | None) -> dict:
    """Two scrapes a second apart (so rates show) of an engine's /metrics, as a partial frame."""
    from kvtop.sources import SourceUnavailable
    from kvtop.sources.metrics import MetricsSource

    if url is None:
        raise CLIError("--engine goes with --url URL (the control socket is always our engine)")
    if socket is not None:
        raise CLIError("use --socket or --url, not both")
    try:
        source = MetricsSource(url, engine=engine, timeout=5.0)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    try:
        source.poll()
        time.sleep(1.0)
        return source.poll()
    except SourceUnavailable as exc:
        raise CLIError(f"cannot read {source.url}: {exc}") from None
    finally:
        source.close()


def _fleet_status(urls: list[str], engine: str | None, socket: Path | None, json_out: bool) -> None:
    """Every target scraped at once, twice a second apart (so rates show); one line each."""
    from dataclasses import asdict

    from kvtop.fleet import Fleet
    from kvtop.fleet.table import fleet_table

    if socket is not None:
        raise CLIError("use --socket or --url, not both")
    try:
        fleet = Fleet(urls, timeout=5.0, engine=engine)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    try:
        fleet.poll()
        time.sleep(1.0)
        rows = fleet.poll()
    finally:
        fleet.close()
    if json_out:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        out.print(fleet_table(rows))
    if all(r.state != "ok" for r in rows):
        raise CLIError("no engine answered")


@app.command()
def drain(
    socket: SocketOption = None,
    timeout: Annotated[float | None, typer.Option(help="Give up (exit 1) after this many seconds.")] = None,
    abort_after: Annotated[
        bool, typer.Option("--abort-after", help="At the timeout, abort what is left (finish reason abort).")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
) -> None:
    """Stop admitting new requests and wait while those in flight finish. Exit 0 once drained."""
    if abort_after and timeout is None:
        raise CLIError("--abort-after needs --timeout SECONDS")
    t0 = time.monotonic()
    with _client(socket) as c:
        r = c.drain(timeout, abort_after)
        total = max(1, r["in_flight"])
        grace = 10.0 if abort_after else 0.0  # the engine aborts at the deadline; give it time to
        with Progress(
            TextColumn("[bold]draining"),
            BarColumn(),
            TextColumn("{task.fields[left]} in flight"),
            TimeElapsedColumn(),
            console=err,
            disable=quiet,
        ) as progress:
            task = progress.add_task("drain", total=total, left=r["in_flight"])
            while True:
                frame = c.stats()
                state = frame["engine"]["state"]
                left = frame["scheduler"]["running"] + frame["scheduler"]["waiting"]
                progress.update(task, completed=total - min(left, total), left=left)
                if state == "drained":
                    break
                if state == "running":
                    raise CLIError("the engine was resumed while draining")
                if timeout is not None and time.monotonic() - t0 > timeout + grace:
                    raise CLIError(
                        f"still {left} requests in flight after {timeout:g} s; the engine stays draining "
                        "(`kvctl resume` admits again; --abort-after ends them)"
                    )
                time.sleep(0.2)
    info = (frame.get("server") or {}).get("drain") or {}
    aborted = info.get("aborted", 0)
    tail = f", {aborted} aborted at the timeout" if aborted else ""
    out.print(f"drained in {time.monotonic() - t0:.1f} s{tail}; `kvctl resume` admits again")


@app.command()
def resume(socket: SocketOption = None) -> None:
    """Admit new requests again after a drain."""
    with _client(socket) as c:
        r = c.resume()
    out.print(f"engine {r['state']}")


@app.command()
def evict(
    seq: Annotated[str | None, typer.Option("--seq", help="Take back this sequence's KV blocks.")] = None,
    requeue: Annotated[bool, typer.Option(help="With --seq: recompute it later instead of aborting it.")] = False,
    prefix_cache: Annotated[bool, typer.Option("--prefix-cache", help="Drop every free cached prefix block.")] = False,
    blocks: Annotated[int | None, typer.Option(help="Drop this many least recently used cached blocks.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    socket: SocketOption = None,
) -> None:
    """Free KV memory: one sequence (aborted or requeued), or cached prefix blocks."""
    if sum([seq is not None, prefix_cache, blocks is not None]) != 1:
        raise CLIError("give exactly one of --seq ID, --prefix-cache or --blocks N")
    if requeue and seq is None:
        raise CLIError("--requeue goes with --seq ID")
    if blocks is not None and blocks < 1:
        raise CLIError("--blocks must be at least 1")
    with _client(socket) as c:
        frame = c.stats()
        if seq is not None:
            s = next((x for x in frame.get("sequences", []) if x["id"] == seq), None)
            if s is None:
                raise CLIError(f"no sequence {seq!r} in flight (`kvctl status` lists them)")
            what = (
                f"evict sequence {seq} ({s['state']}, {s['prompt_tokens'] + s['output_tokens']} tokens, "
                f"{s['num_blocks']} blocks); "
                + ("it will be recomputed" if requeue else "its client gets finish reason abort")
            )
        elif prefix_cache:
            what = f"drop all {frame['kv']['cached']} cached prefix blocks"
        else:
            what = f"drop the {blocks} least recently used cached prefix blocks (of {frame['kv']['cached']})"
        if not yes:
            try:
                ok = typer.confirm(f"{what[0].upper()}{what[1:]}?", default=False, err=True)
            except typer.Abort:
                ok = False
            if not ok:
                raise CLIError("not confirmed; nothing evicted (--yes skips the question)")
        body = {"seq_id": seq, "requeue": requeue} if seq is not None else (
            {"prefix_cache": True} if prefix_cache else {"blocks": blocks}
        )  # fmt: skip
        r = c.evict(**body)
    if r["evicted"] == "sequence":
        out.print(f"evicted {r['seq_id']}" + (" (requeued)" if r.get("requeue") else ""))
    else:
        out.print(f"dropped {r['blocks']} cached prefix blocks")


@app.command()
def snapshot(
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here (default: the server's snapshot dir).")
    ] = None,
    reason: Annotated[str, typer.Option(help="Why: recorded in the snapshot.")] = "manual",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file (a regular file only).")] = False,
    socket: SocketOption = None,
) -> None:
    """Write a snapshot: the flight recorder's frames, events, sequences and block table.
    An existing file is never replaced without --force; missing directories are not created."""
    path = _snapshot_path(output) if output else None
    if not _is_text(reason):
        raise CLIError("--reason is not valid UTF-8 text")
    with _client(socket) as c:
        r = c.snapshot(path, reason, force=force)
    out.print(r["path"], markup=False, highlight=False, soft_wrap=True)  # a path may hold [brackets]


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 reach Python as lone surrogates
        return False
    return "\x00" not in value


def _snapshot_path(output: Path) -> str:
    """The path the server is asked to write: absolute (the server has its own cwd), its last
    part not resolved, so a symlink there is refused by the server rather than followed here."""
    text = str(output.expanduser().absolute())
    if not _is_text(text):
        shown = text.encode("utf-8", "backslashreplace").decode()
        raise CLIError(f"the snapshot path {shown} is not valid UTF-8: the engine takes text paths, rename it")
    return text


@app.command()
def replay(file: Annotated[Path, typer.Argument(help="A .kvsnap snapshot file.")]) -> None:
    """Open a snapshot in the kvtop dashboard (after checking it is a readable snapshot)."""
    import inspect

    from engine.snapshot import read_snapshot
    from engine.snapshot_reader import SnapshotReader

    SnapshotReader(file).close()  # a quick look, not a load: SnapshotError is one line and exit 1 (main)
    from kvtop.dashboard import app as dashboard

    try:
        takes_argv = bool(inspect.signature(dashboard.main).parameters)
    except (TypeError, ValueError):
        takes_argv = False
    if takes_argv:
        raise typer.Exit(dashboard.main(["--replay", str(file)]) or 0)
    snap = read_snapshot(file)
    meta = snap.meta
    span = snap.frames[-1]["ts"] - snap.frames[0]["ts"]
    out.print(
        f"{file}: snapshot of {meta.get('model')} ({meta.get('reason')}), {len(snap.frames)} frames over "
        f"{span:.0f} s, {len(snap.events)} events, {len(snap.sequences)} sequences, {len(snap.blocks)} blocks",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    err.print("kvctl: the kvtop dashboard is not available yet, so there is nothing to replay it in")


@app.command()
def completion(
    shell: Annotated[str, typer.Argument(help="bash, zsh or fish.")],
    prog: Annotated[str, typer.Option(help="The program to complete: kvctl or kvtop.")] = "kvctl",
) -> None:
    """Print a shell completion script (see README: Shell completion)."""
    from kvtop.ctl.completion import script

    try:
        sys.stdout.write(script(prog, shell))
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and a non-zero exit, never a traceback."""
    try:
        code = app(args=argv, prog_name="kvctl", standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except typer.TyperException as exc:  # usage errors: one line, not typer's boxed panel
        ctx = getattr(exc, "ctx", None)
        if not exc.format_message():  # no arguments: the help was printed, nothing to add
            sys.exit(exc.exit_code)
        where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        err.print(f"[red]kvctl:[/red] {escape(exc.format_message())}{escape(where)}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("kvctl: aborted")
        sys.exit(1)
    except CLIError as exc:
        err.print(f"[red]kvctl:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(exc.code)
    except EngineUnavailable as exc:
        err.print(f"[red]kvctl:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except EngineRequestError as exc:
        err.print(f"[red]kvctl:[/red] the engine refused: {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except EngineError as exc:
        err.print(f"[red]kvctl:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err.print("kvctl: interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
