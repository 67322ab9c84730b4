"""Messages between kvtop's worker threads, its widgets and its screens (dataclasses, as in toolong)."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message


@dataclass
class FrameArrived(Message):
    """A poll found a new frame to show."""

    frame: dict


@dataclass
class PollIdle(Message):
    """A poll found nothing new (replay paused, or at its end)."""


@dataclass
class SourceLost(Message):
    """The engine did not answer; the next try is in `retry_in` seconds."""

    error: str
    since: float
    retry_in: float


@dataclass
class ActionFinished(Message):
    """An operator action (drain, resume, evict, snapshot) came back from the engine."""

    action: str
    ok: bool
    detail: str


@dataclass
class SequenceSelected(Message):
    """The cursor in the sequences table moved to `seq_id`."""

    seq_id: str | None


@dataclass
class SequenceOpened(Message):
    """Enter on a row of the sequences table: show that sequence's details."""

    seq_id: str


@dataclass
class SortChosen(Message):
    """A column header was clicked: sort by it (again: reverse)."""

    column: str


@dataclass
class FilterChanged(Message):
    """The sequences filter text changed."""

    text: str


@dataclass
class LayoutRebuilt(Message):
    """The dashboard changed layout (wide, tabs, small) after a resize: redraw into the new panels."""

    mode: str


@dataclass
class FleetPolled(Message):
    """A round of the fleet came back: one row per engine (kvtop.fleet.Row)."""

    rows: list
    at: float
    error: str | None = None  # the round failed as a whole: `rows` are the previous ones
