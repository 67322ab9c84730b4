"""Where the dashboard's frames come from: one interface, two implementations.

`LiveSource` polls a running engine over its control socket (and carries the operator actions);
`ReplaySource` plays the frames of a `.kvsnap` snapshot. The app drives either the same way:
`poll()` in a worker thread, then `current`, `history()` and `events()` to draw, and
`next_delay()` to re-arm its timer, so polls never overlap (dolphie's pattern).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from engine.snapshot import Snapshot
from engine.snapshot_reader import FrameError, LazyFrames, SnapshotReader
from kvtop.client import EngineClient, EngineRequestError, EngineUnavailable, resolve_socket

HISTORY_S = 600.0  # frames kept for sparklines and last-minute histograms
NOTABLE_EVENTS = (
    "preempted", "swapped", "evicted", "prefix_evicted", "drain_started", "drain_finished", "resumed",
    "aborted", "failed", "step_failed", "snapshot", "engine_restarted",
)  # fmt: skip
BURSTY_EVENTS = ("prefix_evicted",)  # notable, but they come by the hundred: first to go, shown as one line
EVENTS_KEPT = 2000
PREFILL_S = 120.0  # on connecting, frames this far back are taken from the engine's /v1/history
HISTORY_BYTES, HISTORY_FRAMES = 16 * 1024**2, 400  # replay: what sparklines read back at most (then thinned)
CHECK_AT_OPEN, CHECK_BYTES_AT_OPEN = 32, 8 * 1024**2  # replay: frames checked before the dashboard starts


class SourceUnavailable(Exception):
    """The source cannot give a frame now (the engine is down or refused); try again later."""


class FrameSource(ABC):
    """The dashboard's view of a run of stats frames."""

    supports_actions = False

    def __init__(self) -> None:
        self.current: dict | None = None

    @abstractmethod
    def poll(self) -> dict | None:
        """Blocking: the frame to show now, or None if nothing changed. Raises SourceUnavailable."""

    @abstractmethod
    def history(self, seconds: float = HISTORY_S) -> list[dict]:
        """Frames up to and including the current one, the last `seconds` of them, oldest first."""

    @abstractmethod
    def events(self) -> list[dict]:
        """Events up to the current frame, oldest first."""

    @abstractmethod
    def next_delay(self) -> float:
        """Seconds until the next poll."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class LiveSource(FrameSource):
    """Frames polled from an engine's control socket, reconnecting with backoff when it goes."""

    supports_actions = True

    def __init__(
        self,
        socket: str | Path | None = None,
        interval: float = 1.0,
        max_backoff: float = 2.0,
        client_factory: Callable[[Path, float], EngineClient] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.path = resolve_socket(socket)
        self.interval = interval
        self.max_backoff = max_backoff
        self._factory = client_factory or EngineClient
        self._client: EngineClient | None = None
        self._clock = clock
        self._frames: deque[dict] = deque()
        self._events: dict[tuple, dict] = {}
        self.disconnected_since: float | None = None
        self.last_error: str | None = None
        self._backoff = 0.0
        self._needs_prefill = True
        self._lock = threading.Lock()  # poll() runs in a worker thread; the UI reads between polls

    def poll(self) -> dict | None:
        if self._client is None:
            self._client = self._factory(self.path, max(2.0, self.interval * 4))
        try:
            frame = self._client.stats()
        except (EngineUnavailable, EngineRequestError, httpx.HTTPError, OSError, ValueError) as exc:
            self._lost(str(exc))
            raise SourceUnavailable(self.last_error) from None
        self.disconnected_since = None
        self.last_error = None
        self._backoff = 0.0
        first = not self._frames
        self._add(frame)
        if self._needs_prefill and not first:  # the second poll: the first frame is on screen already
            self._needs_prefill = False
            self._prefill()
        return frame

    def _lost(self, why: str) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.disconnected_since is None:
            self.disconnected_since = self._clock()
        self.last_error = why
        self._backoff = min(self.max_backoff, max(0.25, self._backoff * 2))

    def _prefill(self) -> None:
        """Seed sparklines and last-minute histograms from the engine's flight recorder."""
        oldest = self._frames[0]["ts"]
        try:
            with self._factory(self.path, 15.0) as client:
                try:
                    past = client.history(since=oldest - PREFILL_S)  # type: ignore[call-arg]
                except TypeError:  # a client without `since`: the whole recorder, trimmed here
                    past = client.history()
        except Exception:  # an engine without /v1/history still works, just starts empty
            return
        older = [f for f in past.get("frames", []) if oldest - PREFILL_S <= f.get("ts", 0) < oldest]
        with self._lock:
            self._frames.extendleft(reversed(older))
            for e in past.get("events", [])[-EVENTS_KEPT:]:
                self._events.setdefault((e.get("ts"), e.get("kind"), e.get("seq_id")), e)

    def _add(self, frame: dict) -> None:
        with self._lock:
            self.current = frame
            if self._frames and frame["ts"] <= self._frames[-1]["ts"]:
                return  # the same frame again (or a clock step back): nothing new to plot
            if self._frames and _restarted(self._frames[-1], frame):
                e = _restart_event(self._frames[-1], frame)
                self._events[(e["ts"], e["kind"], None)] = e
            self._frames.append(frame)
            while self._frames and self._frames[0]["ts"] < frame["ts"] - HISTORY_S:
                self._frames.popleft()
            for e in frame.get("events", []):
                self._events.setdefault((e.get("ts"), e.get("kind"), e.get("seq_id")), e)
            if len(self._events) > EVENTS_KEPT:  # routine and bursty events go first, oldest first
                for key in sorted(self._events, key=_pruned_first)[: len(self._events) - EVENTS_KEPT]:
                    del self._events[key]

    def history(self, seconds: float = HISTORY_S) -> list[dict]:
        with self._lock:
            if not self._frames:
                return []
            last = self._frames[-1]["ts"]
            return [f for f in self._frames if f["ts"] >= last - seconds]

    def events(self) -> list[dict]:
        with self._lock:
            return sorted(self._events.values(), key=lambda e: e.get("ts") or 0)

    def next_delay(self) -> float:
        return self._backoff if self.disconnected_since is not None else self.interval

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # ---- operator actions: each opens its own client (they run in their own worker thread) ----
    def _call(self, fn: Callable[[EngineClient], dict], timeout: float = 10.0) -> dict:
        with self._factory(self.path, timeout) as client:
            return fn(client)

    def drain(self, timeout_s: float | None, abort_after: bool) -> dict:
        return self._call(
            lambda c: c.drain(timeout_s=timeout_s, abort_after=abort_after), timeout=10.0 + (timeout_s or 0)
        )

    def resume(self) -> dict:
        return self._call(lambda c: c.resume())

    def evict_sequence(self, seq_id: str) -> dict:
        return self._call(lambda c: c.evict(seq_id=seq_id))

    def evict_prefix_cache(self) -> dict:
        return self._call(lambda c: c.evict(prefix_cache=True))

    def snapshot(self, path: str, reason: str) -> dict:
        return self._call(lambda c: c.snapshot(path=path, reason=reason))


def _pruned_first(key: tuple) -> tuple:
    """Sort key of (ts, kind, seq_id): routine and bursty events before notable ones, then oldest."""
    return (key[1] in NOTABLE_EVENTS and key[1] not in BURSTY_EVENTS, key[0] or 0)


def _start(frame: dict) -> float:
    return frame["ts"] - ((frame.get("engine") or {}).get("uptime_s") or 0.0)


def _restarted(before: dict, after: dict) -> bool:
    """A new engine run: it started later than the one before (or its step count went back)."""
    step = (before.get("engine") or {}).get("step") or 0
    return _start(after) - _start(before) > 1.0 or ((after.get("engine") or {}).get("step") or 0) < step


def _restart_event(before: dict, after: dict) -> dict:
    """The restart, as an event of the new run (engines do not log their own start)."""
    up = (before.get("engine") or {}).get("uptime_s") or 0.0
    detail = (
        f"a new engine run started at {time.strftime('%H:%M:%S', time.localtime(_start(after)))}; "
        f"the last one was up {int(up) // 60}m{int(up) % 60:02d}s, step {(before.get('engine') or {}).get('step')}"
    )
    return {"ts": max(_start(after), before["ts"]), "kind": "engine_restarted", "seq_id": None, "detail": detail}


def _locked(method):
    """Replay's poll runs in the worker thread, its controls on the UI thread: one at a time."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


class ReplaySource(FrameSource):
    """The frames of a snapshot, played back at a chosen speed, or stepped and jumped through.

    From a loaded `Snapshot` (tests, tools) or, as `kvtop --replay` opens one, from a
    `SnapshotReader` that reads frames on demand (`ReplaySource.open`). A frame that is not a
    stats frame leaves the last good one on screen and says so in `error`."""

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

    # ---- controls: each moves the position; the app redraws at once ----------------------
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
