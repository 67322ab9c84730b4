"""Events derived from an engine's numbers where it serves none (vLLM, SGLang, llama.cpp over /metrics).

    from kvtop.derived import derive, derive_all
    derive(before, after)    # the events between two frames of one engine run
    derive_all(frames)       # over a recording, oldest first

Our engine logs its events; the others serve counters and gauges only. Between two frames, a
counter that rose or a gauge that crossed a line is an event kvtop can name: preemptions (the
counter's increase, `preempted`), the KV usage rising to `KV_FULL` or past it (`kv_full`), the
queue growing by `QUEUE_JUMP` or more (`queue_grew`). Each is marked `derived: True` and its
detail starts with "derived:", so that no one reads it as the engine's own log; its time is the
later frame's (the engine did it somewhere in between). Frames of two engine runs derive
nothing (a restart begins its counters again).
"""

from __future__ import annotations

from itertools import pairwise

from kvtop.diagnosis import KV_FULL
from kvtop.rates import figure, same_run

QUEUE_JUMP = 4  # requests: the queue growing by this many between two frames is an event
DERIVED_KINDS = ("preempted", "kv_full", "queue_grew")


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
    u0, u1 = figure(before, "kv.usage"), figure(after, "kv.usage")
    if u0 is not None and u1 is not None and u0 < KV_FULL <= u1:
        out.append(
            _event(after, "kv_full", f"KV usage {u0 * 100:.1f} % → {u1 * 100:.1f} %, past {KV_FULL * 100:.0f} %")
        )
    w0, w1 = figure(before, "scheduler.waiting"), figure(after, "scheduler.waiting")
    if w0 is not None and w1 is not None and w1 - w0 >= QUEUE_JUMP:
        out.append(_event(after, "queue_grew", f"{w1 - w0:.0f} more waiting ({w0:.0f} → {w1:.0f})"))
    return out


def derive_all(frames: list[dict]) -> list[dict]:
    """The events along frames (oldest first)."""
    return [e for a, b in pairwise(frames) for e in derive(a, b)]
