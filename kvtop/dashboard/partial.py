"""What the panels draw from a partial frame (another engine's `/metrics`), and which collapse.

A frame from `/metrics` carries `unavailable`, the engine's own notes ("vLLM exposes no
per-sequence table"). Where the engine serves something near what a panel shows, the panel draws
that, labelled as derived: the block map a strip of used and free blocks from the KV usage
(`widgets/block_map.py`), the sequences panel the running and waiting counts (waiting by reason)
and the finished requests' lengths and queue times from the engine's histograms. A panel fed
nothing at all shows the note that names it in one line — and collapses, where a panel beside it
can take the space; the KV panel lists what collapsed. Frames from our own socket (no
`unavailable`) are drawn as always.
"""

from __future__ import annotations

import textwrap

from rich.text import Text
from textual.widget import Widget
from textual.widgets import Static

from kvtop import fmt
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.sequences import SequencesPanel, SequencesTable
from kvtop.dashboard.widgets.view import LinesStatic, View
from kvtop.sources.mappings import engine_label

# panel id: (is its data missing from the frame, words that pick its note, the note otherwise)
PANELS = {
    "blockmap": (
        lambda f: "blocks" not in (f.get("kv") or {}) and (f.get("kv") or {}).get("usage") is None,
        "block map",
        "{} exposes no block map",
    ),
    "sequences": (
        lambda f: not f.get("sequences") and not running_known(f),
        "per-sequence",
        "no per-sequence table from {}'s /metrics",
    ),
    "latency": (lambda f: not f.get("latency"), "latency", "{} exposes no latency histograms"),
    "prefix": (lambda f: not f.get("prefix"), "prefix", "{} exposes no prefix-cache counts"),
    "memory": (lambda f: not f.get("memory"), "memory", "{}'s /metrics carries no memory figures"),
}
STAYS = ("events", "throughput")  # fed by every engine (events derived from counters): never collapse
PANEL_NAMES = {"blockmap": "block map", "sequences": "sequences", "latency": "latency", "prefix": "prefix cache",
               "memory": "memory"}  # fmt: skip


