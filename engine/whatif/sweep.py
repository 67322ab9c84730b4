"""`kvctl whatif --sweep KNOB=LO..HI [--slo ...]`: one knob over a range, the what-if at each
point, and the smallest setting that meets a latency objective."""

from __future__ import annotations

import multiprocessing
import os
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed

import numpy as np

from engine.whatif.config import whatif_config
from engine.whatif.figures import simulated_figures
from engine.whatif.sim import simulate
from engine.whatif.timing import StepTimeModel
from kvtop.protocol.config import format_bytes, parse_size
from kvtop.protocol.errors import ConfigError
from kvtop.protocol.trace_file import Trace

SWEEPABLE = ("kv-cache-memory", "max-num-seqs", "max-num-batched-tokens", "load")
_SLO_RE = re.compile(r"^\s*([a-z0-9_]+)\s*=\s*([0-9.]+)\s*(ms|s)?\s*$")


def parse_sweep(text: str, points: int = 8) -> tuple[str, list[float]]:
    """`kv-cache-memory=64MiB..2GiB` -> ("kv-cache-memory", `points` values: geometric, or even for load)."""
    knob, _, span = text.partition("=")
    knob = knob.strip()
    lo_text, sep, hi_text = span.partition("..")
    if knob not in SWEEPABLE or not sep:
        raise ConfigError(f"--sweep {text!r}: use KNOB=LO..HI with KNOB one of {', '.join(SWEEPABLE)}")
    read = parse_size if knob == "kv-cache-memory" else (lambda v: float(str(v).strip().removesuffix("x")))
    try:
        lo, hi = float(read(lo_text)), float(read(hi_text))
    except (ValueError, ConfigError):
        raise ConfigError(f"--sweep {text!r}: cannot read {lo_text!r}..{hi_text!r}") from None
    if not 0 < lo < hi or points < 2:
        raise ConfigError(f"--sweep {text!r}: need 0 < LO < HI")
    if knob == "load":
        return knob, [float(v) for v in np.linspace(lo, hi, points)]
    values = np.geomspace(lo, hi, points)
    return knob, sorted({round(float(v)) for v in values})


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft_p99=2s,itl_p99=200ms` -> {"ttft_p99_s": 2.0, "itl_p99_s": 0.2}."""
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        m = _SLO_RE.match(part)
        if not m or not re.match(r"^(ttft|itl|tpot|e2e|queue)_p(50|95|99)$", m.group(1)):
            raise ConfigError(
                f"--slo part {part!r}: use e.g. ttft_p99=2s,itl_p99=200ms (ttft|itl|tpot|e2e|queue, p50|p95|p99)"
            )
        out[f"{m.group(1)}_s"] = float(m.group(2)) / (1000.0 if m.group(3) == "ms" else 1.0)
    return out


def label(knob: str, value: float) -> str:
    if knob == "kv-cache-memory":
        return format_bytes(value)
    return f"{value:g}x" if knob == "load" else f"{value:g}"


PARALLEL_FROM = 2000  # requests: a smaller trace simulates a point in well under a second, less than a worker's start


def sweep(
    trace: Trace,
    knob: str,
    values: list[float],
    overrides: dict,
    timing: StepTimeModel,
    load: float = 1.0,
    progress: Callable[[int, int], None] | None = None,
    workers: int | None = None,
) -> list[dict]:
    """The what-if figures at each value of `knob` (the other overrides held). A large trace's points
    run in parallel, one process per core (`workers`: how many; 1 runs them here, in turn)."""
    points = []
    for value in values:
        changes, point_load = dict(overrides), load
        if knob == "load":
            point_load = value
        else:
            changes[knob.replace("-", "_")] = int(value)
        points.append((whatif_config(trace.config, **changes), point_load))
    if workers is None:
        workers = min(len(points), os.cpu_count() or 1) if len(trace.requests) >= PARALLEL_FROM else 1
    figures: list[dict | None] = [None] * len(points)
    if workers <= 1:
        for i, (config, point_load) in enumerate(points):
            figures[i] = _figures_at(trace, config, timing, point_load)
            if progress is not None:
                progress(i + 1, len(points))
    else:  # spawned, not forked: the parent may hold threads (the progress bar's) and torch's state
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_figures_at, trace, c, timing, pl): i for i, (c, pl) in enumerate(points)}
            for done, future in enumerate(as_completed(futures), 1):
                figures[futures[future]] = future.result()
                if progress is not None:
                    progress(done, len(points))
    return [{"value": v, "label": label(knob, v), **f} for v, f in zip(values, figures, strict=True)]


def _figures_at(trace: Trace, config, timing: StepTimeModel, load: float) -> dict:
    """One point's figures, or its error (a point too small to hold one request)."""
    try:
        return simulated_figures(simulate(trace, config, timing, load=load))
    except ConfigError as exc:
        return {"error": str(exc)}


def meets(row: dict, slo: dict[str, float]) -> bool:
    """Every objective met, and every request served (a setting that refuses long prompts does not count)."""
    return (
        "error" not in row
        and not row["rejected"]
        and all(row.get(k) is not None and row[k] <= limit for k, limit in slo.items())
    )


def smallest_meeting(rows: list[dict], slo: dict[str, float], knob: str) -> dict | None:
    """The first row (smallest setting; for load, the largest load) meeting every objective."""
    ordered = rows[::-1] if knob == "load" else rows
    return next((r for r in ordered if meets(r, slo)), None)
