"""How `kvctl` and `kvtop` end: an error a user can hit is one line on stderr and an exit status,
never a traceback or typer's boxed panel. Both entry points run their typer app through `run_cli`.

Exit statuses: 2 when no engine answers (and click's usage errors), 130 on ^C, 1 for the rest
(`CLIError` carries its own).
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from engine.errors import EngineError
from kvtop.client import EngineRequestError, EngineUnavailable


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
    except EngineError as exc:  # a bad file, a model that will not load, a budget that does not fit
        _fail(prog, str(exc), 1)
    except OSError as exc:  # the terminal went away mid-write, a file that cannot be written
        _fail(prog, str(exc), 1)
    if isinstance(code, int) and code:
        sys.exit(code)
