"""`LiveSource`: frames polled from our engine's control socket, and the operator actions."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import httpx

from kvtop.client import EngineClient, EngineRequestError, EngineUnavailable, resolve_socket
from kvtop.sources.base import (
    BURSTY_EVENTS,
    EVENTS_KEPT,
    HISTORY_S,
    NOTABLE_EVENTS,
    PREFILL_S,
    FrameSource,
    SourceUnavailable,
    last_seconds,
)


class LiveSource(FrameSource):
    """Frames polled from an engine's control socket, reconnecting with backoff when it goes."""

    kind = "socket"
    controls = True

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
                past = client.history(since=oldest - PREFILL_S)
        except (EngineUnavailable, EngineRequestError, httpx.HTTPError, OSError, ValueError):
            # an engine without /v1/history, or gone again, still works: the plots start empty
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
            return last_seconds(self._frames, seconds)

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