def running_known(frame: dict) -> bool:
    """The frame counts running requests, though it lists none (another engine's scheduler gauges)."""
    return (frame.get("scheduler") or {}).get("running") is not None


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
    engine says, then one line for what it does not — not a column of dashes — and the panels that
    collapsed for want of figures. None for a frame with block counts."""
    kv = frame.get("kv") or {}
    if "unavailable" not in frame or any(k in kv for k in ("used", "shared", "cached", "free")):
        return None
    usage = kv.get("usage")
    gauge = fmt.gauge(usage, max(4, width - 14)) if usage is not None else fmt.NONE
    facts = [
        ("blocks", f"{kv['num_blocks']:,}" + (f" × {kv['block_size']} tokens" if "block_size" in kv else ""))
        if "num_blocks" in kv
        else None,
        ("dtype", str(kv["dtype"])) if kv.get("dtype") else None,
        ("tokens", f"{kv['used_tokens']:,} used") if "used_tokens" in kv else None,
    ]
    rows: list[Text | str] = [Text.assemble(("usage ", "bold"), gauge, f" {fmt.pct(usage):>6}")]
    rows += [fmt.label_value(label, value, 7) for label, value in filter(None, facts)]
    said = f"{engine_label(frame)} serves no block counts by state (used, cached, free)"
    rows += [Text(line, "italic") for line in textwrap.wrap(said, max(8, width))]
    if unfed := [PANEL_NAMES[p] for p in PANEL_NAMES if note_for(p, frame)]:
        rows += [
            Text(line, "dim italic") for line in textwrap.wrap(f"no figures for: {', '.join(unfed)}", max(8, width))
        ]
    return fmt.lines(rows)


def _recent(h: dict | None) -> tuple[dict, str]:
    """A histogram's last minute where requests finished in it, else everything since start, and
    which of the two it is."""
    h = h or {}
    win = h.get("window") or {}
    if win.get("count"):
        return win, f"last {win['seconds']:.0f} s, {win['count']:,} requests"
    return h, f"since start, {h.get('count') or 0:,} requests"


def _quantiles(h: dict, show) -> str:
    return " · ".join(f"{p.upper()} {show(h[p])}" for p in ("p50", "p95", "p99") if h.get(p) is not None)


def requests_summary(frame: dict, width: int) -> Text:
    """The sequences panel of an engine that serves counts, not sequences: running and waiting (by
    reason) with a bar of their shares, and the finished requests' prompt and output lengths and
    time in the queue (the last minute's where requests finished in it). Lengths are quantiles
    within the engine's buckets, hence ≈."""
    s = frame.get("scheduler") or {}
    reasons = [f"{s[k]} {name}" for k, name in (("waiting_for_capacity", "for capacity"),
                                                ("waiting_deferred", "deferred")) if s.get(k) is not None]  # fmt: skip
    waiting = f"{fmt.count(s.get('waiting'))} waiting" + (f" ({', '.join(reasons)})" if reasons else "")
    running, queued = s.get("running") or 0, s.get("waiting") or 0
    bar_w = max(4, width - 2)
    run_cells = round(bar_w * running / (running + queued)) if running + queued else 0
    bar = Text.assemble(("█" * run_cells, "green"), ("░" * (bar_w - run_cells) if running + queued else "", "yellow"))
    req = frame.get("requests") or {}
    rows = [
        Text.assemble((f"{fmt.count(s.get('running'))} running", "bold green"), " · ", (waiting, "bold yellow")),
        bar,
    ]
    for label, h, show in (
        ("prompt", req.get("prompt_tokens"), lambda v: f"≈{v:,.0f}"),
        ("output", req.get("generation_tokens"), lambda v: f"≈{v:,.0f}"),
        ("queued", (frame.get("latency") or {}).get("queue"), fmt.secs),
    ):
        shown, span = _recent(h)
        said = _quantiles(shown, show)
        unit = " tokens" if label != "queued" else ""
        if said:
            rows.append(fmt.label_value(label, f"{said}{unit} ({span})", 8))
        else:
            rows.append(fmt.label_value(label, fmt.NONE + (" (none finished yet)" if h else " (not served)"), 8))
    turned_away, preempted = s.get("rejections_total"), s.get("preemptions_total")
    if turned_away is not None or preempted is not None:
        since = f"start: {fmt.count(preempted)} preempted · {fmt.count(turned_away)} turned away by a queue limit"
        rows.append(fmt.label_value("since", since, 8))
    rows.append(
        Text(f"derived: {engine_label(frame)} serves no per-sequence table — its counts and histograms", "dim italic")
    )
    return fmt.lines(rows)


def _collapses(panel: Widget, frame: dict) -> bool:
    """A panel fed nothing collapses where a panel beside it is fed and takes the space (in the
    80×24 tabs a panel alone in its tab keeps its one line: an empty tab would say less)."""
    if panel.id in STAYS or note_for(panel.id, frame) is None or panel.parent is None:
        return False
    return any(
        sibling is not panel and (sibling.id in STAYS or note_for(sibling.id, frame) is None)
        for sibling in panel.parent.children
    )


def _in_flux(panel: Widget) -> bool:
    """`panel` is being mounted (a block map or sequences panel before its children) or removed.
    Textual marks every node of a subtree it removes, then takes them away one by one: a panel can
    have lost its table and kept its note, so its children alone cannot tell."""
    if isinstance(panel, BlockMap | SequencesPanel) and not panel.children:
        return True
    return any(getattr(node, "_pruning", False) for node in panel.ancestors_with_self)


def draw(panel: Widget, view: View) -> None:
    """Draw `panel` from `view`: its figures, what a partial frame has in their place, or the one
    line that says why it cannot be drawn (collapsed where another panel can use its space)."""
    if _in_flux(panel):
        return  # mounting or being removed (a layout rebuilt, the dashboard going): drawn next frame
    collapse = _collapses(panel, view.frame)
    if panel.display == collapse:
        panel.display = not collapse
    kv = kv_partial(view.frame, max(1, panel.content_size.width)) if panel.id == "kv" else None
    if kv is not None and isinstance(panel, LinesStatic):
        panel.paint(kv)
        return
    note = note_for(panel.id, view.frame)
    if (
        isinstance(panel, SequencesPanel)
        and note is None
        and "unavailable" in view.frame
        and not view.frame.get("sequences")
    ):
        _sequences_instead(panel, requests_summary(view.frame, max(1, panel.content_size.width)))  # counts, no list
        return
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
        _sequences_instead(panel, line)
    elif isinstance(panel, LinesStatic):
        panel.paint(line)


def _sequences_instead(panel: SequencesPanel, content: Text) -> None:
    """The sequences panel showing `content` where its table would be."""
    panel.border_title = "Sequences"
    panel.query_one(SequencesTable).display = False
    notes = panel.query(".absent-note")
    if notes:
        notes.first(Static).update(content)
    else:
        panel.mount(Static(content, classes="absent-note"))
