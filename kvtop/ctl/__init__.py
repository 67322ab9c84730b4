"""kvctl: the typer CLI and its commands (serve, run, status, bench, plan, completion, demo...)."""
