"""Snapshots (DESIGN §7): writing the `.kvsnap` SQLite file, for the engine's flight recorder
(engine/telemetry/flight_recorder.py) and for `kvctl record` alike.

A snapshot holds the last minutes of stats frames plus the events, sequences and block table at
the moment it was taken. Written with sqlite-utils into a 0600 temp file beside the target, then
moved into place, so a crash mid-write never leaves a partial `.kvsnap`. Secrets in the stored
config (the API key, anything named like a key, token, secret or password) are redacted.

Where it goes is checked before anything is written (`check_target`): valid text, no NUL, a
directory that exists (never created, except the server's own snapshot dir; a path ending in `/`
names a directory, which must exist), and nothing replaced unless asked (`force`) — and even then
only a regular file, never through a symlink.

Reading (`kvtop.protocol.snapshot_reader`): replay opens a file lazily, `read_snapshot` loads it all.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtop.protocol.snapshot_format import SNAPSHOT_SCHEMA_VERSION, Snapshot, SnapshotError
from kvtop.protocol.snapshot_format import TABLES as TABLES  # where callers find it
from kvtop.protocol.snapshot_reader import load_snapshot

REDACTED = "<redacted>"
_SECRET = re.compile(r"(key|token|secret|password|passwd|credential)$")
_FILE_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFIFO: "a fifo", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}  # fmt: skip
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV}
MAX_PATH_BYTES = 4096


class SnapshotExists(SnapshotError):
    """The target exists and replacing it was not asked for."""


# ---- where a snapshot may go ----------------------------------------------------------------
def check_target(path: str | os.PathLike, *, force: bool = False) -> Path:
    """The absolute path a snapshot asked for at `path` may be written to (a directory: a fresh
    name is picked in it). Raises SnapshotError before anything is written: not text, a NUL, no
    such directory, something there that is not a regular file, or a file there and not `force`
    (SnapshotExists). Symlinks in the directory part are followed, the last part never is."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise SnapshotError(f"the snapshot path {text!r} is not valid UTF-8: rename it") from None
    if not text.strip():
        raise SnapshotError("the snapshot path is empty")
    if "\x00" in text:
        raise SnapshotError(f"the snapshot path {text!r} contains a NUL character")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise SnapshotError(f"the snapshot path {text!r} is not valid UTF-8: use a name that is text") from None
    if size > MAX_PATH_BYTES:
        raise SnapshotError(f"the snapshot path is {size} bytes long, over {MAX_PATH_BYTES}")
    target = Path(text).expanduser().absolute()
    st = _lstat(target)
    if st is not None and (stat.S_ISDIR(st.st_mode) or (stat.S_ISLNK(st.st_mode) and target.is_dir())):
        _check_dir(target)  # a directory (or a link to one): a fresh name in it, nothing replaced
        return target
    if text.endswith("/"):  # `-o incidents/` means a directory: never a file named `incidents`
        if st is None:
            raise SnapshotError(f"the directory {target} does not exist (snapshots never create directories)")
        raise SnapshotError(f"{target} is not a directory (a path ending in / names one)")
    _check_dir(target.parent)
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise SnapshotError(f"{target} exists and is {kind}: a snapshot only ever replaces a regular file")
        if not force:
            raise SnapshotExists(f"{target} already exists: pass --force to replace it, or choose another name")
    return target


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SnapshotError(f"cannot check {path}: {exc.strerror}") from None


def _check_dir(directory: Path) -> None:
    if not directory.exists():
        raise SnapshotError(f"the directory {directory} does not exist (snapshots never create directories)")
    if not directory.is_dir():
        raise SnapshotError(f"{directory} is not a directory")
    _probe_write(directory)


