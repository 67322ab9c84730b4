"""Snapshots (DESIGN §7): the flight recorder and the `.kvsnap` SQLite file it is written to.

A snapshot holds the last minutes of stats frames plus the events, sequences and block table at
the moment it was taken. Written with sqlite-utils into a temp file beside the target, then
renamed, so a crash mid-write never leaves a partial `.kvsnap`. Read back read-only; anything
that is not a kvtop snapshot is refused with a `SnapshotError` that says what is wrong.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError

SNAPSHOT_SCHEMA_VERSION = 1
TABLES = ("meta", "frames", "events", "sequences", "blocks")


class SnapshotError(EngineError):
    """A snapshot file that cannot be read: missing, not SQLite, truncated, or not kvtop's."""


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


@dataclass
class Snapshot:
    path: Path
    meta: dict
    frames: list[dict]
    events: list[dict]
    sequences: list[dict]
    blocks: list[dict]


def block_rows(frame: dict, block_refs: list[int] | None = None) -> list[dict]:
    """The block table at the moment of `frame`: each block's state and the sequences holding it."""
    owners: dict[int, list[str]] = {}
    for seq in frame.get("sequences", []):
        for b in seq.get("block_ids", []):
            owners.setdefault(b, []).append(seq["id"])
    chars = frame["kv"]["blocks"]
    return [
        {
            "block_id": i,
            "state": c,
            "ref_count": block_refs[i] if block_refs else len(owners.get(i, [])),
            "seq_ids": json.dumps(owners.get(i, [])),
        }
        for i, c in enumerate(chars)
    ]


def write_snapshot(
    path: str | Path,
    *,
    model: str,
    config: dict,
    reason: str,
    frames: list[dict],
    events: list[dict],
    block_refs: list[int] | None = None,
) -> Path:
    """Write a snapshot atomically; returns the final path. The last frame gives the sequences
    and blocks tables (the state at the moment of the snapshot)."""
    import sqlite_utils

    if not frames:
        raise SnapshotError("nothing to snapshot: the flight recorder holds no frame yet")
    path = Path(path).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        db = sqlite_utils.Database(tmp, recreate=True)
        db["meta"].insert(
            {
                "schema_version": SNAPSHOT_SCHEMA_VERSION,
                "model": model,
                "config": json.dumps(config, default=str),
                "reason": reason,
                "created": time.time(),
            }
        )
        db["frames"].insert_all(
            ({"ts": f["ts"], "step": f["engine"]["step"], "frame": json.dumps(f)} for f in frames),
            batch_size=200,
        )
        db["events"].insert_all(
            (
                {"ts": e["ts"], "kind": e["kind"], "seq_id": e.get("seq_id"), "detail": e.get("detail", "")}
                for e in events
            ),
            columns={"ts": float, "kind": str, "seq_id": str, "detail": str},
        )
        last = frames[-1]
        db["sequences"].insert_all(
            ({**s, "block_ids": json.dumps(s.get("block_ids", []))} for s in last.get("sequences", [])),
            columns={"id": str, "state": str, "block_ids": str},
        )
        db["blocks"].insert_all(
            block_rows(last, block_refs),
            columns={"block_id": int, "state": str, "ref_count": int, "seq_ids": str},
        )
        # insert_all of no rows creates no table: an idle engine still writes a readable file
        for name, columns in (
            ("events", {"ts": float, "kind": str, "seq_id": str, "detail": str}),
            ("sequences", {"id": str, "state": str, "block_ids": str}),
        ):
            if not db[name].exists():
                db[name].create(columns)
        db.conn.commit()
        db.close()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _remove_stale_temps(directory: Path) -> None:
    """Temp files (and SQLite journals) of writers that died mid-write, e.g. SIGKILLed."""
    for f in directory.glob(".*.kvsnap.*.tmp*"):
        try:
            pid = int(f.name.split(".kvsnap.", 1)[1].split(".", 1)[0])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            f.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, someone else's


def read_snapshot(path: str | Path) -> Snapshot:
    """Open a snapshot read-only and load it, or raise SnapshotError with a clear reason."""
    path = Path(path).expanduser()
    if not path.exists():
        raise SnapshotError(f"{path}: no such file")
    if not path.is_file():
        raise SnapshotError(f"{path}: not a file")
    try:
        with open(path, "rb") as f:
            header = f.read(16)
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read ({exc.strerror})") from None
    if header != b"SQLite format 3\x00":
        raise SnapshotError(f"{path}: not a kvtop snapshot (not an SQLite file)")
    try:
        conn = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
        try:
            conn.row_factory = sqlite3.Row
            names = {r[0] for r in conn.execute("select name from sqlite_master where type='table'")}
            missing = [t for t in TABLES if t not in names]
            if missing:
                raise SnapshotError(f"{path}: not a kvtop snapshot (no {', '.join(missing)} table)")
            meta_rows = conn.execute("select * from meta").fetchall()
            if not meta_rows:
                raise SnapshotError(f"{path}: not a kvtop snapshot (empty meta table)")
            meta = dict(meta_rows[0])
            version = meta.get("schema_version")
            if version != SNAPSHOT_SCHEMA_VERSION:
                raise SnapshotError(
                    f"{path}: snapshot schema version {version}, this kvtop reads {SNAPSHOT_SCHEMA_VERSION}"
                )
            meta["config"] = json.loads(meta.get("config") or "{}")
            frames = [json.loads(r["frame"]) for r in conn.execute("select frame from frames order by ts")]
            events = [dict(r) for r in conn.execute("select * from events order by ts")]
            sequences = [dict(r) for r in conn.execute("select * from sequences")]
            for s in sequences:
                s["block_ids"] = json.loads(s.get("block_ids") or "[]")
            blocks = [dict(r) for r in conn.execute("select * from blocks order by block_id")]
        finally:
            conn.close()
    except SnapshotError:
        raise
    except (sqlite3.DatabaseError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SnapshotError(f"{path}: damaged or truncated snapshot ({exc})") from None
    if not frames:
        raise SnapshotError(f"{path}: the snapshot holds no frames")
    return Snapshot(path, meta, frames, events, sequences, blocks)
