"""`kvctl record`: any engine's `/metrics` recorded for a while into a `.kvsnap` that `kvctl replay` plays."""

from __future__ import annotations

import math
import re
import signal
import sys
import time
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from kvtop.protocol.snapshot import check_target
from kvtop.sources import fetch
from kvtop.sources.recorder import Recording, source_meta
from kvtop.urls import checked_url

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "ms": 0.001}
PROGRESS_EVERY_S = 10.0  # without a terminal: a progress line this often, not one per frame
SCRAPE_TIMEOUT_S = 5.0  # a slow page delays the next scrape; a busy engine can take seconds to answer
MAX_SECONDS = 86400.0  # --interval and --scrape-timeout: a day is already more than any use


def parse_seconds(text: str, what: str) -> float:
    """`60`, `60s`, `1.5m`, `2h`, `500ms` as seconds; typer.BadParameter (one line) otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|min|h)?\s*", text or "")
    if not m:
        raise typer.BadParameter(f"{text!r} is not a time: use 60, 60s, 1.5m, 2h or 500ms", param_hint=what)
    value = float(m.group(1)) * _UNITS[m.group(2) or ""]
    if not math.isfinite(value):
        raise typer.BadParameter(f"{text!r} is too long", param_hint=what)
    return value


def _bounded(value: float, what: str) -> float:
    """`value` if it is more than 0 and at most a day; BadParameter (one line) otherwise."""
    if not 0 < value <= MAX_SECONDS:
        raise typer.BadParameter(f"must be more than 0 and at most {MAX_SECONDS:g} s (a day)", param_hint=what)
    return value


def _line(rec: Recording) -> str:
    frame = rec.frames[-1] if rec.frames else {}
    kv, sched = frame.get("kv", {}), frame.get("scheduler", {})
    parts = [f"{len(rec.frames)} frames", f"{rec.elapsed:.0f} s" + (f" of {rec.duration:g} s" if rec.duration else "")]
    if kv.get("usage") is not None:
        parts.append(f"KV {100 * kv['usage']:.0f} %")
    if sched.get("running") is not None:
        parts.append(f"{sched['running']} running, {sched.get('waiting', '?')} waiting")
    if rec.last_error:
        parts.append(f"unreachable: {rec.last_error}"[:80])
    elif rec.misses:
        parts.append(f"{rec.misses} scrapes failed")
    return "recording: " + ", ".join(parts)


class _Progress:
    """The progress line on stderr: redrawn in place on a terminal, every 10 s otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = time.monotonic()

    def __call__(self, rec: Recording) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + _line(rec))
            sys.stderr.flush()
        elif time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.last = time.monotonic()
            print(_line(rec), file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()


def _stop_on_signals(rec: Recording) -> None:
    """Ctrl-C and SIGTERM stop the recording and keep it, even where the shell that started kvctl
    in the background left SIGINT ignored (a non-interactive shell does that to `cmd &`). The handler
    sets the recording's flag and ends the scrape under way (its page is not kept): never a
    KeyboardInterrupt, which could land in a finalizer, where Python drops it (seen in CI: a SIGINT'd
    recording went on for 30 s; a Ctrl-C before the first page was lost the same way, and the
    scrape went on waiting for its --scrape-timeout)."""

    def stop(signum, frame) -> None:
        rec.stop()
        fetch.cancel_in_flight()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def _fail(message: str, code: int = 1) -> NoReturn:
    """One line on stderr and exit status `code` (1, as kvctl's other errors; 130 after a Ctrl-C). The CLI
    module may run as __main__, so its error class is not the one this module would import."""
    Console(stderr=True).print(f"[red]kvctl:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def record_command(
    url: Annotated[str, typer.Option("--url", help="The engine: its base URL (…/metrics is read) or a metrics URL.")],
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            help="The .kvsnap file to write, or a directory (DIR/ must be one that exists).",
        ),
    ],
    duration: Annotated[str, typer.Option(help="How long to record: 60s, 5m, 1h; 0 records until Ctrl-C.")] = "60s",
    interval: Annotated[str, typer.Option(help="Time between two scrapes: 1s, 500ms.")] = "1s",
    engine: Annotated[
        str | None, typer.Option("--engine", help="vllm, sglang, llamacpp or kvtop (default: detected).")
    ] = None,
    reason: Annotated[str, typer.Option(help="Why: recorded in the snapshot.")] = "kvctl record",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file (a regular file only).")] = False,
    scrape_timeout: Annotated[
        str, typer.Option(help="How long one page may take before it counts as missed: 5s, 30s (at most a day).")
    ] = f"{SCRAPE_TIMEOUT_S:g}s",
) -> None:
    """Record an engine's /metrics (vLLM, SGLang, llama.cpp, kvtop) into a snapshot file that
    `kvctl replay` plays. Ctrl-C stops early and keeps what was recorded. An existing file is never
    replaced without --force; missing directories are not created."""
    from kvtop.sources import SourceUnavailable
    from kvtop.sources.metrics import MetricsSource

    seconds = parse_seconds(duration, "--duration")
    every = _bounded(parse_seconds(interval, "--interval"), "--interval")
    wait = _bounded(parse_seconds(scrape_timeout, "--scrape-timeout"), "--scrape-timeout")
    check_target(output, force=force)  # refused now, not after a minute of recording
    try:
        source = MetricsSource(checked_url(url), interval=every, engine=engine, timeout=wait)
    except ValueError as exc:
        _fail(str(exc))
    rec = Recording(source, interval=every, duration=seconds or None)
    progress = _Progress()
    _stop_on_signals(rec)
    try:
        rec.first()
    except SourceUnavailable as exc:
        source.close()
        if rec.stopped:  # Ctrl-C while a slow engine had not answered yet: 130, as a shell reports it
            _fail(f"stopped before {source.url} answered: nothing recorded, nothing written", code=130)
        _fail(f"cannot read {source.url}: {exc}")
    until = f"for {seconds:g} s" if seconds else "until Ctrl-C"
    print(f"recording {source.url} {until}, every {every:g} s, into {output} (Ctrl-C stops and keeps what was recorded)",
          file=sys.stderr, flush=True)  # fmt: skip
    try:
        rec.run(progress)
    finally:
        progress.end()
        source.close()
    written = rec.save(output, source_meta(source, reason), force=force)
    span = rec.frames[-1]["ts"] - rec.frames[0]["ts"]
    how = "stopped: " if rec.stopped else ""
    print(f"{how}{len(rec.frames)} frames over {span:.0f} s"
          + (f" ({rec.misses} scrapes failed)" if rec.misses else ""), file=sys.stderr)  # fmt: skip
    print(written)
