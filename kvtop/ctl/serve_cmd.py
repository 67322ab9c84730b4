"""`kvctl serve`: the OpenAI API, Prometheus metrics and the control socket around one engine.

Every server knob is a ServerConfig field, declared once here as an option (`SERVER_OPTIONS`, its
default taken from ServerConfig) and handed to the command as one `ServerConfig`.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path
from typing import Annotated

import typer

from kvtop.ctl.engine_gate import load_engine
from kvtop.ctl.options import SOCKET_HELP, with_engine_options, with_options
from kvtop.protocol.config import TRIGGERS, EngineConfig, ServerConfig

_S = "Server"
PER_IP_HELP = (
    "Open connections from one client address; beyond them new ones get 503 "
    "(default: max-num-seqs + max-queue, at least 64, at most half of max-connections)."
)


def _opt(help: str, *names: str, **kwargs) -> object:
    return typer.Option(*names, help=help, rich_help_panel=_S, **kwargs)


SERVER_OPTIONS: dict[str, tuple[object, object]] = {
    "host": (str, _opt("Address of the OpenAI API.")),
    "port": (int, _opt("Port of the OpenAI API (0: any free one).")),
    "socket": (Path | None, _opt(SOCKET_HELP, "--socket")),
    "api_key": (str | None, _opt("Require 'Authorization: Bearer KEY' on /v1.", envvar="KVTOP_API_KEY")),
    "max_queue": (int, _opt("Requests that may wait beyond max-num-seqs; more get 429.")),
    "stats_interval": (float, _opt("Seconds between flight-recorder frames.")),
    "history": (float, _opt("Seconds of frames the flight recorder keeps.")),
    "drain_timeout": (float, _opt("On SIGTERM: drain this long, abort the rest, exit.")),
    "snapshot_dir": (Path | None, _opt("Where snapshots go (default: $KVTOP_CACHE/snapshots).")),
    "snapshot_on": (str | None, _opt(f"Automatic snapshots, comma-separated: {', '.join(TRIGGERS)}.")),
    "storm_preemptions": (int, _opt("preemption-storm: this many preemptions ...")),
    "storm_window": (float, _opt("... within this many seconds.")),
    "slo_ttft": (float, _opt("slo-breach: TTFT P99 over the last minute above this (s).")),
    "slo_itl": (float, _opt("slo-breach: ITL P99 over the last minute above this (s).")),
    "snapshot_cooldown": (float, _opt("Seconds before the same trigger fires again.")),
    "max_request_body": (str, _opt("Largest request body (bytes or e.g. 8MiB); more gets 413.")),
    "read_timeout": (float, _opt("Seconds for a request's headers, and that a body may go silent; then 408.")),
    "request_timeout": (float, _opt("Seconds for a whole request (headers and body) from its first byte; then 408.")),
    "max_connections": (int, _opt("Open connections; beyond them new ones get 503.")),
    "max_connections_per_ip": (int | None, _opt(PER_IP_HELP)),
    "warmup": (bool, _opt("One full-size step before serving: the first requests skip its first-time costs.")),
}
# the flag's default where it is not ServerConfig's: unset means "the server decides", or text
_DEFAULTS = {"socket": None, "api_key": None, "snapshot_dir": None, "snapshot_on": None, "max_request_body": "8MiB",
             "max_connections_per_ip": None}  # fmt: skip
SERVER_DEFAULTS = {
    **{f.name: f.default for f in fields(ServerConfig) if f.name in SERVER_OPTIONS and f.default is not MISSING},
    **_DEFAULTS,
}


def server_config(snapshot_dir: Path | None, snapshot_on: str | None, api_key: str | None, **values) -> ServerConfig:
    """The flags as a ServerConfig (its checks raise ConfigError: one line, from kvctl's main)."""
    if snapshot_dir:
        values["snapshot_dir"] = snapshot_dir.expanduser().resolve()
    return ServerConfig(snapshot_on=ServerConfig.parse_triggers(snapshot_on), api_key=api_key or None, **values)


@with_engine_options
@with_options(SERVER_OPTIONS, SERVER_DEFAULTS, server_config, "server")
def serve(
    log_level: Annotated[str, typer.Option(help="uvicorn log level.", rich_help_panel=_S)] = "warning",
    *,
    server: ServerConfig,
    config: EngineConfig,
) -> None:
    """Serve the OpenAI API, Prometheus metrics and the stats/control socket until SIGTERM."""
    app = load_engine("engine.server.app", "serve")
    raise typer.Exit(app.serve(config, server, log_level=log_level))
