"""The engine's drain: one state machine, owned by `LLMEngine` (`engine.drain_state`) and read by
the server (its admission, the drain deadline, the frame's `engine.state` and `server.drain`).

    running ──drain──► draining ──nothing left in flight──► drained
       ▲                  │                                    │
       └──── resume ──────┴────────────────────────────────────┘

While not running the engine admits nothing (`EngineDrainingError`); requests in flight finish.
A drain may carry a deadline after which what is left is aborted (`DrainInfo`, which the server's
loop enforces between steps).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass


class EngineState(enum.StrEnum):
    """The frame's `engine.state` (kvtop/protocol/frame.py's `EngineState` names the same three);
    a str, so the wire and every comparison with the strings see the same values."""

    RUNNING = "running"
    DRAINING = "draining"
    DRAINED = "drained"


@dataclass
class DrainInfo:
    """A drain in progress (the frame's `server.drain`): when it began, its deadline, and whether
    requests still in flight at the deadline are aborted."""

    started: float
    timeout_s: float | None = None
    deadline: float | None = None  # cleared once the deadline has aborted what was left
    abort_after: bool = False
    aborted: int = 0


class Drain:
    """The state and the legal moves between its three values; each move that changes the state
    records its event (`drain_started`, `drain_finished`, `resumed`). Callers hold the engine's lock."""

    def __init__(self, event: Callable[..., object]) -> None:
        self.state = EngineState.RUNNING
        self.info: DrainInfo | None = None
        self._event = event

    def start(self, in_flight: int, timeout_s: float | None = None, abort_after: bool = False) -> None:
        """running → draining (drained at once when nothing is in flight). A drain already under
        way keeps its start; a new timeout replaces its deadline; `abort_after` sticks."""
        now = time.time()
        if self.state is EngineState.RUNNING or self.info is None:
            self.info = DrainInfo(started=now)
        if timeout_s is not None:
            self.info.timeout_s, self.info.deadline = timeout_s, now + timeout_s
        if abort_after:
            self.info.abort_after = True
        if self.state is EngineState.RUNNING:
            self.state = EngineState.DRAINING
            self._event("drain_started", None, f"{in_flight} requests in flight")
        self.settle(in_flight)

    def settle(self, in_flight: int) -> None:
        """draining → drained once nothing is left in flight."""
        if self.state is EngineState.DRAINING and not in_flight:
            self.state = EngineState.DRAINED
            self._event("drain_finished")

    def resume(self) -> None:
        """draining or drained → running; the drain's record goes."""
        if self.state is not EngineState.RUNNING:
            self.state = EngineState.RUNNING
            self._event("resumed")
        self.info = None

    def deadline_passed(self, now: float) -> bool:
        """A deadline with `abort_after` has come and has not yet aborted anything."""
        info = self.info
        return bool(info and info.abort_after and info.deadline is not None and now >= info.deadline)

    def note_aborted(self, n: int) -> None:
        """The deadline aborted `n` requests; it fires once."""
        if self.info is not None:
            self.info.aborted += n
            self.info.deadline = None

    def as_dict(self) -> dict | None:
        """The frame's `server.drain`."""
        return None if self.info is None else asdict(self.info)
