"""The block map: one cell per KV block, coloured by state, or one cell per range when zoomed out.

At one block per cell a cell is the block's DESIGN §6 character (`.` free, `c` cached, `u` used,
`s` shared, `o` offloaded). When the cache has more blocks than the panel has cells, a cell
summarises a range: its colour is the range's dominant state and its glyph the share of the range
that is not free (`.` none, `░` ≤⅓, `▒` ≤⅔, `▓` most, `█` all). `z`/`Z` zoom in and out (then the
map scrolls); the selected sequence's blocks are drawn in reverse video.

An engine that serves its KV usage and no per-block state (vLLM, SGLang over `/metrics`) gets a
strip instead, labelled as derived: the share of its blocks in use, across the panel — how full
the cache is, not where the used blocks lie or which are cached.
"""

from __future__ import annotations

import textwrap
from itertools import groupby

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content

from kvtop import fmt
from kvtop.blocks import summarise  # the fold kvctl status uses too: a range reads the same on both
from kvtop.dashboard.widgets.view import LinesStatic, View, set_border

STRIP_ROWS = 3  # the usage strip's height


def legend() -> Text:
    parts = []
    for ch, name in fmt.BLOCK_NAMES.items():
        parts.append(Text.assemble((ch, f"bold {fmt.BLOCK_STYLES[ch]}"), f" {name}"))
    return Text("  ").join(parts)


def render_cells(chars: str, per_cell: int, width: int, highlight: set[int], offset: int = 0) -> list[Text]:
    """Rows of `width` cells; block ids in `highlight` (offset by `offset`) drawn reversed."""
    if per_cell == 1:
        cells = [(c, c, offset + i in highlight) for i, c in enumerate(chars)]
    else:
        cells = []
        for lo in range(0, len(chars), per_cell):
            chunk = chars[lo : lo + per_cell]
            state, glyph = summarise(chunk)
            hit = bool(highlight) and any(offset + b in highlight for b in range(lo, lo + len(chunk)))
            cells.append((state, glyph, hit))
    rows = []
    for start in range(0, len(cells), width):
        row = Text()
        for (state, hit), run in groupby(cells[start : start + width], key=lambda c: (c[0], c[2])):
            style = fmt.BLOCK_STYLES.get(state, "")
            row.append("".join(glyph for _, glyph, _ in run), f"bold reverse {style}" if hit else style)
        rows.append(row)
    return rows


def strip_parts(kv: dict) -> list[tuple[str, int]]:
    """(map character, blocks) in the order the strip draws them: the counts by state where the
    frame has them (ours over /metrics), else used and free from the usage over the block count
    (over 100 hundredths of the pool where the engine counts no blocks, as SGLang's tokens)."""
    if "free" in kv:
        return [(ch, kv.get(fmt.BLOCK_NAMES[ch], 0)) for ch in "usc."]
    total = kv.get("num_blocks") or 100
    used = min(total, round(kv["usage"] * total))
    return [("u", used), (".", total - used)]


def _glyph(ch: str) -> str:
    return "░" if ch == "." else "█"


def _cells(counts: list[int], width: int) -> list[int]:
    """`width` cells shared in proportion to `counts` (largest remainders), a nonzero count never 0 cells."""
    total = sum(counts) or 1
    exact = [c * width / total for c in counts]
    cells = [int(e) for e in exact]
    for i in sorted(range(len(counts)), key=lambda i: exact[i] - cells[i], reverse=True)[: width - sum(cells)]:
        cells[i] += 1
    for i, c in enumerate(counts):
        if c and not cells[i]:
            j = max(range(len(cells)), key=lambda k: cells[k])
            cells[i], cells[j] = 1, cells[j] - 1
    return cells


