"""Fault injection for tests and drills: make chosen model steps raise, through an environment
variable, so the engine's failure handling is exercised on the real path.

    KVTOP_FAULT_INJECT="step=5"          the 6th step (0-based 5) raises
    KVTOP_FAULT_INJECT="step=5,9"        steps 5 and 9 raise
    KVTOP_FAULT_INJECT="every=50"        every 50th step raises
    KVTOP_FAULT_INJECT="token=31337"     any step carrying a sequence whose prompt holds token 31337
    KVTOP_FAULT_INJECT="stall=5"         every step waits 5 s before the model runs (a slow device: the
                                         state between steps holds still long enough to read it everywhere)

Unset (the default), it costs one attribute check per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.runtime.knobs import knob
from kvtop.protocol.errors import ConfigError

ENV = "KVTOP_FAULT_INJECT"


class InjectedFault(RuntimeError):
    """Raised inside a step on purpose."""


@dataclass
class FaultInjector:
    steps: set[int] = field(default_factory=set)
    every: int = 0
    token: int | None = None
    stall: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.steps or self.every or self.token is not None or self.stall)

    @classmethod
    def from_env(cls) -> FaultInjector:
        spec = knob(ENV)
        if not spec:
            return cls()
        key, _, value = spec.partition("=")
        try:
            if key == "step":
                return cls(steps={int(v) for v in value.split(",")})
            if key == "every":
                return cls(every=int(value))
            if key == "token":
                return cls(token=int(value))
            if key == "stall":
                return cls(stall=float(value))
        except ValueError:
            pass
        raise ConfigError(f"{ENV}={spec!r}: use step=N[,M…], every=N, token=ID or stall=SECONDS")

    def maybe_fail(self, step: int, batch) -> None:
        if not self.active:
            return
        if self.stall:
            time.sleep(self.stall)  # outside the engine lock: stats, /metrics and control still answer
        if step in self.steps or (self.every and step % self.every == self.every - 1):
            raise InjectedFault(f"injected fault at step {step} ({ENV})")
        if self.token is not None and any(self.token in s.prompt_token_ids for s in batch.seqs):
            raise InjectedFault(f"injected fault: a request carries token {self.token} ({ENV})")
