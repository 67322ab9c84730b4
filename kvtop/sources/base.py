"""The source interface: what every kind of frame source gives the dashboard.

The app drives any source the same way: `poll()` in a worker thread, then `current`, `history()`
and `events()` to draw, and `next_delay()` to re-arm its timer, so polls never overlap (dolphie's
pattern). One module per kind: `live` (our engine's control socket), `replay` (a `.kvsnap`),
`metrics` (any engine's Prometheus `/metrics`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvtop.protocol.frame import StatsFrame

HISTORY_S = 600.0  # frames kept for sparklines and last-minute histograms
NOTABLE_EVENTS = (
    "preempted", "swapped", "evicted", "prefix_evicted", "drain_started", "drain_finished", "resumed",
    "aborted", "failed", "step_failed", "snapshot", "engine_restarted",
    "rejected", "kv_full", "queue_grew", "prefix_collapsed",  # derived from another engine's counters (kvtop/derived.py)
)  # fmt: skip
BURSTY_EVENTS = ("prefix_evicted", "rejected")  # notable, but they come by the hundred (rejections every scrape
# while a queue is full): first to go, a run shown as one line
EVENTS_KEPT = 2000
PREFILL_S = 120.0  # on connecting, frames this far back are taken from the engine's /v1/history
HISTORY_BYTES, HISTORY_FRAMES = 16 * 1024**2, 400  # replay: what sparklines read back at most (then thinned)
CHECK_AT_OPEN, CHECK_BYTES_AT_OPEN = 32, 8 * 1024**2  # replay: frames checked before the dashboard starts


def last_seconds(frames, seconds: float) -> list[dict]:
    """The frames (oldest first) no older than `seconds` before the newest one."""
    if not frames:
        return []
    last = frames[-1]["ts"]
    return [f for f in frames if f["ts"] >= last - seconds]


class SourceUnavailable(Exception):
    """The source cannot give a frame now (the engine is down or refused); try again later."""


class FrameSource(ABC):
    """The dashboard's view of a run of stats frames, and what it can do besides (its capabilities:
    the app asks these, never the source's type)."""

    kind = ""  # where frames come from: "socket", "metrics" or "replay" (the frame's source.kind)
    controls = False  # the engine takes drain, resume, evict and snapshot through this source
    can_seek = False  # frames can be stepped, skipped and jumped to (a recording)
    can_record = False  # `s` writes the frames read so far as a .kvsnap on this side (no engine control needed)
    path: object = ""  # what the header names: a socket path, a URL, a file
    interval = 1.0

    def __init__(self) -> None:
        self.current: dict | None = None
        self.disconnected_since: float | None = None  # a live source that lost its engine: since when
        self.last_error: str | None = None

    @property
    def unavailable(self) -> list[str]:
        """What the panels cannot show from this source, one line each ("vLLM exposes no block map")."""
        return list((self.current or {}).get("unavailable") or [])

    @abstractmethod
    def poll(self) -> StatsFrame | None:
        """Blocking: the frame to show now (partial where the source cannot know a field), or None if
        nothing changed. Raises SourceUnavailable."""

    @abstractmethod
    def history(self, seconds: float = HISTORY_S) -> list[StatsFrame]:
        """Frames up to and including the current one, the last `seconds` of them, oldest first."""

    @abstractmethod
    def events(self) -> list[dict]:
        """Events up to the current frame, oldest first."""

    @abstractmethod
    def next_delay(self) -> float:
        """Seconds until the next poll."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
