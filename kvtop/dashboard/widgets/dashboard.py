"""The panels' layout, chosen by the terminal's size and rebuilt when it crosses a threshold.

wide (≥140×40): every panel at once (sequences across the middle, latency down the side).
overview (≥110×34, e.g. 120×40 over SSH): two tabs — the overview (KV cache, block map,
sequences, prefix cache, latency) and rates & events (throughput, memory, events).
tabs (down to 60×18, e.g. 80×24): five tabs. `1`–`5` name the same panels in both tabbed
layouts (in overview, 1–3 are the overview and 4–5 the rates). small: one clear message asking
for a bigger terminal. Panel state that must survive a rebuild lives in the screen's ViewState.
"""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.containers import Container, Horizontal, Vertical
from textual.filter import ANSIToTruecolor, Monochrome, NoColor
from textual.widgets import Static, TabbedContent, TabPane

from kvtop.dashboard.messages import LayoutRebuilt
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.events import EventsPanel
from kvtop.dashboard.widgets.kv_panel import KVPanel
from kvtop.dashboard.widgets.latency import LatencyPanel
from kvtop.dashboard.widgets.memory import MemoryPanel
from kvtop.dashboard.widgets.prefix_panel import PrefixPanel
from kvtop.dashboard.widgets.sequences import SequencesPanel
from kvtop.dashboard.widgets.throughput import ThroughputPanel

WIDE = (140, 40)
OVERVIEW = (110, 34)
MIN = (60, 18)
TABS = (  # id, title
    ("tab-kv", "1 KV"),
    ("tab-seqs", "2 Sequences"),
    ("tab-latency", "3 Latency"),
    ("tab-cache", "4 Cache & rates"),
    ("tab-system", "5 Memory & events"),
)
OVERVIEW_TABS = (("tab-overview", "1-3 Overview"), ("tab-rates", "4-5 Rates, memory & events"))
OVERVIEW_OF_TAB = (0, 0, 0, 1, 1)  # which overview tab holds each of the five tabs' panels


def layout_for(width: int, height: int) -> str:
    if width < MIN[0] or height < MIN[1]:
        return "small"
    if width >= WIDE[0] and height >= WIDE[1]:
        return "wide"
    if width >= OVERVIEW[0] and height >= OVERVIEW[1]:
        return "overview"
    return "tabs"


def without_colour(app: App) -> None:
    """Under NO_COLOR Textual still draws in greys (its Monochrome filter): a terminal that asked
    for no colour gets none. Every colour becomes the terminal's default; bold, dim and reverse
    stay (the truecolor filter, which turns dim into a fainter colour, goes too), and the
    characters carry the meaning anyway."""
    if app.no_color:
        kept = [f for f in app._filters if not isinstance(f, Monochrome | ANSIToTruecolor | NoColor)]
        app._filters = [*kept, NoColor()]


class Dashboard(Container):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.mode: str | None = None
        self.rebuilding = False  # panels half-mounted: no key or frame may reach them

    def on_mount(self) -> None:
        without_colour(self.app)

    def compose(self) -> ComposeResult:
        if self.mode is None:
            self.mode = layout_for(*self.app.size)
        if self.mode == "small":
            w, h = self.app.size
            yield Static(
                f"Terminal too small: {w}×{h}.\n"
                f"kvtop needs at least {MIN[0]}×{MIN[1]} (80×24 is comfortable).\n"
                "Enlarge the window, or press q to quit.",
                id="too-small",
            )
        elif self.mode == "wide":
            with Horizontal(id="wide"):
                with Vertical(id="col-main"):
                    with Horizontal(id="row-kv"):
                        yield KVPanel(id="kv")
                        yield BlockMap(id="blockmap")
                    yield SequencesPanel(id="sequences")
                    with Horizontal(id="row-rates"):
                        yield ThroughputPanel(id="throughput")
                        yield MemoryPanel(id="memory")
                    yield EventsPanel(id="events")
                with Vertical(id="col-side"):
                    yield PrefixPanel(id="prefix")
                    yield LatencyPanel(id="latency")
        elif self.mode == "overview":
            with TabbedContent(id="tabs"):
                with TabPane(OVERVIEW_TABS[0][1], id=OVERVIEW_TABS[0][0]), Horizontal():
                    with Vertical(id="col-main"):
                        with Horizontal(id="row-kv"):
                            yield KVPanel(id="kv")
                            yield BlockMap(id="blockmap")
                        yield SequencesPanel(id="sequences")
                    with Vertical(id="col-side"):
                        yield PrefixPanel(id="prefix")
                        yield LatencyPanel(id="latency")
                with TabPane(OVERVIEW_TABS[1][1], id=OVERVIEW_TABS[1][0]), Vertical():
                    with Horizontal(id="row-rates"):
                        yield ThroughputPanel(id="throughput")
                        yield MemoryPanel(id="memory")
                    yield EventsPanel(id="events")
        else:
            with TabbedContent(id="tabs"):
                with TabPane(TABS[0][1], id=TABS[0][0]), Horizontal():
                    yield KVPanel(id="kv")
                    yield BlockMap(id="blockmap")
                with TabPane(TABS[1][1], id=TABS[1][0]):
                    yield SequencesPanel(id="sequences")
                with TabPane(TABS[2][1], id=TABS[2][0]):
                    yield LatencyPanel(id="latency")
                with TabPane(TABS[3][1], id=TABS[3][0]), Vertical():
                    yield PrefixPanel(id="prefix")
                    yield ThroughputPanel(id="throughput")
                with TabPane(TABS[4][1], id=TABS[4][0]), Vertical():
                    yield MemoryPanel(id="memory")
                    yield EventsPanel(id="events")

    async def on_resize(self) -> None:
        mode = layout_for(*self.app.size)
        if mode != self.mode:
            self.mode = mode
            self.rebuilding = True
            try:
                await self.recompose()
            finally:
                self.rebuilding = False
            self.refresh_bindings()  # the footer hid the panels' keys while they could not fire
            self.post_message(LayoutRebuilt(mode))

    def show_tab(self, index: int) -> bool:
        """Switch to tab `index` (1-based); False where there are no tabs."""
        if self.mode not in ("tabs", "overview") or not 1 <= index <= len(TABS):
            return False
        tab = TABS[index - 1] if self.mode == "tabs" else OVERVIEW_TABS[OVERVIEW_OF_TAB[index - 1]]
        self.query_one(TabbedContent).active = tab[0]
        return True
