"""What a `.kvsnap` is, for both its writer (`kvtop.protocol.snapshot`) and its reader
(`kvtop.protocol.snapshot_reader`): the schema version, the tables, the loaded `Snapshot`, and the
error either raises. Callers import these from `kvtop.protocol.snapshot`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvtop.protocol.errors import KvtopError

SNAPSHOT_SCHEMA_VERSION = 2  # 2: the request trace (`requests`, `steps`, meta `workload`; engine/telemetry/trace.py)
READABLE_VERSIONS = (1, 2)
TABLES = ("meta", "frames", "events", "sequences", "blocks")  # every version has these
TRACE_TABLES = ("requests", "steps")  # version 2 on


class SnapshotError(KvtopError):
    """A snapshot that cannot be written where asked, or a file that cannot be read: missing,
    not SQLite, truncated, or not kvtop's."""


@dataclass
class Snapshot:
    path: Path
    meta: dict
    frames: list[dict]
    events: list[dict]
    sequences: list[dict]
    blocks: list[dict]
    requests: list[dict] = field(default_factory=list)  # empty: no trace (version 1, or another engine's)
    steps: list[dict] = field(default_factory=list)
