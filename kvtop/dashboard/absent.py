"""Panels a partial frame cannot feed (another engine's `/metrics`): one line saying so, not zeros.

A frame from `/metrics` carries `unavailable`, the engine's own notes ("vLLM exposes no block
map"). A panel whose data the frame lacks shows the note that names it, or a plain one built from
the engine's name; frames from our own socket (no `unavailable`) are drawn as always.
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget
from textual.widgets import Static

from kvtop import fmt
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.sequences import SequencesPanel, SequencesTable
from kvtop.dashboard.widgets.view import LinesStatic, View

# panel id: (is its data missing from the frame, words that pick its note, the note otherwise)
PANELS = {
    "blockmap": (lambda f: "blocks" not in (f.get("kv") or {}), "block map", "{} exposes no block map"),
    "sequences": (lambda f: not f.get("sequences"), "per-sequence", "no per-sequence table from {}'s /metrics"),
    "latency": (lambda f: not f.get("latency"), "latency", "{} exposes no latency histograms"),
    "prefix": (lambda f: not f.get("prefix"), "prefix", "{} exposes no prefix-cache counts"),
    "memory": (lambda f: not f.get("memory"), "memory", "{}'s /metrics carries no memory figures"),
    "events": (lambda f: not f.get("events"), "events", "/metrics carries counts, not events: none derived yet"),
}


def engine_label(frame: dict) -> str:
    from kvtop.sources.mappings import all_mappings

    kind = (frame.get("engine") or {}).get("kind") or "the engine"
    return next((m.label for m in all_mappings() if m.kind == kind), kind)


def note_for(panel_id: str | None, frame: dict) -> str | None:
    """The one line `panel_id` shows instead of its figures, or None when the frame feeds it."""
    if "unavailable" not in frame or panel_id not in PANELS:
        return None
    missing, words, default = PANELS[panel_id]
    if not missing(frame):
        return None
    said = next((line for line in frame["unavailable"] if words in line), None)
    return said or default.format(engine_label(frame))


def kv_partial(frame: dict, width: int) -> Text | None:
    """The KV panel of a frame without block counts by state (vLLM, SGLang, llama.cpp): what the
    engine says, then one line for what it does not — not a column of dashes. None otherwise."""
    kv = frame.get("kv") or {}
    if "unavailable" not in frame or any(k in kv for k in ("used", "shared", "cached", "free")):
        return None
    usage = kv.get("usage")
    gauge = fmt.gauge(usage, max(4, width - 14)) if usage is not None else fmt.NONE
    facts = [
        f"{kv['num_blocks']} blocks" if "num_blocks" in kv else "",
        f"{kv['block_size']} tok/block" if "block_size" in kv else "",
        str(kv["dtype"]) if kv.get("dtype") else "",
        f"{kv['used_tokens']:,} tokens used" if "used_tokens" in kv else "",
    ]
    rows = [Text.assemble(("usage ", "bold"), gauge, f" {fmt.pct(usage):>6}")]
    if any(facts):
        rows.append(fmt.label_value("cache", " · ".join(f for f in facts if f), 6))
    rows.append(Text(f"{engine_label(frame)} serves no block counts by state (used, cached, free)", "italic"))
    return fmt.lines(rows)


def draw(panel: Widget, view: View) -> None:
    """Draw `panel` from `view`, or the one line that says why it cannot be drawn."""
    kv = kv_partial(view.frame, max(1, panel.content_size.width)) if panel.id == "kv" else None
    if kv is not None and isinstance(panel, LinesStatic):
        panel.paint(kv)
        return
    note = note_for(panel.id, view.frame)
    if note is None:
        if isinstance(panel, SequencesPanel):
            panel.query_one(SequencesTable).display = True
            panel.query(".absent-note").remove()
        panel.show(view)  # type: ignore[attr-defined]
        return
    line = Text(note, "italic")
    if isinstance(panel, BlockMap):
        panel.border_title = "Block map"
        panel.query_one("#block-grid", LinesStatic).paint(line, layout=True)  # its height follows its lines
    elif isinstance(panel, SequencesPanel):
        panel.border_title = "Sequences"
        panel.query_one(SequencesTable).display = False
        notes = panel.query(".absent-note")
        if notes:
            notes.first(Static).update(line)
        else:
            panel.mount(Static(line, classes="absent-note"))
    elif isinstance(panel, LinesStatic):
        panel.paint(line)
