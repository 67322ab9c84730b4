"""Events: the latest preemptions, evictions, drains, aborts and snapshots, newest last.

Times are relative to the frame shown (`-3.2s`), so a replayed incident reads the same as a live
one. `v` adds the routine events (admitted, scheduled, first token, finished).
"""

from __future__ import annotations

from rich.text import Text

from kvtop.sources import NOTABLE_EVENTS
from kvtop.widgets import fmt
from kvtop.widgets.view import Panel, View

KIND_STYLES = {
    "preempted": "bold red",
    "evicted": "yellow",
    "prefix_evicted": "yellow",
    "aborted": "red",
    "drain_started": "bold yellow",
    "drain_finished": "bold yellow",
    "resumed": "bold green",
    "snapshot": "bold cyan",
}


class EventsPanel(Panel):
    TITLE = "Events"

    def draw(self, view: View, width: int, height: int) -> Text:
        verbose = view.state.verbose_events
        events = [e for e in view.events if verbose or e.get("kind") in NOTABLE_EVENTS]
        self.border_title = f"Events ({'all' if verbose else 'notable'}; v toggles)"
        if not events:
            return fmt.lines([Text("no notable events yet" if not verbose else "no events yet", "dim italic")])
        now = view.frame.get("ts", 0)
        shown = events[-height:]
        id_width = min(max((len(e.get("seq_id") or "") for e in shown), default=0), max(12, width - 40))
        rows = []
        for e in shown:
            kind = e.get("kind", "?")
            rows.append(
                Text.assemble(
                    (f"{e.get('ts', now) - now:>+8.1f}s ", "dim"),
                    (f"{kind:<14}", KIND_STYLES.get(kind, "")),
                    (f"{(e.get('seq_id') or '')[:id_width]:<{id_width}} ", "bold"),
                    str(e.get("detail") or ""),
                )
            )
        return fmt.lines(rows, height)