class BlockMap(VerticalScroll):
    """The KV pool, device blocks then the CPU tier's, as a scrollable grid."""

    DEFAULT_CLASSES = "panel"
    can_focus = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.view: View | None = None
        self.per_cell = 1
        self._drawn_size = (0, 0)  # the content region the map was last drawn for
        self.border_title = "Block map"

    def compose(self) -> ComposeResult:
        yield LinesStatic(id="block-grid")

    def fit_per_cell(self, nblocks: int, width: int, height: int) -> int:
        cells = max(1, width * max(1, height))
        return max(1, -(-nblocks // cells))

    def show(self, view: View) -> None:
        self.view = view
        if not self.children:  # mounting or being removed: nothing to draw into (the next frame draws)
            return
        width = self.scrollable_content_region.width
        height = self.scrollable_content_region.height
        if width <= 0:
            return
        self._drawn_size = (width, height)
        kv = view.frame.get("kv", {})
        if "blocks" not in kv and (kv.get("usage") is not None or "free" in kv):
            self.show_strip(view.frame, width)
            return
        chars: str = kv.get("blocks", "")
        ndev = kv.get("num_blocks", len(chars))
        device, host = chars[:ndev], chars[ndev:]
        rows_avail = height - 1 - (1 if host else 0)
        fit = self.fit_per_cell(len(chars), width, rows_avail)
        zoom = view.state.zoom
        self.per_cell = fit if zoom <= 0 or zoom >= fit else zoom
        highlight: set[int] = set()
        if view.state.selected_seq:
            for s in view.frame.get("sequences", []):
                if s.get("id") == view.state.selected_seq:
                    highlight = set(s.get("block_ids", []))
        out = [legend(), *render_cells(device, self.per_cell, width, highlight)]
        if host:
            out.append(Text(f"── CPU tier: {len(host)} blocks ──", "bold"))
            out.extend(render_cells(host, self.per_cell, width, set()))
        scale = "1 block per cell" if self.per_cell == 1 else f"1 cell = {self.per_cell} blocks"
        sel = f"{view.state.selected_seq}: {len(highlight)} blocks" if highlight else ""
        title = f"Block map · {ndev} blocks · {scale}" + (" (fit)" if self.per_cell == fit else "")
        set_border(self, title, Content(sel))  # the id is a client's or a file's: never markup
        self.query_one("#block-grid", LinesStatic).paint(fmt.lines(out), layout=True)

    def show_strip(self, frame: dict, width: int) -> None:
        """The strip of an engine that serves no per-block state (see the module docstring)."""
        kv = frame["kv"]
        parts = strip_parts(kv)
        total = sum(n for _, n in parts)
        blocks = bool(kv.get("num_blocks") or "free" in kv)  # else hundredths of a pool counted in tokens
        bar = Text()
        for (ch, _), cells in zip(parts, _cells([n for _, n in parts], width), strict=True):
            bar.append(_glyph(ch) * cells, fmt.BLOCK_STYLES[ch])
        legend = Text("  ").join(
            Text.assemble((_glyph(ch), fmt.BLOCK_STYLES[ch]), f" {n:,}{'' if blocks else ' %'} {fmt.BLOCK_NAMES[ch]}")
            for ch, n in parts
        )
        note = next((line for line in frame.get("unavailable", []) if "block map" in line), "no block map")
        basis = "its counts by state" if "free" in kv else f"the KV usage, {fmt.pct(kv['usage'])}"
        said = f"derived from {basis}: {note}; this says how full, not where"
        out = [
            legend,
            *[bar] * STRIP_ROWS,
            *[Text(line, "italic") for line in textwrap.wrap(said, max(8, width))],
        ]
        count = f"{total:,} blocks · " if blocks else ""
        set_border(self, f"Block map · {count}derived from {'counts' if 'free' in kv else 'usage'}", "")
        self.query_one("#block-grid", LinesStatic).paint(fmt.lines(out), layout=True)

    def zoom(self, direction: int) -> None:
        """+1 halves the blocks per cell (down to one), -1 doubles them (up to fitting the panel)."""
        if self.view is None:
            return
        state = self.view.state
        if direction > 0:
            state.zoom = max(1, self.per_cell // 2)
        else:
            state.zoom = self.per_cell * 2
        self.show(self.view)

    def on_resize(self) -> None:
        self.call_after_refresh(self._redraw)

    def _redraw(self) -> None:
        """After a resize, the view the map has *then*: a view taken at the resize can be frames
        old when this runs (a replay's first frame drawn over the `G` pressed meanwhile, its
        selection lost); the same size as last drawn draws the same map, so nothing is done."""
        region = self.scrollable_content_region
        if self.view is not None and (region.width, region.height) != self._drawn_size:
            self.show(self.view)
