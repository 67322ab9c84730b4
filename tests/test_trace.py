"""The request trace (engine/telemetry/trace.py): what the engine records of each request and step, in a
snapshot's `requests`/`steps` tables and as JSONL — a real engine on the tiny model."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

import pytest

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from kvtop.protocol.config import EngineConfig
from kvtop.protocol.snapshot import read_snapshot, write_snapshot
from kvtop.protocol.snapshot_reader import SnapshotReader
from kvtop.protocol.trace_file import Trace, TraceError, load_trace, write_jsonl

SNAPSHOTS = Path(__file__).parent.parent / "snapshots"
BLOCK_BYTES = 16 * 512  # the tiny model, float32: 2 layers × K,V × 2 heads × 16 dims × 4 B a token


def workload(seed: int = 0, n: int = 14) -> list[tuple[int, list[int], SamplingParams]]:
    """(arrival step, prompt ids, params): half share a 40-token system prompt, lengths mixed."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 40000) for _ in range(40)]
    out = []
    for i in range(n):
        own = [rng.randrange(100, 40000) for _ in range(rng.randint(8, 40))]
        prompt = (system + own) if i % 2 == 0 else own + own[:5]
        out.append((i * 2 + rng.randint(0, 2), prompt, SamplingParams(max_tokens=rng.randint(12, 40), ignore_eos=True)))
    return out


def record(model_dir: Path, blocks: int = 20, block_bytes: int = BLOCK_BYTES, **knobs) -> LLMEngine:
    """Run `workload()` on a real engine (arrivals by step) and return it, done."""
    cfg = EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=blocks * block_bytes, max_num_seqs=6,
                       max_num_batched_tokens=48, **knobs)  # fmt: skip
    engine = LLMEngine(cfg, quiet=True)
    pending = workload()
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            engine.add_request(prompt, params)
        engine.step()
        step += 1
    return engine


@pytest.fixture(scope="module")
def recorded(tiny_dir) -> LLMEngine:
    return record(tiny_dir)


def test_the_engine_records_every_request_and_step(recorded):
    header, requests, steps = recorded.trace_tables()
    assert len(requests) == 14 and all(r["finish_reason"] == "length" for r in requests)
    assert header["num_blocks"] == 20 and header["block_size"] == 16 and header["num_layers"] == 2
    shared = [r for r in requests if r["prompt_len"] >= 48]
    assert len({r["block_hashes"][1] for r in shared}) == 1, "the shared system prompt's blocks hash alike"
    assert sum(r["preemptions"] for r in requests) > 0 and sum(r["cached_tokens"] for r in requests) > 0
    assert len(steps) == recorded.step_count
    assert sum(len(s["admitted"]) for s in steps) >= 14
    assert 0 < sum(s["decode_seqs"] for s in steps) < sum(r["output_len"] for r in requests)
    for r in requests:
        assert r["output_len"] == r["max_tokens"]
        assert len(r["block_hashes"]) == (r["prompt_len"] + r["output_len"]) // 16
        assert r["arrival_time"] <= r["first_scheduled_time"] <= r["first_token_time"] <= r["finished_time"]


def test_the_trace_keeps_no_text_and_its_hashes_are_salted(recorded, tiny_dir):
    _, requests, _ = recorded.trace_tables()
    text = json.dumps(requests)
    assert "token_ids" not in text and 'prompt"' not in text
    other = record(tiny_dir)
    assert other.trace_tables()[1][0]["block_hashes"] != requests[0]["block_hashes"], "each engine salts its own"


def test_a_snapshot_holds_the_trace(recorded, tmp_path):
    path = write_snapshot(tmp_path / "t.kvsnap", model="tiny", config={}, reason="test", frames=[recorded.stats()],
                          events=[], trace=recorded.trace_tables())  # fmt: skip
    snap = read_snapshot(path)
    assert snap.meta["schema_version"] == 2 and snap.meta["workload"]["num_blocks"] == 20
    assert len(snap.requests) == 14 and isinstance(snap.requests[0]["block_hashes"], list)
    assert len(snap.steps) == recorded.step_count and isinstance(snap.steps[0]["admitted"], list)
    trace = load_trace(path)
    assert [r.id for r in trace.requests] == sorted((r["id"] for r in snap.requests), key=lambda i: int(i[4:]))
    assert trace.steps[0].duration > 0


def test_jsonl_round_trip(recorded, tmp_path):
    header, requests, steps = recorded.trace_tables()
    snap = write_snapshot(tmp_path / "t.kvsnap", model="tiny", config={}, reason="x", frames=[recorded.stats()],
                          events=[], trace=(header, requests, steps))  # fmt: skip
    trace = load_trace(snap)
    write_jsonl(tmp_path / "t.jsonl", trace, "test")
    again = load_trace(tmp_path / "t.jsonl")
    assert again.config == header and again.requests == trace.requests and again.steps == trace.steps


@pytest.mark.parametrize("name", ["preemption-storm.kvsnap", "prefix-thrash.kvsnap", "engines/vllm-under-load.kvsnap"])
def test_older_snapshots_still_open_and_say_they_have_no_trace(name):
    path = SNAPSHOTS / name
    snap = read_snapshot(path)
    assert snap.meta["schema_version"] == 1 and snap.requests == [] and snap.frames
    with SnapshotReader(path) as r:
        assert not r.has_trace_tables() and r.frame(0)
    with pytest.raises(TraceError, match="schema version 1"):
        load_trace(path)


def test_a_snapshot_of_no_requests_has_empty_trace_tables(tmp_path):
    frame = json.loads(
        sqlite3.connect(SNAPSHOTS / "prefix-thrash.kvsnap").execute("select frame from frames").fetchone()[0]
    )
    path = write_snapshot(tmp_path / "e.kvsnap", model="m", config={}, reason="r", frames=[frame], events=[])
    with SnapshotReader(path) as r:
        assert r.has_trace_tables() and r.trace_rows() == ([], [])
    with pytest.raises(TraceError, match="holds no request trace"):
        load_trace(path)


def test_a_truncated_jsonl_trace_is_one_clear_error(recorded, tmp_path):
    header, requests, _ = recorded.trace_tables()
    trace = Trace("x", header, [load_trace_record(r) for r in requests])
    write_jsonl(tmp_path / "t.jsonl", trace, "test")
    text = (tmp_path / "t.jsonl").read_text()
    (tmp_path / "cut.jsonl").write_text(text[: len(text) // 2])
    with pytest.raises(TraceError, match="truncated"):
        load_trace(tmp_path / "cut.jsonl")


def load_trace_record(d: dict):
    from kvtop.protocol.trace import RequestRecord

    return RequestRecord.from_dict(d)
