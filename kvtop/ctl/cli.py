"""kvctl: the operator's command line. Each command is a thin shell over a library function, in
a module of its own: run_cmd (offline batch), serve_cmd, control_cmds (status, drain, resume,
evict, snapshot), bench_cmd, plan_cmd, completion; replay is here. `main` is the entry point."""

import importlib
from pathlib import Path
from typing import Annotated, ClassVar

import typer
from typer.core import TyperGroup

from kvtop.ctl import control_cmds, run_cmd, serve_cmd
from kvtop.ctl.bench_cmd import bench_app
from kvtop.entry import CLIError, run_cli

__all__ = ["CLIError", "app", "main"]


class _Commands(TyperGroup):
    """kvctl's command group, with the commands of the engine's tools loaded only when used (run,
    or listed by --help), so that `kvctl status`, `drain` or a completion stay instant. No kvtop
    module imports the engine: those that run it load it through kvtop/ctl/engine_gate.py."""

    LAZY: ClassVar[dict[str, tuple[str, str]]] = {
        "plan": ("kvtop.ctl.plan_cmd", "plan_command"),
        "completion": ("kvtop.ctl.completion", "completion_command"),  # it reads this app: no import loop
        "record": ("kvtop.ctl.record", "record_command"),  # issue #15: any engine's /metrics into a .kvsnap
        "whatif": ("kvtop.ctl.whatif_cmd", "whatif_command"),  # issue #37: a recorded workload, another configuration
        "calibrate": ("kvtop.ctl.calibrate_cmd", "calibrate_command"),  # issue #37: whatif's step times, measured
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


app.command("run")(run_cmd.run)
app.command("serve")(serve_cmd.serve)
for _command in (control_cmds.status, control_cmds.drain, control_cmds.resume, control_cmds.evict,
                 control_cmds.snapshot):  # fmt: skip
    app.command()(_command)
app.add_typer(bench_app, name="bench")


@app.command()
def replay(file: Annotated[Path, typer.Argument(help="A .kvsnap snapshot file.")]) -> None:
    """Open a snapshot in the kvtop dashboard (after checking it is a readable snapshot)."""
    from kvtop.protocol.snapshot_reader import SnapshotReader

    SnapshotReader(file).close()  # a quick look, not a load: SnapshotError is one line and exit 1 (main)
    from kvtop.dashboard import cli as dashboard

    raise typer.Exit(dashboard.main(["--replay", str(file)]) or 0)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and a non-zero exit, never a traceback."""
    run_cli(app, "kvctl", argv)


if __name__ == "__main__":
    main()
