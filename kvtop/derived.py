"""Events derived from an engine's numbers where it serves none (vLLM, SGLang, llama.cpp over /metrics).

    from kvtop.derived import derive, derive_all
    derive(before, after)    # the events between two frames of one engine run
    derive_all(frames)       # over a recording, oldest first

Our engine logs its events; the others serve counters and gauges only. Between two frames, a
counter that rose or a gauge that crossed a line is an event kvtop can name: preemptions (the
counter's increase, `preempted`), requests a queue limit turned away (`rejected`), the KV usage
rising to `KV_FULL` or past it (`kv_full`), the queue growing by `QUEUE_JUMP` or more
(`queue_grew`), and the prefix cache's hit rate over the last rate window falling below half of
the run's, where the run's is at least `PREFIX_HIT_WORTH` (`prefix_collapsed`: a workload that
stopped sharing its prefixes, or a cache that evicts them before they are reused). Each is marked `derived: True` and its
detail starts with "derived:", so that no one reads it as the engine's own log; its time is the
later frame's (the engine did it somewhere in between). Frames of two engine runs derive
nothing (a restart begins its counters again).
"""

from __future__ import annotations

from itertools import pairwise

from kvtop.diagnosis import KV_FULL
from kvtop.rates import figure, same_run

QUEUE_JUMP = 4  # requests: the queue growing by this many between two frames is an event
PREFIX_HIT_WORTH = 0.2  # a run's hit rate below this is no cache whose collapse is news
DERIVED_KINDS = ("preempted", "rejected", "kv_full", "queue_grew", "prefix_collapsed")


def _event(frame: dict, kind: str, detail: str) -> dict:
    return {"ts": frame["ts"], "kind": kind, "seq_id": None, "detail": f"derived: {detail}", "derived": True}


def derive(before: dict, after: dict) -> list[dict]:
    """The events between `before` and `after` (see the module docstring); [] across a restart."""
    if not same_run(before, after) or not (figure(after, "ts") or 0) > (figure(before, "ts") or 0):
        return []
    out = []
    p0, p1 = figure(before, "scheduler.preemptions_total"), figure(after, "scheduler.preemptions_total")
    if p0 is not None and p1 is not None and p1 > p0:
        out.append(_event(after, "preempted", f"{p1 - p0:.0f} preempted (the preemption counter {p0:.0f} → {p1:.0f})"))
    r0, r1 = figure(before, "scheduler.rejections_total"), figure(after, "scheduler.rejections_total")
    if r0 is not None and r1 is not None and r1 > r0:
        out.append(
            _event(after, "rejected", f"{r1 - r0:.0f} turned away by a queue limit (the counter {r0:.0f} → {r1:.0f})")
        )
    u0, u1 = figure(before, "kv.usage"), figure(after, "kv.usage")
    if u0 is not None and u1 is not None and u0 < KV_FULL <= u1:
        out.append(
            _event(after, "kv_full", f"KV usage {u0 * 100:.1f} % → {u1 * 100:.1f} %, past {KV_FULL * 100:.0f} %")
        )
    w0, w1 = figure(before, "scheduler.waiting"), figure(after, "scheduler.waiting")
    if w0 is not None and w1 is not None and w1 - w0 >= QUEUE_JUMP:
        out.append(_event(after, "queue_grew", f"{w1 - w0:.0f} more waiting ({w0:.0f} → {w1:.0f})"))
    if collapse := _prefix_collapse(before, after):
        out.append(_event(after, "prefix_collapsed", collapse))
    return out


def _prefix_collapse(before: dict, after: dict) -> str | None:
    """The event's detail where the window's hit rate fell below half the run's between the two frames."""
    recent0, recent1 = figure(before, "prefix.window_hit_rate"), figure(after, "prefix.window_hit_rate")
    run0, run1 = figure(before, "prefix.hit_rate"), figure(after, "prefix.hit_rate")
    if recent0 is None or recent1 is None or run0 is None or run1 is None or run1 < PREFIX_HIT_WORTH:
        return None
    if not (recent0 >= run0 / 2 > 0 and recent1 < run1 / 2):
        return None
    window = figure(after, "throughput.window_s") or 0.0
    return (
        f"prefix hit rate over the last {window:.0f} s {recent1 * 100:.1f} % "
        f"(was {recent0 * 100:.1f} %), below half the run's {run1 * 100:.1f} %"
    )


def derive_all(frames: list[dict]) -> list[dict]:
    """The events along frames (oldest first)."""
    return [e for a, b in pairwise(frames) for e in derive(a, b)]
