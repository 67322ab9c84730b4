"""What every panel is handed to draw: the frame shown, the frames before it, and the view state.

`ViewState` is the operator's choices (selected sequence, sort, filter, zoom, latency range); it
lives on the app so that it survives the layout being rebuilt when the terminal is resized.
`Panel` is the base of the panels that draw a frame as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

from rich.console import RenderableType
from rich.text import Text
from textual.content import Content
from textual.geometry import Region
from textual.widget import Widget
from textual.widgets import Static

SORT_COLUMNS = ("id", "state", "prompt", "output", "cached", "blocks", "kv", "age", "ttft", "itl")


@dataclass
class ViewState:
    selected_seq: str | None = None
    sort: str = "age"
    sort_reverse: bool = True
    filter: str = ""
    zoom: int = 0  # blocks per map cell; 0 = fit the whole cache in the panel
    latency_all: bool = False  # histogram bars since start instead of the last minute
    verbose_events: bool = False


@dataclass
class View:
    frame: dict
    history: list[dict]  # frames up to and including `frame`, oldest first
    events: list[dict]  # events up to the frame, oldest first
    state: ViewState = field(default_factory=ViewState)


def set_border(widget: Widget, title: str | Content | None = None, subtitle: str | Content | None = None) -> None:
    """Set a border title and subtitle (None: leave it), only where it changes: Textual repaints
    the whole widget on every set, so a panel setting its title each frame was drawn whole each
    frame. A str is markup, as for `border_title`; ids and file names go in as `Content`."""
    for name, value in (("border_title", title), ("border_subtitle", subtitle)):
        if value is not None and getattr(widget, name) != widget.render_str(value).markup:
            setattr(widget, name, value)


class LinesStatic(Static):
    """A Static of fixed size that repaints only the lines that changed.

    `Static.update` marks the whole widget dirty, so each frame would re-render every line of
    every panel (most of kvtop's CPU). `paint` compares the new text with the last line by line
    and hands Textual just the changed lines; identical text repaints nothing.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._drawn: RenderableType | None = None
        self._dirty_lines: list[Region] | None = None

    def paint(self, content: RenderableType, layout: bool = False) -> None:
        """Show `content`; `layout` where the widget's height follows its number of lines."""
        old, self._drawn = self._drawn, content
        if isinstance(old, Text) and isinstance(content, Text):
            before, after = old.split("\n", allow_blank=True), content.split("\n", allow_blank=True)
            width = max(1, self.size.width)
            # a line wider than the widget wraps onto the next screen rows: then text line y is not
            # screen row y, and repainting row y alone would leave stale rows below it on a terminal
            fits = all(line.cell_len <= width for line in (*before, *after))
            if fits and len(before) == len(after):
                self._dirty_lines = [Region(0, y, width, 1) for y, (a, b) in enumerate(zip(before, after)) if a != b]
                if not self._dirty_lines:
                    self._dirty_lines = None
                    return
        try:
            self.update(content, layout=layout and self._dirty_lines is None)
        finally:
            self._dirty_lines = None

    def refresh(self, *regions: Region, **kwargs) -> Self:
        if not regions and self._dirty_lines and not kwargs.get("layout"):
            regions = tuple(self._dirty_lines)
        return super().refresh(*regions, **kwargs)


class Panel(LinesStatic):
    """A bordered panel that redraws itself from a View (and again when resized)."""

    DEFAULT_CLASSES = "panel"
    TITLE = ""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.view: View | None = None
        self.border_title = self.TITLE

    def show(self, view: View) -> None:
        self.view = view
        if self.size.width:
            self.paint(self.draw(view, max(1, self.content_size.width), max(1, self.content_size.height)))

    def draw(self, view: View, width: int, height: int) -> RenderableType:
        raise NotImplementedError

    def on_resize(self) -> None:
        if self.view is not None:
            self.show(self.view)
