"""The top two lines: which engine, in what state, how fast; and where the frames come from."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from kvtop.widgets import fmt, series
from kvtop.widgets.view import View

STATE_STYLES = {"running": "bold green", "draining": "bold yellow", "drained": "bold red"}


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


class EngineHeader(Static):
    """Line 1: model, device, engine state, uptime, steps/s. Line 2: the source's status."""

    def show(self, view: View | None, status: Text) -> None:
        line = Text.assemble(("kvtop ", "bold reverse"), " ")
        if view is None:
            line.append("waiting for the first frame…", "italic")
        else:
            e = view.frame.get("engine", {})
            state = e.get("state", "?")
            steps = series.latest_rate(view.history, "engine.step")
            line.append_text(
                Text.assemble(
                    (str(e.get("model", "?")), "bold"),
                    "  ",
                    f"{e.get('device', '?')} {e.get('dtype', '')}".rstrip(),
                    "  ",
                    (f"● {state}", STATE_STYLES.get(state, "bold")),
                    drain_detail(view.frame),
                    f"  up {fmt.duration(e.get('uptime_s'))}",
                    f"  {fmt.rate(steps)} steps/s",
                    f"  step {e.get('step', 0)}",
                    f"  {fmt.clock(view.frame.get('ts'))}",
                )
            )
        line.no_wrap = True
        line.overflow = "ellipsis"
        status.no_wrap = True
        status.overflow = "ellipsis"
        self.update(Text("\n").join([line, status]))
