"""ServerConfig: every knob of `kvctl serve` that is not an engine knob, with its default."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import parse_size
from engine.errors import ConfigError, EngineError

TRIGGERS = ("preemption-storm", "slo-breach", "queue-full")
DEFAULT_MAX_REQUEST_BODY = 8 * 1024**2
DEFAULT_READ_TIMEOUT = 5.0
DEFAULT_REQUEST_TIMEOUT = 30.0
DAY_S, WEEK_S = 86400.0, 7 * 86400.0

# Every duration: (its lowest value, whether that value itself is allowed, its highest). A duration
# reaches deadlines, Retry-After and countdowns: nan, inf and 1e309 must stop here, in one line.
SECONDS_BOUNDS = {
    "stats_interval": (0.0, False, 3600.0),
    "history": (0.0, False, WEEK_S),
    "drain_timeout": (0.0, True, DAY_S),
    "storm_window": (0.0, False, DAY_S),
    "slo_ttft": (0.0, False, DAY_S),
    "slo_itl": (0.0, False, DAY_S),
    "snapshot_cooldown": (0.0, True, WEEK_S),
    "read_timeout": (0.0, False, DAY_S),
    "request_timeout": (0.0, False, DAY_S),
}


def default_snapshot_dir() -> Path:
    from engine.paths import cache_dir

    return cache_dir() / "snapshots"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (reported in the startup summary and /v1/healthz)
    socket: Path | None = None  # None: KVTOP_SOCKET, else the default path (kvtop.client)
    api_key: str | None = None
    max_queue: int = 256  # requests waiting beyond the max_num_seqs that can run
    stats_interval: float = 0.5  # seconds between flight-recorder frames
    history: float = 600.0  # seconds of frames the flight recorder keeps
    drain_timeout: float = 30.0  # SIGTERM: drain this long, then abort what is left and exit
    snapshot_dir: Path = field(default_factory=default_snapshot_dir)
    snapshot_on: tuple[str, ...] = ()
    storm_preemptions: int = 20  # preemption storm: this many preemptions ...
    storm_window: float = 10.0  # ... within this many seconds
    slo_ttft: float = 2.0  # SLO breach: TTFT P99 over the last minute above this (s) ...
    slo_itl: float = 0.5  # ... or ITL P99 above this (s)
    slo_min_requests: int = 5  # ... once the minute holds at least this many samples
    snapshot_cooldown: float = 300.0  # seconds before the same trigger fires again
    max_request_body: int | str = DEFAULT_MAX_REQUEST_BODY  # bytes or "8MiB"; a bigger body gets 413
    read_timeout: float = DEFAULT_READ_TIMEOUT  # headers must be whole, and a body may not go silent, this long
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT  # headers + body whole this long after their first byte
    max_connections: int = 1024  # open connections; beyond it new ones get 503 (app.py's ConnectionLimits)
    max_connections_per_ip: int | None = None  # from one client address, beyond it 503; None: connections_per_ip()
    warmup: bool = True  # one full-budget step before serving (engine/warmup.py)

    def __post_init__(self) -> None:
        self._check_durations()
        self.max_request_body = parse_size(self.max_request_body)
        if self.max_request_body is None or self.max_request_body < 1024:
            raise ConfigError("max_request_body must be at least 1KiB")
        if self.max_connections < 1 or (self.max_connections_per_ip or 1) < 1:
            raise ConfigError("max_connections and max_connections_per_ip must be >= 1")
        unknown = [t for t in self.snapshot_on if t not in TRIGGERS]
        if unknown:
            raise ConfigError(f"unknown snapshot trigger {', '.join(unknown)}: use {', '.join(TRIGGERS)}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is not in 0..65535")
        if self.max_queue < 0:
            raise ConfigError("max_queue must be >= 0")
        if self.history < self.stats_interval:
            raise ConfigError("history must be at least one stats interval (seconds)")
        if self.storm_preemptions < 1:
            raise ConfigError("storm_preemptions must be >= 1")

    def _check_durations(self) -> None:
        for name, (low, low_allowed, high) in SECONDS_BOUNDS.items():
            value = getattr(self, name)
            above_low = value >= low if low_allowed else value > low
            if not (math.isfinite(value) and above_low and value <= high):  # nan fails every comparison
                lowest = f"from {low:g}" if low_allowed else f"above {low:g}"
                raise ConfigError(f"{name} {value:g} is not a number of seconds {lowest} to {high:g}")

    def connections_per_ip(self, max_num_seqs: int) -> int:
        """The open connections one client address may hold. By default enough to fill the server
        (max_num_seqs + max_queue, and never under 64), so that one client, or a gateway in front,
        meets a full queue (429) before this limit; but at most half of max_connections, so that
        one address can never hold every connection."""
        if self.max_connections_per_ip is not None:
            return self.max_connections_per_ip
        return max(1, min(max(64, max_num_seqs + self.max_queue), self.max_connections // 2))

    @staticmethod
    def parse_triggers(value: str | None) -> tuple[str, ...]:
        if not value:
            return ()
        return tuple(t.strip() for t in value.split(",") if t.strip())


class ServeError(EngineError):
    """The server cannot start as asked (socket taken, port busy, bad setting)."""
