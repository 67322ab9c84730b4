"""`ReplaySource`: the frames of a `.kvsnap` snapshot, played, stepped and jumped through."""

from __future__ import annotations

import functools
import math
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtop.protocol.snapshot import Snapshot
from kvtop.protocol.snapshot_reader import FrameError, LazyFrames, SnapshotReader
from kvtop.sources.base import CHECK_AT_OPEN, CHECK_BYTES_AT_OPEN, HISTORY_BYTES, HISTORY_FRAMES, HISTORY_S, FrameSource


def _locked(method):
    """Replay's poll runs in the worker thread, its controls on the UI thread: one at a time."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
DERIVE_MAX_FRAMES = 20_000  # a /metrics recording longer than this (5.5 h at 1 s) is not read whole at open


def _derived(frames: Sequence[dict]) -> list[dict]:
    """The events derived from a /metrics recording's frames (kvtop/derived.py); a frame that is
    not a stats frame is passed over, and a recording past DERIVE_MAX_FRAMES derives none."""
    from kvtop.derived import derive_all  # here: kvtop.derived -> diagnosis -> rates -> kvtop.sources is a cycle

    if len(frames) > DERIVE_MAX_FRAMES:
        return []
    good = []
    for i in range(len(frames)):
        try:
            good.append(frames[i])
        except FrameError:
            continue
    return derive_all(good)


class ReplaySource(FrameSource):
    """The frames of a snapshot, played back at a chosen speed, or stepped and jumped through.

    From a loaded `Snapshot` (tests, tools) or, as `kvtop --replay` opens one, from a
    `SnapshotReader` that reads frames on demand (`ReplaySource.open`). A frame that is not a
    stats frame leaves the last good one on screen and says so in `error`."""

    kind = "replay"
    can_seek = True

    def __init__(self, snapshot: Snapshot | SnapshotReader, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.snapshot = snapshot
        if isinstance(snapshot, Snapshot):
            self.frames: Sequence[dict] = snapshot.frames
            self._ts: Sequence[float] = [f["ts"] for f in self.frames]
        else:
            self.frames = LazyFrames(snapshot)
            self._ts = snapshot.ts
        self._events = sorted(snapshot.events, key=lambda e: e["ts"])
        self._event_ts = [e["ts"] for e in self._events]
        self._clock = clock
        self.index = 0
        self.playing = False
        self.speed = 1.0
        self._played_from: tuple[float, float] | None = None  # (wall clock, frame time) at play
        self.error: str | None = None  # why the frame at `index` is not the one on screen
        self.current = self.frames[0]
        if not self._events and (self.current.get("source") or {}).get("kind") == "metrics":
            self._events = _derived(self.frames)  # another engine's recording: no log, its counters' jumps
            self._event_ts = [e["ts"] for e in self._events]
        self._shown = -1
        self._lock = threading.RLock()

    @classmethod
    def open(cls, path: str | Path, clock: Callable[[], float] = time.monotonic) -> ReplaySource:
        """Open a snapshot file for replay: SnapshotError (one line) if it is not one, or if one
        of its first frames is not a stats frame; frames further on are checked when shown."""
        reader = SnapshotReader(path)
        try:
            source = cls(reader, clock)
            spent = 0
            for i in range(1, min(len(reader), CHECK_AT_OPEN)):  # the first is read by __init__
                spent += source.frames.sized(i)[1]  # type: ignore[attr-defined]
                if spent > CHECK_BYTES_AT_OPEN:  # frames of 100,000 sequences: the UI comes first
                    break
            return source
        except BaseException:
            reader.close()
            raise

    def close(self) -> None:
        if isinstance(self.snapshot, SnapshotReader):
            self.snapshot.close()

    @property
    def marked_events(self) -> list[dict]:
        """Every event along the recording (the timeline's marks): its own, or those derived."""
        return self._events

    @property
    def start_ts(self) -> float:
        return self._ts[0]

    @property
    def end_ts(self) -> float:
        return self._ts[-1]

    @property
    def position(self) -> float:
        """Seconds from the first frame to the one shown."""
        return self._ts[self.index] - self._ts[0]

    @property
    def reason(self) -> str:
        return str(self.snapshot.meta.get("reason") or "")

    @_locked
    def poll(self) -> dict | None:
        if self.playing and self._played_from is not None:
            wall, frame_ts = self._played_from
            target = frame_ts + (self._clock() - wall) * self.speed
            self.index = max(0, bisect_right(self._ts, target) - 1)
            if self.index == len(self.frames) - 1:
                self.pause()
        if self.index == self._shown:
            return None
        return self._show()

    def _show(self) -> dict:
        self._shown = self.index
        try:
            self.current = self.frames[self.index]
            self.error = None
        except FrameError as exc:  # keep the last good frame on screen, and say why
            self.error = exc.short
        return self.current

    @_locked
    def history(self, seconds: float = HISTORY_S) -> list[dict]:
        now = self._ts[self.index]
        lo = bisect_right(self._ts, now - seconds)
        lo = max(0, min(lo, self.index))
        if isinstance(self.frames, LazyFrames):
            return self.frames.window(lo, self.index + 1, budget=HISTORY_BYTES, most=HISTORY_FRAMES)
        return self.frames[lo : self.index + 1]

    @_locked
    def events(self) -> list[dict]:
        return self._events[: bisect_right(self._event_ts, self._ts[self.index])]

    def next_delay(self) -> float:
        return 0.1 if self.playing else 0.25

    # ---- controls: each moves the position; the dashboard redraws at once ----------------------
    @_locked
    def play(self) -> None:
        if self.index == len(self.frames) - 1:
            self.index = 0
        self.playing = True
        self._played_from = (self._clock(), self._ts[self.index])

    @_locked
    def pause(self) -> None:
        self.playing = False
        self._played_from = None

    def toggle(self) -> None:
        self.pause() if self.playing else self.play()

    def _moved(self) -> dict:
        if self.playing:
            self._played_from = (self._clock(), self._ts[self.index])
        return self._show()

    @_locked
    def step(self, n: int) -> dict:
        self.index = max(0, min(len(self.frames) - 1, self.index + n))
        return self._moved()

    @_locked
    def seek(self, offset_s: float) -> dict:
        """Show the last frame at or before `offset_s` seconds after the first (clamped)."""
        target = self._ts[0] + offset_s
        self.index = max(0, min(len(self.frames) - 1, bisect_right(self._ts, target + 1e-9) - 1))
        return self._moved()

    def skip(self, seconds: float) -> dict:
        return self.seek(self.position + seconds)

    @_locked
    def start(self) -> dict:
        self.index = 0
        return self._moved()

    @_locked
    def end(self) -> dict:
        self.index = len(self.frames) - 1
        return self._moved()

    def faster(self) -> None:
        self._set_speed(+1)

    def slower(self) -> None:
        self._set_speed(-1)

    @_locked
    def _set_speed(self, direction: int) -> None:
        i = min(range(len(SPEEDS)), key=lambda k: abs(SPEEDS[k] - self.speed))
        self.speed = SPEEDS[max(0, min(len(SPEEDS) - 1, i + direction))]
        if self.playing:
            self._played_from = (self._clock(), self._ts[self.index])


def parse_offset(text: str, length_s: float) -> float:
    """A time to jump to: `12.5` or `+12.5` seconds from the start, `-5` from the end, `1:30`
    minutes and seconds, or `50%`. Raises ValueError with a usable message."""
    t = text.strip()
    if not t:
        raise ValueError("type a time: 12.5, 1:30, -5 (from the end) or 50%")
    try:
        if t.endswith("%"):
            v = length_s * float(t[:-1]) / 100
        elif ":" in t:
            minutes, _, secs = t.lstrip("+").partition(":")
            v = int(minutes) * 60 + float(secs)
        else:
            v = float(t)
            v = length_s + v if t.startswith("-") else v
    except (ValueError, OverflowError):
        raise ValueError(f"cannot read {text!r} as a time: use 12.5, 1:30, -5 or 50%") from None
    if not math.isfinite(v):
        raise ValueError(f"{text!r} is not a time in the recording: use 12.5, 1:30, -5 or 50%")
    return v
