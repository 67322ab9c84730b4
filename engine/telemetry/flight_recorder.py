"""The flight recorder (DESIGN §7): the server's last minutes of stats frames, which a snapshot
writes out (kvtop/protocol/snapshot.py)."""

from __future__ import annotations

from collections import deque


class FlightRecorder:
    """The last `history_s` seconds of stats frames, one every `interval_s`, in a bounded ring."""

    def __init__(self, history_s: float = 600.0, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.history_s = history_s
        self.frames: deque[dict] = deque(maxlen=max(1, int(history_s / interval_s)))

    def record(self, frame: dict) -> None:
        self.frames.append(frame)

    def snapshot_frames(self) -> list[dict]:
        return list(self.frames)
