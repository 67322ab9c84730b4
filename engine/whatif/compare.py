"""One what-if, whole: the recorded figures, the recorded configuration simulated (the
self-check), and the what-if configuration simulated — three columns under the same names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.whatif.config import SimConfig, recorded_config, whatif_config
from engine.whatif.figures import recorded_figures, simulated_figures
from engine.whatif.sim import simulate
from engine.whatif.timing import StepTimeModel, fit
from kvtop.protocol.errors import ConfigError
from kvtop.protocol.trace_file import Trace, TraceError

SELF_CHECK = ("ttft_p50_s", "e2e_p50_s", "output_tokens_per_s")  # what the self-check compares


@dataclass
class Comparison:
    recorded: dict
    simulated: dict
    whatif: dict
    recorded_config: SimConfig
    whatif_config: SimConfig
    timing: StepTimeModel
    load: float
    notes: list[str] = field(default_factory=list)

    def columns(self) -> dict[str, dict]:
        return {"recorded": self.recorded, "simulated": self.simulated, "whatif": self.whatif}

    def self_check(self) -> dict[str, float | None]:
        """Simulated / recorded - 1 for each SELF_CHECK figure (None where either is missing)."""
        out = {}
        for key in SELF_CHECK:
            r, s = self.recorded.get(key), self.simulated.get(key)
            out[key] = (s / r - 1.0) if r and s is not None else None
        return out


def parse_load(text: str | float | None) -> float:
    """`1.5x`, `1.5` or `150%` -> 1.5: arrivals that many times as dense."""
    if text is None:
        return 1.0
    raw = str(text).strip().lower()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw.removesuffix("x"))
    except ValueError:
        raise ConfigError(f"--load {text!r}: use a factor such as 1.5x (arrivals 1.5 times as dense)") from None
    if not 0 < value < 1e6:
        raise ConfigError(f"--load {text!r} must be above 0")
    return value


def require_config(trace: Trace) -> None:
    if trace.config is None:
        raise TraceError(
            f"{trace.source} carries no engine configuration (a client's trace): what-if needs the engine's "
            "KV size and knobs — record it from a kvtop engine (a snapshot) or copy a snapshot trace's header"
        )


def compare(
    trace: Trace,
    overrides: dict,
    load: float = 1.0,
    timing: StepTimeModel | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> Comparison:
    """The three columns. `timing`: a calibration; else a model fitted to the trace's steps
    (TimingError when it has too few)."""
    require_config(trace)
    base = recorded_config(trace.config)
    target = whatif_config(trace.config, **overrides)
    model = timing or fit(trace.steps, f"{trace.source}")
    notes = []
    if trace.config.get("kv_cache_dtype") != target.kv_cache_dtype or base.block_size != target.block_size:
        notes.append(
            "step times are the recorded configuration's: a KV dtype's or block size's own speed is not modeled"
        )
    cb = (lambda label: lambda done, total: progress(label, done, total)) if progress else (lambda label: None)
    simulated = simulated_figures(simulate(trace, base, model, progress=cb("self-check")))
    whatif = simulated_figures(simulate(trace, target, model, load=load, progress=cb("what-if")))
    return Comparison(recorded_figures(trace), simulated, whatif, base, target, model, load, notes)
