"""kvctl's commands over the engine's control socket: status (or any engine's /metrics, or a
fleet of them), drain, resume, evict and snapshot. Each is a thin shell over kvtop.client."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvtop.client import EngineClient
from kvtop.ctl.options import SocketOption
from kvtop.entry import CLIError
from kvtop.protocol.config import EVICT_WAIT_S, MAX_EVICT_WAIT_S

out = Console()
err = Console(stderr=True)
STATUS_WINDOW_S = 10.0  # `kvctl status --url` scrapes for this long: its rates are over it, not one second
MIN_WINDOW_S, MAX_WINDOW_S = 1.0, 60.0


def _client(socket: Path | None) -> EngineClient:
    return EngineClient(socket)


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
    window: Annotated[
        float,
        typer.Option(
            "--window",
            help=f"With --url: scrape once a second for this many seconds ({MIN_WINDOW_S:g}-{MAX_WINDOW_S:g}); "
            "rates and findings are over them.",
        ),
    ] = STATUS_WINDOW_S,
) -> None:
    """What the engine is doing now: state, KV blocks, requests, prefix hits, latency."""
    from kvtop.ctl.summary import render_status

    url = _checked_urls(url)
    if not MIN_WINDOW_S <= window <= MAX_WINDOW_S:  # nan and inf too
        raise typer.BadParameter(
            f"{window:g} is not {MIN_WINDOW_S:g} to {MAX_WINDOW_S:g} seconds", param_hint="--window"
        )
    if url and len(url) > 1:  # a fleet: one line per engine
        _fleet_status(url, engine, socket, json_out, window)
        return
    if url or engine is not None:
        frames = _metrics_frames(url[0] if url else None, engine, socket, window)
        if json_out:
            print(json.dumps(frames[-1], indent=2))
        else:
            out.print(render_status(frames[-1], out.width, frames[:-1]))
        return
    with _client(socket) as c:
        frame = c.stats()
        if json_out:
            print(json.dumps(frame, indent=2))
            return
        # the last seconds of the flight recorder, so rate findings (preemptions/s…) can be made
        history = c.history(since=frame["ts"] - 10.0).get("frames", [])
    out.print(render_status(frame, out.width, history))


def _checked_urls(urls: list[str] | None) -> list[str] | None:
    """Every --url parsed before anything is read: one that cannot be used is one line, not a traceback."""
    from kvtop.urls import checked_url

    try:
        return [checked_url(u) for u in urls] if urls else urls
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _metrics_frames(url: str | None, engine: str | None, socket: Path | None, window: float) -> list[dict]:
    """An engine's /metrics scraped once a second for `window` seconds, as partial frames, oldest
    first: the last one is shown, rates (Prometheus' `rate()`) and findings are over them all."""
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
        source.poll()  # the first: a page that cannot be read is the error
    except SourceUnavailable as exc:
        source.close()
        raise CLIError(f"cannot read {source.url}: {exc}") from None
    try:
        _every_second_for(window, source.poll, now=False)
    except SourceUnavailable:
        pass  # it went away meanwhile: what was read is shown
    finally:
        source.close()
    return source.history()


def _every_second_for(window: float, poll, now: bool = True) -> None:
    """`poll()` now (unless `now` is False: the caller just did), then once a second until `window`
    seconds have passed (a tick a slow poll overran is skipped: at most `window` plus one poll)."""
    start = time.monotonic()
    if now:
        poll()
    tick = 1
    while tick <= window:
        time.sleep(max(0.0, start + tick - time.monotonic()))
        poll()
        tick = max(tick + 1, int(time.monotonic() - start) + 1)


def _fleet_status(urls: list[str], engine: str | None, socket: Path | None, json_out: bool, window: float) -> None:
    """Every target scraped at once, once a second for `window` seconds (rates over them); one line each."""
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
        _every_second_for(window, fleet.poll)
        rows = fleet.rows
    finally:
        fleet.close()
    if json_out:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        out.print(fleet_table(rows))
    if all(r.state != "ok" for r in rows):
        raise CLIError("no engine answered")


def drain(
    socket: SocketOption = None,
    timeout: Annotated[
        float | None, typer.Option(help="Give up (exit 1) after this many seconds (at most 86400, a day).")
    ] = None,
    abort_after: Annotated[
        bool, typer.Option("--abort-after", help="At the timeout, abort what is left (finish reason abort).")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
) -> None:
    """Stop admitting new requests and wait while those in flight finish. Exit 0 once drained."""
    from kvtop.protocol.config import MAX_DRAIN_TIMEOUT_S

    if timeout is not None and not 0 <= timeout <= MAX_DRAIN_TIMEOUT_S:  # nan, inf and 1e309 (inf) too
        raise typer.BadParameter(
            f"{timeout:g} is not a number of seconds from 0 to {MAX_DRAIN_TIMEOUT_S:g} (a day)", param_hint="--timeout"
        )
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


def resume(socket: SocketOption = None) -> None:
    """Admit new requests again after a drain."""
    with _client(socket) as c:
        r = c.resume()
    out.print(f"engine {r['state']}")


def evict(
    seq: Annotated[str | None, typer.Option("--seq", help="Take back this sequence's KV blocks.")] = None,
    requeue: Annotated[bool, typer.Option(help="With --seq: recompute it later instead of aborting it.")] = False,
    prefix_cache: Annotated[bool, typer.Option("--prefix-cache", help="Drop every free cached prefix block.")] = False,
    blocks: Annotated[int | None, typer.Option(help="Drop this many least recently used cached blocks.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    wait: Annotated[
        float,
        typer.Option(
            help="With --seq: wait this many seconds (0 to 60) for the engine to apply the eviction at its "
            "next step; past it, say it is queued."
        ),
    ] = EVICT_WAIT_S,
    socket: SocketOption = None,
) -> None:
    """Free KV memory: one sequence (aborted or requeued), or cached prefix blocks."""
    if sum([seq is not None, prefix_cache, blocks is not None]) != 1:
        raise CLIError("give exactly one of --seq ID, --prefix-cache or --blocks N")
    if requeue and seq is None:
        raise CLIError("--requeue goes with --seq ID")
    if blocks is not None and blocks < 1:
        raise CLIError("--blocks must be at least 1")
    if not 0 <= wait <= MAX_EVICT_WAIT_S:  # nan and inf too
        raise CLIError(f"--wait must be a number of seconds from 0 to {MAX_EVICT_WAIT_S:g}")
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
        body = {"seq_id": seq, "requeue": requeue, "wait_s": wait} if seq is not None else (
            {"prefix_cache": True} if prefix_cache else {"blocks": blocks}
        )  # fmt: skip
        r = c.evict(**body)
    if r["evicted"] == "sequence" and not r.get("applied", True):
        out.print(
            f"queued the eviction of {r['seq_id']}" + (" (requeue)" if r.get("requeue") else "")
            + f": the engine applies it at its next step, which has not come in {wait:g} s"
        )  # fmt: skip
    elif r["evicted"] == "sequence":
        out.print(f"evicted {r['seq_id']}" + (" (requeued)" if r.get("requeue") else ""))
    else:
        out.print(f"dropped {r['blocks']} cached prefix blocks")


def snapshot(
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            help="Write here (default: the server's snapshot dir). A directory (or a path ending in /, which must "
            "be one that exists) gets a fresh name in it.",
        ),
    ] = None,
    reason: Annotated[str, typer.Option(help="Why: recorded in the snapshot.")] = "manual",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file (a regular file only).")] = False,
    socket: SocketOption = None,
) -> None:
    """Write a snapshot: the flight recorder's frames, events, sequences and block table.
    An existing file is never replaced without --force; missing directories are not created
    (`-o missing/` is refused, not written as a file named `missing`)."""
    path = _snapshot_path(output) if output is not None else None
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


def _snapshot_path(output: str) -> str:
    """The path the server is asked to write: absolute (the server has its own cwd), its last
    part not resolved, so a symlink there is refused by the server rather than followed here; a
    trailing / kept, since it says the path is a directory (kvtop.protocol.snapshot.check_target)."""
    text = str(Path(output).expanduser().absolute()) + ("/" if output.endswith("/") and output != "/" else "")
    if not _is_text(text):
        shown = text.encode("utf-8", "backslashreplace").decode()
        raise CLIError(f"the snapshot path {shown} is not valid UTF-8: the engine takes text paths, rename it")
    return text
