"""How `kvctl` and `kvtop` end: an error a user can hit is one line on stderr and an exit status,
never a traceback or typer's boxed panel. Both entry points run their typer app through `run_cli`.

Exit statuses: 2 when no engine answers (and click's usage errors), 130 on ^C, 1 for the rest
(`CLIError` carries its own). A crash — an exception nothing expected, kvtop's own bug or one a
hostile input brings out, and the exception that ended the dashboard (`KvtopApp.run`) — is one
line and status 1 too: its traceback goes to a file under the cache dir (`crash_report`).
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback

import typer
from rich.console import Console
from rich.markup import escape

from kvtop.client import EngineRequestError, EngineUnavailable
from kvtop.protocol.errors import KvtopError


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit status `code`."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _fail(prog: str, message: str, code: int) -> None:
    try:
        Console(stderr=True).print(f"[red]{prog}:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    except OSError:  # stderr went away too (a closed terminal): the status still says it
        pass
    sys.exit(code)


def crash_report(prog: str, exc: BaseException) -> str:
    """One line naming `exc`, and where its traceback was written (KVTOP_CACHE or ~/.cache/kvtop,
    `crashes/PROG-TIME-PID.txt`): a bug report needs the traceback, a terminal needs one line."""
    from kvtop.protocol.paths import cache_dir

    said = re.sub(r"\s+", " ", f"{type(exc).__name__}: {exc}").strip().rstrip(":")
    said = said if len(said) <= 200 else said[:199] + "…"
    path = cache_dir() / "crashes" / f"{prog}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(exc)))
    except OSError as write_error:
        return f"{said} (the traceback could not be kept: {write_error.strerror or write_error})"
    return f"{said} (traceback in {path})"


def run_cli(app: typer.Typer, prog: str, argv: list[str] | None = None) -> None:
    """Run `app` as the program `prog`; exits with the command's status."""
    try:
        code = app(args=argv, prog_name=prog, standalone_mode=False)
    except typer.TyperException as exc:  # usage errors: one line, not typer's boxed panel
        if not exc.format_message():  # no arguments: the help was printed, nothing to add
            sys.exit(exc.exit_code)
        ctx = getattr(exc, "ctx", None)
        where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        _fail(prog, exc.format_message() + where, exc.exit_code)
    except typer.Abort:
        _fail(prog, "aborted", 1)
    except KeyboardInterrupt:
        _fail(prog, "interrupted", 130)
    except CLIError as exc:
        _fail(prog, str(exc), exc.code)
    except EngineUnavailable as exc:
        _fail(prog, str(exc), 2)
    except EngineRequestError as exc:
        _fail(prog, f"the engine refused: {exc}", 1)
    except KvtopError as exc:  # a bad file, a model that will not load, a budget that does not fit
        _fail(prog, str(exc), 1)
    except OSError as exc:  # the terminal went away mid-write, a file that cannot be written
        _fail(prog, str(exc), 1)
    except Exception as exc:  # a crash: one line, the traceback in a file
        _fail(prog, f"crashed: {crash_report(prog, exc)}", 1)
    if isinstance(code, int) and code:
        sys.exit(code)
