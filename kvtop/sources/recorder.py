"""The client-side flight recorder: frames from any source (vLLM, SGLang, llama.cpp, ours) as a `.kvsnap`.

The file is the engine's own snapshot format (DESIGN §7, written by kvtop.protocol's `write_snapshot`),
so `kvctl replay` and `kvtop --replay` play a vLLM incident as they play ours. Frames read from a
`/metrics` page are partial: they keep their absent fields absent, and the snapshot's block and
sequence tables are empty. The meta row's config says where the frames came from (`recorded_by`,
`source`, `engine`, `url`, `interval_s`).

`record_frames` writes frames already in memory (the dashboard's `s`); `Recording` polls a source
for a while, keeping what it read even when stopped early (Ctrl-C), for `kvctl record`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtop.protocol.snapshot import SnapshotError, SnapshotExists, check_target, write_snapshot
from kvtop.sources.base import FrameSource, SourceUnavailable

MAX_FRAMES = 100_000  # a recording without --duration keeps the newest: about 28 hours at one a second
STOP_CHECK_S = 0.1  # how often a waiting recording looks whether it was stopped (Ctrl-C)


@dataclass
class RecordMeta:
    """Where recorded frames came from: stored in the snapshot's meta row."""

    engine: str | None = None  # engine.kind: vllm, sglang, llamacpp, kvtop
    url: str | None = None  # the /metrics URL (credentials left out) or the socket path
    source: str | None = None  # socket, metrics or replay
    model: str | None = None
    reason: str = "manual"
    interval_s: float | None = None

    def config(self) -> dict:
        return {"recorded_by": "kvtop", "source": self.source, "engine": self.engine, "url": self.url,
                "interval_s": self.interval_s}  # fmt: skip


def _without_credentials(url: str) -> str:
    """A URL as it may be stored in a file someone else will read: no user:password@."""
    try:
        u = httpx.URL(url)
    except (TypeError, ValueError, httpx.InvalidURL):
        return url
    return str(u.copy_with(username=None, password=None)) if u.userinfo else url


def source_meta(source: FrameSource, reason: str = "manual") -> RecordMeta:
    """What a source says about itself and its engine, from the source and its newest frame."""
    frame = source.current or {}
    engine = frame.get("engine") or {}
    url = frame.get("source", {}).get("url") if isinstance(frame.get("source"), dict) else None
    url = url or str(getattr(source, "url", "") or getattr(source, "path", "") or "") or None
    return RecordMeta(
        engine=engine.get("kind") or ("kvtop" if getattr(source, "kind", "") == "socket" else None),
        url=_without_credentials(url) if url else None,
        source=getattr(source, "kind", None) or None,
        model=engine.get("model"),
        reason=reason,
        interval_s=getattr(source, "interval", None),
    )


def record_frames(
    frames: Iterable[dict],
    path: str | Path,
    meta: RecordMeta | None = None,
    *,
    events: Iterable[dict] = (),
    force: bool = False,
) -> Path:
    """Write `frames` (oldest first) as a snapshot at `path`; returns where it went. A directory
    gets a fresh name in it; an existing file is replaced only with `force` (and only a regular
    file). SnapshotError (one line) when there is no frame or the target is refused."""
    kept = [f for f in frames if isinstance(f, dict) and isinstance(f.get("ts"), int | float)
            and isinstance(f.get("engine"), dict)]  # fmt: skip
    if not kept:
        raise SnapshotError("nothing to record: no frame was read from the engine")
    kept.sort(key=lambda f: f["ts"])
    meta = meta or RecordMeta()
    engine = kept[-1]["engine"]
    meta.engine = meta.engine or engine.get("kind")
    meta.model = meta.model or engine.get("model")
    target = check_target(path, force=force)
    fresh = target.is_dir()
    if fresh:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(kept[-1]["ts"]))
        target = target / f"kvtop-{meta.engine or 'engine'}-{stamp}.kvsnap"
    return write_snapshot(target, model=meta.model or "", config=meta.config(), reason=meta.reason, frames=kept,
                          events=list(events), force=force, fresh=fresh)  # fmt: skip


class Recording:
    """Polls `source` every `interval` seconds for `duration` seconds (None: until stopped),
    keeping the frames read (`frames`, the newest MAX_FRAMES) and the scrapes that failed
    (`misses`, `last_error`). `stop()` (safe from a signal handler: it only sets a flag) ends `run`
    within a tenth of a second, or when the scrape under way returns; what was read stays in `frames`."""

    def __init__(self, source: FrameSource, *, interval: float = 1.0, duration: float | None = 60.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        if not interval > 0:
            raise ValueError("the interval must be more than 0 seconds")
        if duration is not None and not duration > 0:
            raise ValueError("the duration must be more than 0 seconds")
        self.source = source
        self.interval = interval
        self.duration = duration
        self.frames: deque[dict] = deque(maxlen=MAX_FRAMES)
        self.misses = 0
        self.last_error: str | None = None
        self._clock, self._sleep = clock, sleep
        self.started: float | None = None
        self.stopped = False

    def stop(self) -> None:
        """End `run` at its next check. Only a flag, so a signal handler may call it (kvtop/ctl/record.py
        says why that matters)."""
        self.stopped = True

    @property
    def elapsed(self) -> float:
        return 0.0 if self.started is None else self._clock() - self.started

    def first(self) -> dict:
        """The first frame, read now: SourceUnavailable if the engine cannot be read at all."""
        self.started = self._clock()
        frame = self.source.poll()
        if frame is None:
            raise SourceUnavailable("the source gave no frame")
        self.frames.append(frame)
        return frame

    def run(self, on_tick: Callable[[Recording], None] | None = None) -> None:
        """Poll until the duration is over; `on_tick` after every poll (the progress line)."""
        if self.started is None:
            self.started = self._clock()
        due = self.started + self.interval
        while self.duration is None or due <= self.started + self.duration + 1e-9:
            self._wait_until(due)
            if self.stopped:
                return
            due += self.interval
            try:
                frame = self.source.poll()
            except SourceUnavailable as exc:
                self.misses += 1
                self.last_error = str(exc)
            else:
                if frame is not None:
                    self.frames.append(frame)
                    self.last_error = None
            if on_tick is not None:
                on_tick(self)
            due = max(due, self._clock())  # a slow scrape delays the next one, it never bunches them up

    def _wait_until(self, due: float) -> None:
        """Sleep until `due` in slices of STOP_CHECK_S, so that `stop()` is seen soon whatever the interval."""
        while not self.stopped:
            left = due - self._clock()
            if left <= 0:
                return
            self._sleep(min(left, STOP_CHECK_S))

    def save(self, path: str | Path, meta: RecordMeta, *, force: bool = False) -> Path:
        """Write what was recorded. A file that appeared at `path` meanwhile is not replaced (without
        `force`): the recording goes beside it under a fresh name rather than being lost."""
        try:
            return record_frames(self.frames, path, meta, force=force)
        except SnapshotExists:
            target = Path(path).expanduser().absolute()
            return write_snapshot(target, model=meta.model or "", config=meta.config(), reason=meta.reason,
                                  frames=list(self.frames), events=[], fresh=True)  # fmt: skip
