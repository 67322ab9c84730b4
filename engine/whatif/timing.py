"""How long a simulated step takes.

`StepTimeModel`: t = a + b·prefill_tokens + c·decode_seqs + d·context_tokens (seconds), fitted by
least squares with every coefficient kept non-negative, to a recording's own steps (or to a
`kvctl calibrate` run, saved as JSON); plus the median gap between busy steps (the loop's own
time: sampling, outputs, the server's frames), which a step is followed by when more work waits.
Its error on the steps it was fitted to is reported with it. `RecordedTiming`: the recorded
steps' own durations and gaps, in order — with it, simulating the recorded configuration must
reproduce the recorded schedule exactly (the self-check's strict form).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from engine.errors import EngineError
from engine.telemetry.trace import StepShape
from kvtop.protocol.stats_math import percentile
from kvtop.protocol.trace import StepRecord

MIN_STEPS = 20  # fewer steps than this fit nothing worth trusting
TERMS = ("const", "prefill_tokens", "decode_seqs", "context_tokens")
CALIBRATION_FORMAT = 1


class TimingError(EngineError):
    """No step-time model: too few steps to fit one, or a calibration file that cannot be read."""


@dataclass
class StepTimeModel:
    coef: tuple[float, float, float, float]  # seconds: per step, per prefill token, per decode, per context token
    gap_s: float  # between a step and the next when work waits
    steps: int = 0  # fitted on this many
    mape: float | None = None  # mean |error| / actual over those steps
    p90_error: float | None = None  # 90th percentile of |error| / actual
    total_error: float | None = None  # (predicted - actual) summed over the steps, relative
    source: str = ""

    def duration(self, shape: StepShape) -> float:
        a, b, c, d = self.coef
        return a + b * shape.prefill_tokens + c * shape.decode_seqs + d * shape.context_tokens

    def step(self, index: int, shape: StepShape) -> tuple[float, float]:
        return self.duration(shape), self.gap_s

    def first_start(self, first_arrival: float) -> float:
        return first_arrival

    def idle_until(self, index: int, next_arrival: float) -> float:
        return next_arrival

    def describe(self) -> str:
        a, b, c, d = self.coef
        text = (
            f"step = {a * 1e3:.2f} ms + {b * 1e6:.1f} µs × prefill token + {c * 1e6:.1f} µs × decode "
            f"+ {d * 1e9:.1f} ns × context token; {self.gap_s * 1e3:.2f} ms between steps"
        )
        if self.mape is not None:
            text += (
                f" — fitted on {self.steps} steps of {self.source}: mean error {self.mape * 100:.1f} %, "
                f"P90 {self.p90_error * 100:.1f} %, total {self.total_error * 100:+.1f} %"
            )
        return text

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"format": CALIBRATION_FORMAT, **asdict(self)}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepTimeModel:
        try:
            d = json.loads(Path(path).read_text())
            if d.pop("format", None) != CALIBRATION_FORMAT:
                raise ValueError("not a kvctl calibrate file")
            model = cls(**d)
            model.coef = tuple(float(x) for x in model.coef)
            if len(model.coef) != len(TERMS) or min(model.coef) < 0 or float(model.gap_s) < 0:
                raise ValueError("bad coefficients")
            return model
        except (OSError, ValueError, TypeError) as exc:
            raise TimingError(
                f"{path}: not a step-time calibration ({exc}); write one with `kvctl calibrate`"
            ) from None


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients: refit without the terms that came out
    negative until none does (an active set; exact for these few, well-scaled terms)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active = [a for a, s in zip(active, sol, strict=True) if s > 0] if (sol > 0).any() else []
    return coef


def busy_gaps(steps: list[StepRecord]) -> list[float]:
    """The recorded time between one step's end and the next's start, where the engine went
    straight on (a gap longer than the step before it and 50 ms is an idle wait, not overhead)."""
    gaps = []
    for s, nxt in pairwise(steps):
        gap = nxt.start - s.end
        if nxt.step == s.step + 1 and 0 <= gap <= max(0.05, s.duration):
            gaps.append(gap)
    return gaps


def fit(steps: list[StepRecord], source: str = "the recording") -> StepTimeModel:
    """A step-time model fitted to `steps`; TimingError when there are too few to fit."""
    if len(steps) < MIN_STEPS:
        raise TimingError(
            f"{source} holds {len(steps)} steps, too few to fit a step-time model (at least {MIN_STEPS}): "
            "pass --calibration FILE (written by `kvctl calibrate` on this machine and model)"
        )
    x = np.array([[1.0, s.prefill_tokens, s.decode_seqs, s.context_tokens] for s in steps])
    y = np.array([s.duration for s in steps])
    scale = np.maximum(x.max(axis=0), 1.0)  # columns of ones and of thousands: solve on equal footing
    coef = _nnls(x / scale, y) / scale
    predicted = x @ coef
    rel = np.abs(predicted - y) / np.maximum(y, 1e-6)
    gaps = busy_gaps(steps)
    return StepTimeModel(
        coef=tuple(float(c) for c in coef),
        gap_s=float(np.median(gaps)) if gaps else 0.0,
        steps=len(steps),
        mape=float(rel.mean()),
        p90_error=percentile(rel, 90),
        total_error=float((predicted.sum() - y.sum()) / max(y.sum(), 1e-9)),
        source=source,
    )


class RecordedTiming:
    """The recorded steps' durations and the gaps after them, step by step: the clock of the
    recording itself. Past the recorded steps (a what-if that takes more), `fallback` times them."""

    def __init__(self, steps: list[StepRecord], fallback: StepTimeModel | None = None) -> None:
        self.steps = steps
        self.fallback = fallback

    def first_start(self, first_arrival: float) -> float:
        return max(first_arrival, self.steps[0].start) if self.steps else first_arrival

    def step(self, index: int, shape: StepShape) -> tuple[float, float]:
        if index < len(self.steps):
            s = self.steps[index]
            gap = self.steps[index + 1].start - s.end if index + 1 < len(self.steps) else 0.0
            return s.duration, max(0.0, gap)
        if self.fallback is None:
            raise TimingError("the simulation ran past the recorded steps: give a step-time model")
        return self.fallback.step(index, shape)

    def idle_until(self, index: int, next_arrival: float) -> float:
        if index < len(self.steps):
            return max(next_arrival, self.steps[index].start)
        return next_arrival