def _probe_write(directory: Path) -> None:
    """Create and remove a file in `directory`, the one test that holds everywhere: root passes
    os.access on /sys or /proc, which then refuse a new file. Before the snapshot's event is
    logged, so a write that cannot happen is a 400, never an event saying it was taken."""
    try:
        fd, name = tempfile.mkstemp(prefix=".kvsnap-probe-", dir=directory)
    except OSError as exc:
        raise SnapshotError(f"cannot write in {directory}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(name)


def redact(value: Any, name: str = "") -> Any:
    """A copy of a config with the value of every secret-looking name (`api_key`, `hf_token`,
    `password`…) replaced by "<redacted>" (None stays None: it says there was none)."""
    if value is not None and any(_SECRET.search(part) for part in re.split(r"[^a-z0-9]+", name.lower()) if part):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


# ---- writing --------------------------------------------------------------------------------
def block_rows(frame: dict, block_refs: list[int] | None = None) -> list[dict]:
    """The block table at the moment of `frame`: each block's state and the sequences holding it."""
    owners: dict[int, list[str]] = {}
    for seq in frame.get("sequences", []):
        for b in seq.get("block_ids", []):
            owners.setdefault(b, []).append(seq["id"])
    chars = frame["kv"].get("blocks") or ""  # a partial frame (another engine's /metrics) has no block map
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
    force: bool = True,
    fresh: bool = False,
    trace: tuple[dict, list[dict], list[dict]] | None = None,
) -> Path:
    """Write a snapshot atomically, mode 0600; returns the final path. The last frame gives the
    sequences and blocks tables (the state at the moment of the snapshot).

    `fresh`: the name is the writer's own (the server's automatic ones): its directory is
    created if need be and an existing name gets a `-1`, `-2`… suffix, so nothing is replaced.
    Otherwise the target is checked (`check_target`): `force=False` refuses an existing file;
    `force=True` replaces a regular file only (the library default; the server passes the
    operator's choice). `trace`: the engine's `trace_tables()` (header, requests, steps)."""
    if not frames:
        raise SnapshotError("nothing to snapshot: the flight recorder holds no frame yet")
    if fresh:
        path = Path(path).expanduser().absolute()
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        path = check_target(path, force=force)
        if path.is_dir():
            raise SnapshotError(f"{path} is a directory: give a file name")
    _remove_stale_temps(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # ours, from a write of this process that failed
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        _fill(tmp, model=model, config=config, reason=reason, frames=frames, events=events, block_refs=block_refs,
              trace=trace)  # fmt: skip
        return _install(tmp, path, force=force and not fresh, fresh=fresh)
    finally:
        tmp.unlink(missing_ok=True)


def _fill(tmp: Path, *, model: str, config: dict, reason: str, frames: list[dict], events: list[dict],
          block_refs: list[int] | None, trace: tuple[dict, list[dict], list[dict]] | None) -> None:  # fmt: skip
    import sqlite_utils

    db = sqlite_utils.Database(tmp)
    db["meta"].insert(
        {
            "schema_version": SNAPSHOT_SCHEMA_VERSION,
            "model": model,
            "config": json.dumps(redact(config), default=str),
            "reason": reason,
            "created": time.time(),
            "workload": json.dumps(trace[0]) if trace else None,
        },
        columns={"workload": str},
    )
    db["frames"].insert_all(
        ({"ts": f["ts"], "step": f["engine"].get("step"), "frame": json.dumps(f)} for f in frames),
        batch_size=200,
    )
    db["events"].insert_all(
        ({"ts": e["ts"], "kind": e["kind"], "seq_id": e.get("seq_id"), "detail": e.get("detail", "")} for e in events),
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
    # insert_all of no rows creates no table: an idle engine, or one with no block map, still writes a readable file
    for name, columns in (
        ("events", {"ts": float, "kind": str, "seq_id": str, "detail": str}),
        ("sequences", {"id": str, "state": str, "block_ids": str}),
        ("blocks", {"block_id": int, "state": str, "ref_count": int, "seq_ids": str}),
    ):
        if not db[name].exists():
            db[name].create(columns)
    _fill_trace(db, trace)
    db.conn.commit()
    db.close()


_REQUEST_COLUMNS = {"id": str, "arrival_time": float, "prompt_len": int, "block_hashes": str}
_STEP_COLUMNS = {"step": int, "start": float, "end": float, "admitted": str, "preempted": str}


def _fill_trace(db, trace: tuple[dict, list[dict], list[dict]] | None) -> None:
    """The `requests` and `steps` tables (engine/telemetry/trace.py's records; lists as JSON), empty without a trace."""
    _, requests, steps = trace or ({}, [], [])
    db["requests"].insert_all(({**r, "block_hashes": json.dumps(r["block_hashes"])} for r in requests),
                              columns=_REQUEST_COLUMNS, batch_size=500)  # fmt: skip
    db["steps"].insert_all(
        ({**s, "admitted": json.dumps(s["admitted"]), "preempted": json.dumps(s["preempted"])} for s in steps),
        columns=_STEP_COLUMNS,
        batch_size=500,
    )
    for name, columns in (("requests", _REQUEST_COLUMNS), ("steps", _STEP_COLUMNS)):
        if not db[name].exists():
            db[name].create(columns)


def _install(tmp: Path, path: Path, *, force: bool, fresh: bool) -> Path:
    """Move the finished temp file to `path`, replacing only what may be replaced."""
    if force:
        st = _lstat(path)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise SnapshotError(f"{path} is no longer a regular file: not replaced")
        os.replace(tmp, path)  # a rename replaces the name itself: it never writes through a symlink
        return path
    for candidate in _names(path, fresh):
        try:
            _link_new(tmp, candidate)
            return candidate
        except FileExistsError:
            if not fresh:
                raise SnapshotExists(f"{path} already exists: pass --force to replace it") from None
    raise SnapshotError(f"no free name for a snapshot beside {path}")


def _names(path: Path, fresh: bool) -> Iterator[Path]:
    yield path
    if fresh:
        for i in range(1, 1000):
            yield path.with_name(f"{path.stem}-{i}{path.suffix}")


def _link_new(tmp: Path, path: Path) -> None:
    """Give the temp file the name `path`, atomically, if and only if nothing has that name."""
    try:
        os.link(tmp, path)
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        # a filesystem without hard links: claim the name, then move the file over the claim
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        os.replace(tmp, path)


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
    """Open a snapshot read-only and load it all, or raise SnapshotError with a clear reason."""
    return load_snapshot(path)
