"""kvtop's command line (typer): which source the dashboard watches, or which fleet.

`kvtop` alone watches our engine over its control socket; `--replay FILE` plays a snapshot;
`--url URL` reads any engine's Prometheus `/metrics`; several `--url`, `--targets FILE` or
`--prometheus URL` open the fleet screen. The command picks the source and hands it to `KvtopApp`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvtop.urls import checked_url

ENGINES = ("vllm", "sglang", "llamacpp", "kvtop")
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.05, 3600.0

cli = typer.Typer(
    name="kvtop",
    help="The KV-cache dashboard: watch a running engine live (ours, vLLM, SGLang, llama.cpp), a fleet, or a snapshot.",
    add_completion=False,
    pretty_exceptions_enable=False,
)


class UsageError(Exception):
    """A command line kvtop cannot act on: one line on stderr, exit status 1."""


def read_targets(path: Path) -> list[str]:
    """One URL per line; blank lines and `#` comments (whole lines or after a URL) are skipped."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --targets {path}: {getattr(exc, 'strerror', None) or exc}") from None
    urls = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    urls = [u for u in urls if u]
    if not urls:
        raise UsageError(f"--targets {path} names no engine (one URL per line)")
    return urls


def pick(socket, replay, url, engine, targets, prometheus, interval):
    """(source, fleet) for the command line, or UsageError."""
    from kvtop.sources import LiveSource

    if not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S:  # nan and inf too
        raise UsageError(f"--interval {interval:g}: give seconds from {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g}")
    remote = bool(url or targets or prometheus)
    if engine is not None and engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine is not None and not (url or targets):
        raise UsageError("--engine goes with --url or --targets (the control socket is always our engine)")
    if remote and (socket is not None or replay is not None):
        raise UsageError("--url, --targets and --prometheus read engines over HTTP: not with --socket or --replay")
    if replay is not None and socket is not None:
        raise UsageError("--replay plays a file: not with --socket")
    if prometheus is not None and (url or targets):
        raise UsageError("--prometheus finds the engines itself: not with --url or --targets")
    try:
        if prometheus is not None:
            from kvtop.fleet.prometheus import PrometheusFleet

            return None, PrometheusFleet(checked_url(prometheus, "--prometheus"), interval=max(interval, 1.0))
        urls = [checked_url(u) for u in url or []]
        urls += [checked_url(u, f"--targets {targets}:") for u in (read_targets(targets) if targets else [])]
        if len(urls) > 1:
            from kvtop.fleet import Fleet

            return None, Fleet(urls, engine=engine, interval=max(interval, 1.0))
        if urls:
            from kvtop.sources.metrics import MetricsSource

            return MetricsSource(urls[0], interval=interval, engine=engine), None
    except ValueError as exc:  # a URL that is not one
        raise UsageError(str(exc)) from None
    if replay is not None:
        from kvtop.protocol.snapshot import SnapshotError
        from kvtop.sources import ReplaySource

        try:
            return ReplaySource.open(replay), None  # frames are read as they are shown
        except SnapshotError as exc:
            raise UsageError(str(exc)) from None
    _check_trusted(socket)
    return LiveSource(socket, interval), None


def _check_trusted(socket: str | None) -> None:
    """An engine socket another local user stands behind is refused now, in one line, rather than
    shown as a dashboard that never connects (the client refuses it on every poll anyway). One
    that is not there yet is fine: the dashboard waits for the engine."""
    from kvtop.client import EngineClient, EngineRequestError, EngineUnavailable, SocketNotTrusted

    try:
        with EngineClient(socket, timeout=5.0) as client:
            client.healthz()
    except SocketNotTrusted as exc:
        raise UsageError(str(exc)) from None
    except (EngineUnavailable, EngineRequestError):
        pass


@cli.command()
def run(
    socket: Annotated[
        str | None,
        typer.Option(
            "--socket", help="Control socket (default: $KVTOP_SOCKET, else $XDG_RUNTIME_DIR/kvtop-$UID/engine.sock)."
        ),
    ] = None,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between polls (0.05 to 3600).")] = 1.0,
    readonly: Annotated[
        bool, typer.Option("--readonly", help="No actions: drain, resume, evict and snapshot are removed.")
    ] = False,
    replay: Annotated[
        Path | None, typer.Option("--replay", help="Replay a .kvsnap snapshot instead of watching an engine.")
    ] = None,
    url: Annotated[
        list[str] | None,
        typer.Option(
            "--url", help="Any engine's Prometheus /metrics (vLLM, SGLang, llama.cpp, kvtop); repeat it for a fleet."
        ),
    ] = None,
    engine: Annotated[
        str | None, typer.Option("--engine", help="With --url: vllm, sglang, llamacpp or kvtop (default: detected).")
    ] = None,
    targets: Annotated[
        Path | None, typer.Option("--targets", help="A fleet: a file with one engine URL per line (# comments).")
    ] = None,
    prometheus: Annotated[
        str | None,
        typer.Option("--prometheus", help="A fleet: every engine this Prometheus server scrapes (its base URL)."),
    ] = None,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", is_eager=True)] = False,
) -> None:
    """kvtop [--socket PATH] | --url URL [--engine KIND] | --url A --url B… | --targets FILE | --prometheus URL | --replay FILE"""
    if version:
        from kvtop import __version__

        print(f"kvtop {__version__}")
        raise typer.Exit()
    from kvtop.dashboard.app import KvtopApp

    try:
        source, fleet = pick(socket, replay, url, engine, targets, prometheus, interval)
    except UsageError as exc:
        print(f"kvtop: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    code = KvtopApp(source, readonly=readonly, fleet=fleet, interval=interval, engine=engine).run()
    raise typer.Exit(code or 0)


def main(argv: list[str] | None = None) -> None:
    """Entry point (`kvtop`, and `kvctl replay FILE` → main(["--replay", FILE])): errors are one
    line on stderr and an exit status, as kvctl's (kvtop.entry)."""
    from kvtop.entry import run_cli

    run_cli(cli, "kvtop", argv)


if __name__ == "__main__":
    main()
