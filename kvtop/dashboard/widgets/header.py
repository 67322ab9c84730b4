"""The top three lines: which engine, in what state, how fast; where the frames come from; and
what the frame shows at a glance (requests running and waiting, rejections, the diagnosis).

While the engine is unreachable, its state is not known: line 1 says `✖ unreachable since …`
in place of the state, uptime and steps/s of the last frame, and line 3 is dimmed as the last
frame's.
"""

from __future__ import annotations

import time

from rich.text import Text

from kvtop import fmt
from kvtop.dashboard.widgets import series
from kvtop.dashboard.widgets.view import LinesStatic, View
from kvtop.diagnosis import diagnose

STATE_STYLES = {"running": "bold green", "draining": "bold yellow", "drained": "bold red"}
REJECT_CODES = {"queue_full": "429", "draining": "503"}


def drain_detail(frame: dict) -> str:
    """While draining: what is left and when the deadline comes (from the server's part of the frame)."""
    server = frame.get("server") or {}
    drain = server.get("drain")
    if frame.get("engine", {}).get("state") == "running" or not drain:
        return ""
    left = f" ({server.get('in_flight', len(frame.get('sequences', [])))} in flight"
    if drain.get("deadline"):
        then = "abort" if drain.get("abort_after") else "timeout"
        left += f", {then} in {fmt.duration(max(0.0, drain['deadline'] - frame.get('ts', 0)))}"
    return left + ")"


def rejected_summary(frame: dict) -> str:
    """`12 rejected (429 ×10, 503 ×2)`, or "" when the server has refused nothing (or is not a server)."""
    rejected = {k: v for k, v in ((frame.get("server") or {}).get("rejected") or {}).items() if v}
    if not rejected:
        return ""
    parts = ", ".join(f"{code} ×{v}" for code, v in sorted((REJECT_CODES.get(k, k), v) for k, v in rejected.items()))
    return f"{sum(rejected.values())} rejected ({parts})"


def engine_line(view: View, unreachable_since: float | None) -> Text:
    e = view.frame.get("engine", {})
    line = Text.assemble(
        (str(e.get("model", "?")), "bold"),
        "  ",
        f"{e.get('device', e.get('kind', '?'))} {e.get('dtype', '')}".rstrip(),
        "  ",
    )
    if unreachable_since is not None:
        ago = fmt.duration(time.time() - unreachable_since)
        line.append(f"✖ unreachable since {fmt.clock(unreachable_since)} ({ago})", "bold red")
        step = f", step {e['step']}" if "step" in e else ""
        line.append(f"  last frame {fmt.clock(view.frame.get('ts'))}{step}", "dim")
        return line
    state = e.get("state", "?")
    line.append_text(
        Text.assemble(
            (f"● {state}", STATE_STYLES.get(state, "bold")),
            drain_detail(view.frame),
            f"  up {fmt.duration(e.get('uptime_s'))}",
            # another engine's /metrics counts no steps: neither a step nor a rate of them
            f"  {fmt.rate(series.latest_rate(view.history, 'engine.step'))} steps/s" if "step" in e else "",
            f"  step {e['step']}" if "step" in e else "",
            f"  {fmt.clock(view.frame.get('ts'))}",
        )
    )
    return line


def glance_line(view: View, stale: bool) -> Text:
    """Running and waiting requests, rejections, and the first finding of the diagnosis."""
    s = view.frame.get("scheduler") or {}
    # a count the frame lacks (another engine's /metrics, a value that was not one) is –, not 0
    running, waiting = (fmt.NONE if s.get(k) is None else s[k] for k in ("running", "waiting"))
    counts = f"{running} running · {waiting} waiting"
    rejected = rejected_summary(view.frame)
    if rejected:
        counts += f" · {rejected}"
    findings = diagnose(view.frame, view.history[:-1])
    line = Text.assemble((counts, "bold"), "  ")
    if findings:
        more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
        line.append_text(Text.assemble(("⚠ ", "bold yellow"), findings[0], more))
    else:
        line.append("✓ nothing stands out", "green")
    if stale:
        line = Text.assemble("last frame: ", line)
        line.stylize("dim")
    return line


class EngineHeader(LinesStatic):
    """Line 1: model, device, engine state, uptime, steps/s. Line 2: the source's status.
    Line 3: requests running / waiting, rejections, the diagnosis."""

    unreachable_since: float | None = None  # set by the screen while the engine cannot be reached

    def show(self, view: View | None, status: Text) -> None:
        line = Text.assemble(("kvtop ", "bold reverse"), " ")
        if view is None:
            line.append("waiting for the first frame…", "italic")
            glance = Text("")
        else:
            line.append_text(engine_line(view, self.unreachable_since))
            glance = glance_line(view, stale=self.unreachable_since is not None)
        rows = [line, status, glance]
        for row in rows:
            row.no_wrap = True
            row.overflow = "ellipsis"
        self.paint(Text("\n").join(rows))
