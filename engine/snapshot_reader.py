"""Reading `.kvsnap` files (DESIGN §7) without trusting them.

`SnapshotReader` opens one read-only and keeps in memory only what replay needs to move around:
the meta row, the events (the latest `MAX_EVENTS`) and each frame's rowid and timestamp. Frames
are read, parsed and checked one at a time (`frame(i)`), so a recording of 200,000 frames opens in
about a second, and a frame that is not a stats frame is a message naming that frame, not a
traceback. `load_snapshot` reads everything (tools, tests, small files).
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
from array import array
from pathlib import Path
from typing import Any
from urllib.parse import quote

from engine.frame_check import check_frame
from engine.snapshot import SNAPSHOT_SCHEMA_VERSION, TABLES, Snapshot, SnapshotError
from engine.stats import normalize_frame

MAX_EVENTS = 100_000  # an engine keeps 5,000; a crafted file cannot make replay hold millions
HEADER = b"SQLite format 3\x00"


class FrameError(SnapshotError):
    """One frame of a readable snapshot is not a stats frame."""

    def __init__(self, path: Path, index: int, problem: str) -> None:
        super().__init__(f"{path}: frame {index + 1} is not a stats frame: {problem}")
        self.index = index
        self.problem = problem

    @property
    def short(self) -> str:
        return f"frame {self.index + 1} is not a stats frame: {self.problem}"


class SnapshotReader:
    """A snapshot opened read-only: `meta`, `events`, `ts` (one per frame, oldest first) in
    memory; `frame(i)` reads the i-th frame from the file. Safe to share between threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        _check_file(self.path)
        self._lock = threading.Lock()
        try:
            uri = f"file:{quote(os.fsencode(self.path.resolve()))}?mode=ro"  # a name may hold ? or #
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        except sqlite3.Error as exc:
            raise SnapshotError(f"{self.path}: cannot open ({exc})") from None
        try:
            self.meta = self._query(self._meta)
            self._rowids, self.ts = self._query(self._index)
            self.events = self._query(self._events)
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self._rowids)

    def __enter__(self) -> SnapshotReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def frame(self, i: int) -> dict:
        """The i-th frame, checked: FrameError if the dashboard could not draw it."""
        frame = self.loose_frame(i)
        problem = check_frame(frame)
        if problem:
            raise FrameError(self.path, i, problem)
        return frame

    def loose_frame(self, i: int) -> dict:
        """The i-th frame as stored: a JSON object, nothing more is promised."""
        with self._lock:
            row = self._query(lambda: self._conn.execute("select frame from frames where rowid = ?", (self._rowids[i],)).fetchone())  # fmt: skip
        if row is None:
            raise FrameError(self.path, i, "it is gone from the file")
        try:
            frame = json.loads(row[0])
        except RecursionError:
            raise FrameError(self.path, i, "it is nested too deep to be one") from None
        except (TypeError, ValueError) as exc:
            raise FrameError(self.path, i, f"not JSON ({str(exc)[:80]})") from None
        if not isinstance(frame, dict):
            raise FrameError(self.path, i, check_frame(frame) or "not an object")
        try:
            return normalize_frame(frame)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise FrameError(self.path, i, f"kv: counts that are not numbers ({exc})") from None

    def rows(self, sql: str) -> list[dict]:
        with self._lock:
            return self._query(lambda: [dict(r) for r in self._cursor().execute(sql)])

    # ---- opening ------------------------------------------------------------------------------
    def _cursor(self) -> sqlite3.Cursor:
        cur = self._conn.cursor()
        cur.row_factory = sqlite3.Row
        return cur

    def _query(self, fn):
        try:
            return fn()
        except SnapshotError:
            raise
        except (sqlite3.Error, json.JSONDecodeError, OverflowError) as exc:
            raise SnapshotError(f"{self.path}: damaged or truncated snapshot ({exc})") from None

    def _meta(self) -> dict:
        names = {r[0] for r in self._conn.execute("select name from sqlite_master where type='table'")}
        missing = [t for t in TABLES if t not in names]
        if missing:
            raise SnapshotError(f"{self.path}: not a kvtop snapshot (no {', '.join(missing)} table)")
        row = self._cursor().execute("select * from meta limit 1").fetchone()
        if row is None:
            raise SnapshotError(f"{self.path}: not a kvtop snapshot (empty meta table)")
        meta = dict(row)
        version = meta.get("schema_version")
        if version != SNAPSHOT_SCHEMA_VERSION:
            raise SnapshotError(
                f"{self.path}: snapshot schema version {version}, this kvtop reads {SNAPSHOT_SCHEMA_VERSION}"
            )
        config = json.loads(meta.get("config") or "{}")
        meta["config"] = config if isinstance(config, dict) else {}
        meta["created"] = meta.get("created") if _finite(meta.get("created")) else None
        for key in ("model", "reason"):
            meta[key] = "" if meta.get(key) is None else str(meta[key])
        return meta

    def _index(self) -> tuple[array, array]:
        rowids, stamps = array("q"), array("d")
        for i, (rowid, ts) in enumerate(self._conn.execute("select rowid, ts from frames order by ts, rowid")):
            if not _finite(ts):
                raise SnapshotError(f"{self.path}: frame {i + 1} has no usable timestamp ({_show(ts)})")
            rowids.append(rowid)
            stamps.append(ts)
        if not rowids:
            raise SnapshotError(f"{self.path}: the snapshot holds no frames")
        return rowids, stamps

    def _events(self) -> list[dict]:
        sql = "select rowid, ts, kind, seq_id, detail from events order by rowid desc limit ?"
        events = []
        for rowid, ts, kind, seq_id, detail in self._conn.execute(sql, (MAX_EVENTS,)):
            if not _finite(ts):
                raise SnapshotError(f"{self.path}: event {rowid} has no usable timestamp ({_show(ts)})")
            if not isinstance(kind, str) or not kind:
                raise SnapshotError(f"{self.path}: event {rowid} has no kind ({_show(kind)})")
            events.append({"ts": float(ts), "kind": kind, "seq_id": None if seq_id is None else str(seq_id),
                           "detail": "" if detail is None else str(detail)})  # fmt: skip
        events.sort(key=lambda e: e["ts"])
        return events


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _show(v: Any) -> str:
    text = "NULL" if v is None else repr(v)
    return text if len(text) <= 40 else text[:37] + "…"


def _check_file(path: Path) -> None:
    if not path.exists():
        raise SnapshotError(f"{path}: no such file")
    if not path.is_file():
        raise SnapshotError(f"{path}: not a file")
    try:
        with open(path, "rb") as f:
            header = f.read(16)
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read ({exc.strerror})") from None
    if header != HEADER:
        raise SnapshotError(f"{path}: not a kvtop snapshot (not an SQLite file)")


def load_snapshot(path: str | Path) -> Snapshot:
    """The whole snapshot in memory. Frames need only be JSON objects (tools write partial
    ones); replay checks each as it shows it."""
    with SnapshotReader(path) as r:
        frames = [r.loose_frame(i) for i in range(len(r))]
        sequences = r.rows("select * from sequences")
        blocks = r.rows("select * from blocks order by block_id")
        try:
            for s in sequences:
                s["block_ids"] = json.loads(s.get("block_ids") or "[]")
        except (TypeError, ValueError, RecursionError) as exc:
            raise SnapshotError(f"{r.path}: damaged sequences table ({exc})") from None
        return Snapshot(r.path, r.meta, frames, r.events, sequences, blocks)
