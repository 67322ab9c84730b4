"""What every panel is handed to draw: the frame shown, the frames before it, and the view state.

`ViewState` is the operator's choices (selected sequence, sort, filter, zoom, latency range); it
lives on the app so that it survives the layout being rebuilt when the terminal is resized.
`Panel` is the base of the panels that draw a frame as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import RenderableType
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


class Panel(Static):
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
            self.update(self.draw(view, max(1, self.content_size.width), max(1, self.content_size.height)))

    def draw(self, view: View, width: int, height: int) -> RenderableType:
        raise NotImplementedError

    def on_resize(self) -> None:
        if self.view is not None:
            self.show(self.view)
