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
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kvtop.protocol.frame import normalize_frame
from kvtop.protocol.frame_schema import check_frame
from kvtop.protocol.snapshot_format import (
    READABLE_VERSIONS,
    SNAPSHOT_SCHEMA_VERSION,
    TABLES,
    TRACE_TABLES,
    Snapshot,
    SnapshotError,
)

MAX_EVENTS = 100_000  # an engine keeps 5,000; a crafted file cannot make replay hold millions
CACHE_FRAMES, CACHE_BYTES = 4096, 32 * 1024**2  # LazyFrames: parsed frames kept, and about their JSON's size
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
        return self.read(i)[0]

    def read(self, i: int) -> tuple[dict, int]:
        """The i-th frame, checked, and the size of its JSON in bytes (what it costs to keep)."""
        frame, size = self._load(i)
        problem = check_frame(frame)
        if problem:
            raise FrameError(self.path, i, problem)
        return frame, size

    def loose_frame(self, i: int) -> dict:
        """The i-th frame as stored: a JSON object, nothing more is promised."""
        return self._load(i)[0]

    def _load(self, i: int) -> tuple[dict, int]:
        with self._lock:
            row = self._query(lambda: self._conn.execute("select frame from frames where rowid = ?", (self._rowids[i],)).fetchone())  # fmt: skip
        if row is None:
            raise FrameError(self.path, i, "it is gone from the file")
        size = len(row[0]) if isinstance(row[0], str | bytes) else 8
        try:
            frame = json.loads(row[0])
        except RecursionError:
            raise FrameError(self.path, i, "it is nested too deep to be one") from None
        except (TypeError, ValueError) as exc:
            raise FrameError(self.path, i, f"not JSON ({str(exc)[:80]})") from None
        if not isinstance(frame, dict):
            raise FrameError(self.path, i, check_frame(frame) or "not an object")
        try:
            return normalize_frame(frame), size
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise FrameError(self.path, i, f"kv: counts that are not numbers ({exc})") from None

    def has_trace_tables(self) -> bool:
        """Whether the file has the request trace's tables (version 2 on), full or empty."""
        sql = "select name from sqlite_master where type='table'"
        with self._lock:
            names = self._query(lambda: {r[0] for r in self._conn.execute(sql)})
        return all(t in names for t in TRACE_TABLES)

    def trace_rows(self) -> tuple[list[dict], list[dict]]:
        """The `requests` and `steps` rows, their JSON lists parsed (none in an older file)."""
        if not self.has_trace_tables():
            return [], []
        requests = self.rows("select * from requests order by arrival_time, rowid")
        steps = self.rows("select * from steps order by step, rowid")
        try:
            for r in requests:
                r["block_hashes"] = json.loads(r.get("block_hashes") or "[]")
            for s in steps:
                s["admitted"], s["preempted"] = (
                    json.loads(s.get("admitted") or "[]"),
                    json.loads(s.get("preempted") or "[]"),
                )
        except (TypeError, ValueError, RecursionError) as exc:
            raise SnapshotError(f"{self.path}: damaged requests or steps table ({exc})") from None
        return requests, steps

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
        if version not in READABLE_VERSIONS:
            raise SnapshotError(
                f"{self.path}: snapshot schema version {version}, this kvtop reads "
                f"{' and '.join(map(str, READABLE_VERSIONS))} (it writes {SNAPSHOT_SCHEMA_VERSION})"
            )
        config = json.loads(meta.get("config") or "{}")
        meta["config"] = config if isinstance(config, dict) else {}
        workload = json.loads(meta.get("workload") or "null")  # version 2: the engine that ran the trace
        meta["workload"] = workload if isinstance(workload, dict) else None
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


class LazyFrames(Sequence):
    """A snapshot's frames, read from the file when asked for; the recently used ones stay parsed,
    at most `max_frames` of them and about `max_bytes` of their JSON, so a recording of any
    length costs about the same memory. A frame that is not a stats frame raises FrameError."""

    def __init__(self, reader: SnapshotReader, max_frames: int = CACHE_FRAMES, max_bytes: int = CACHE_BYTES) -> None:
        self.reader = reader
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self._cache: OrderedDict[int, tuple[dict | FrameError, int]] = OrderedDict()
        self._bytes = 0
        self._pinned: tuple[int, tuple[dict | FrameError, int]] | None = None

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.window(*i.indices(len(self))[:2], budget=None)
        i = range(len(self))[i]  # negative indices; IndexError past the end
        hit = self._pinned if self._pinned is not None and self._pinned[0] == i else (i, self._get(i))
        self._pinned = hit  # the frame on screen stays parsed, however big, whatever a window reads
        got = hit[1][0]
        if isinstance(got, FrameError):
            raise got
        return got

    def sized(self, i: int) -> tuple[dict, int]:
        """The i-th frame (FrameError if it is not a stats frame) and the size of its JSON."""
        got, size = self._get(i)
        if isinstance(got, FrameError):
            raise got
        return got, size

    def window(self, lo: int, hi: int, budget: int | None = None, most: int | None = None) -> list[dict]:
        """The good frames in [lo, hi), oldest first: read newest first until `budget` bytes of
        JSON; past `most` frames, the newer half of `most` stay dense and the older ones are
        thinned evenly (a sparkline needs their shape, not every point)."""
        out: list[dict] = []
        spent = 0
        for i in _thinned(lo, hi, most):
            got, size = self._get(i)
            spent += size
            if budget is not None and spent > budget and out:
                break
            if not isinstance(got, FrameError):
                out.append(got)
        out.reverse()
        return out

    def _get(self, i: int) -> tuple[dict | FrameError, int]:
        if self._pinned is not None and self._pinned[0] == i:
            return self._pinned[1]
        hit = self._cache.get(i)
        if hit is not None:
            self._cache.move_to_end(i)
            return hit
        try:
            hit = self.reader.read(i)
        except FrameError as exc:
            hit = (exc, 64)
        self._cache[i] = hit
        self._bytes += hit[1]
        while len(self._cache) > 1 and (len(self._cache) > self.max_frames or self._bytes > self.max_bytes):
            _, (_, size) = self._cache.popitem(last=False)
            self._bytes -= size
        return hit


def _thinned(lo: int, hi: int, most: int | None) -> Iterator[int]:
    """Indices from hi - 1 down to lo: all of them, or about `most` (see LazyFrames.window)."""
    if most is None or hi - lo <= most:
        yield from range(hi - 1, lo - 1, -1)
        return
    dense = most // 2
    yield from range(hi - 1, hi - 1 - dense, -1)
    yield from range(hi - 1 - dense, lo - 1, -math.ceil((hi - dense - lo) / (most - dense)))


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
        requests, steps = r.trace_rows()
        return Snapshot(r.path, r.meta, frames, r.events, sequences, blocks, requests, steps)
