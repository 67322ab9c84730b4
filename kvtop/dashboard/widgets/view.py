"""What every panel is handed to draw: the frame shown, the frames before it, and the view state.

`ViewState` is the operator's choices (selected sequence, sort, filter, zoom, latency range); it
lives on the dashboard's screen so that it survives the layout being rebuilt when the terminal is resized.
`Panel` is the base of the panels that draw a frame as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import RenderableType
from rich.text import Text
from textual.content import Content
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.widget import Widget

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


class LinesStatic(Widget):
    """Lines of text that Textual draws a line at a time, converting only the lines that changed.

    A `Static` converts its whole text to screen lines on any change, and `Static.update` marks
    all of it dirty: each frame re-rendered every line of every panel (most of kvtop's CPU).
    `paint` compares the new text with the last line by line, converts the changed lines only,
    and hands Textual just those to repaint; identical text repaints nothing. Lines wider than the
    widget are cut with `…` (never wrapped). `content` is the text shown, as for a Static.
    """

    DEFAULT_CSS = "LinesStatic { height: auto; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._drawn = Text()
        self._lines: list[Text] = []
        self._strips: list[Strip] = []

    @property
    def content(self) -> Text:
        return self._drawn

    def paint(self, content: Text, layout: bool = False) -> None:
        """Show `content`; `layout` where the widget's height follows its number of lines."""
        self._drawn = content
        lines = content.split("\n", allow_blank=True)
        old, old_strips = self._lines, self._strips
        console = self.app.console
        strips, dirty = [], []
        for y, line in enumerate(lines):
            if y < len(old) and old[y] == line:
                strips.append(old_strips[y])
            else:
                strips.append(Strip(list(line.render(console)), line.cell_len))
                dirty.append(y)
        self._lines, self._strips = lines, strips
        if len(lines) != len(old):
            self.refresh(layout=layout)
        elif dirty:
            width = max(1, self.size.width)
            self.refresh(*(Region(0, y, width, 1) for y in dirty))

    def render_line(self, y: int) -> Strip:
        width = self.content_size.width
        style = self.visual_style.rich_style
        if y >= len(self._strips):
            return Strip.blank(width, style)
        strip = self._strips[y]
        if strip.cell_length > width:  # cut, with an ellipsis
            line = self._lines[y].copy()
            line.truncate(width, overflow="ellipsis")
            strip = Strip(list(line.render(self.app.console)), line.cell_len)
        return strip.apply_style(style)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._strips)

    def get_content_width(self, container: Size, viewport: Size) -> int:
        return max((s.cell_length for s in self._strips), default=0)


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
