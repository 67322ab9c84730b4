"""A request trace as a file: the JSONL format (docs/whatif.md), and `load_trace`, which reads one
from a JSONL file or from a `.kvsnap` snapshot's `requests` and `steps` tables.

JSONL: one JSON object a line, each with a `type`. The first line is the `header`
(`{"type": "header", "format": 1, "source": ..., "config": {...} | null}`: the engine that ran
the trace, engine/telemetry/trace.py's `trace_header`); then `request` lines (kvtop/protocol/trace.py's
`RequestRecord` fields) and, when the engine wrote it, `step` lines (`StepRecord` fields).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtop.protocol.errors import KvtopError
from kvtop.protocol.trace import RequestRecord, StepRecord

TRACE_FORMAT = 1
_REQUIRED = {"id": str, "arrival_time": (int, float), "prompt_len": int, "block_hashes": list, "max_tokens": int}


class TraceError(KvtopError):
    """A trace that cannot be read or replayed: the message says what is wrong and what to do."""


@dataclass
class Trace:
    source: str  # what it was read from, for messages
    config: dict | None  # engine/telemetry/trace.py's trace_header; None: a client's trace
    requests: list[RequestRecord]
    steps: list[StepRecord] = field(default_factory=list)
    model: str = ""

    @property
    def start(self) -> float:
        return min(r.arrival_time for r in self.requests)


def write_jsonl(path: str | Path, trace: Trace, source: str) -> None:
    """Write `trace` as JSONL (header, requests, steps)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"type": "header", "format": TRACE_FORMAT, "source": source, "config": trace.config}) + "\n")
        for r in trace.requests:
            f.write(json.dumps({"type": "request", **asdict(r)}) + "\n")
        for s in trace.steps:
            f.write(json.dumps({"type": "step", **asdict(s)}) + "\n")


def read_jsonl(path: Path) -> Trace:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read ({exc})") from None
    lines = text.splitlines()
    header: dict | None = None
    requests, steps = [], []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        obj = _line(path, i, line, last=i == len(lines) and not text.endswith("\n"))
        kind = obj.get("type")
        if kind == "header":
            header = obj
        elif kind == "request":
            requests.append(_request(path, i, obj))
        elif kind == "step":
            steps.append(_step(path, i, obj))
        else:
            raise TraceError(f"{path}:{i}: a line of type {kind!r}: expected header, request or step (docs/whatif.md)")
    if header is None:
        raise TraceError(f"{path}: no header line: not a kvtop trace (docs/whatif.md describes the format)")
    if header.get("format") != TRACE_FORMAT:
        raise TraceError(f"{path}: trace format {header.get('format')!r}, this kvtop reads {TRACE_FORMAT}")
    config = header.get("config") if isinstance(header.get("config"), dict) else None
    return _checked(Trace(str(path), config, requests, steps, str((config or {}).get("model", ""))))


def _line(path: Path, i: int, line: str, last: bool) -> dict:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        hint = " (the file ends mid-line: a truncated trace?)" if last else ""
        raise TraceError(f"{path}:{i}: not a JSON object{hint}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{path}:{i}: not a JSON object")
    return obj


def _request(path: Path | str, i: int | str, d: dict) -> RequestRecord:
    for name, kind in _REQUIRED.items():
        value = d.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TraceError(f"{path}:{i}: request without a valid {name!r} ({value!r})")
    if not math.isfinite(d["arrival_time"]) or d["prompt_len"] < 1 or d["max_tokens"] < 1:
        raise TraceError(f"{path}:{i}: request {d['id']!r} has a bad arrival_time, prompt_len or max_tokens")
    try:
        return RequestRecord.from_dict(d)
    except TypeError as exc:
        raise TraceError(f"{path}:{i}: bad request record ({exc})") from None


def _step(path: Path | str, i: int | str, d: dict) -> StepRecord:
    try:
        s = StepRecord.from_dict(d)
        float(s.start), float(s.end), int(s.prefill_tokens), int(s.decode_seqs), int(s.context_tokens)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{path}:{i}: bad step record ({exc})") from None
    return s


def _checked(trace: Trace) -> Trace:
    if not trace.requests:
        raise TraceError(f"{trace.source}: the trace holds no requests")
    trace.requests.sort(key=lambda r: r.arrival_time)
    return trace


def read_snapshot_trace(path: Path) -> Trace:
    """The trace a `.kvsnap` holds, or TraceError saying why there is none."""
    from kvtop.protocol.snapshot_reader import SnapshotReader

    with SnapshotReader(path) as r:
        has_tables, (requests, steps) = r.has_trace_tables(), r.trace_rows()
        meta = r.meta
    if not has_tables or not requests or not meta.get("workload"):
        why = "written before request traces (schema version 1)" if not has_tables else "it holds no request trace"
        raise TraceError(
            f"{path}: {why}; what-if needs one — take a new snapshot from a kvtop engine of this version "
            "(another engine's `kvctl record` has none), or pass a trace JSONL (`kvctl bench --trace-out`)"
        )
    reqs = [_request(path, f"request {i + 1}", d) for i, d in enumerate(requests)]
    st = [_step(path, f"step {i + 1}", d) for i, d in enumerate(steps)]
    return _checked(Trace(str(path), meta["workload"], reqs, st, meta.get("model", "")))


def load_trace(path: str | Path) -> Trace:
    """A trace from a `.kvsnap` (its `requests`/`steps` tables) or a trace JSONL."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    with open(path, "rb") as f:
        head = f.read(16)
    if head == b"SQLite format 3\x00":
        return read_snapshot_trace(path)
    return read_jsonl(path)
