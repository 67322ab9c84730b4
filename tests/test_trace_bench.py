"""`kvctl bench --trace FILE --trace-out OUT` against a real server on the tiny model: a recorded
trace replayed open loop at its arrivals, with synthesized prompts that keep the recorded lengths
and prefix sharing, written back as a trace."""

from __future__ import annotations

import json

import pytest

from engine.whatif.synthetic import synthetic_trace
from engine.whatif.timing import StepTimeModel
from kvtop.ctl.bench_trace import trace_requests
from kvtop.protocol.trace_file import load_trace, write_jsonl
from tests.server_harness import kvctl, start_server
from tests.test_whatif_cli import HEADER


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = start_server(tiny_dir, "--kv-cache-memory", "4MiB", "--max-num-batched-tokens", "256")
    yield s
    s.stop()


def small_trace(tmp_path):
    trace = synthetic_trace(8, rate=20, prompt_len=(20, 60), output_len=(3, 8), system_len=32, systems=1, config=HEADER)
    write_jsonl(tmp_path / "in.jsonl", trace, "test")
    return trace, tmp_path / "in.jsonl"


def test_trace_prompts_keep_lengths_sharing_and_arrivals(tmp_path):
    trace, path = small_trace(tmp_path)
    reqs = trace_requests(path)
    assert [len(r.prompt) for r in reqs] == [r.prompt_len for r in trace.requests]
    assert [r.max_tokens for r in reqs] == [r.output_len for r in trace.requests]
    assert [r.at for r in reqs] == pytest.approx([r.arrival_time - trace.start for r in trace.requests])
    shared = [r for r, t in zip(reqs, trace.requests, strict=True) if t.block_hashes[0].startswith("s0")]
    assert len(shared) >= 2 and all(r.prompt[:32] == shared[0].prompt[:32] for r in shared)
    assert len({tuple(r.prompt[-4:]) for r in reqs}) == len(reqs), "each request's own tokens are its own"


def test_bench_replays_a_trace_and_writes_one(server, tmp_path):
    trace, path = small_trace(tmp_path)
    r = kvctl("bench", "--base-url", server.url, "--trace", str(path), "--trace-out", str(tmp_path / "out.jsonl"))
    assert r.returncode == 0, r.stderr
    out = load_trace(tmp_path / "out.jsonl")
    assert out.config is None and len(out.requests) == 8
    assert [x.prompt_len for x in out.requests] == [x.prompt_len for x in trace.requests]
    assert [x.output_len for x in out.requests] == [x.output_len for x in trace.requests]
    gaps = [b.arrival_time - a.arrival_time for a, b in zip(out.requests, out.requests[1:], strict=False)]
    want = [b.arrival_time - a.arrival_time for a, b in zip(trace.requests, trace.requests[1:], strict=False)]
    assert sum(gaps) == pytest.approx(sum(want), abs=0.3), "open loop at the recorded arrivals"
    hashes = [x.block_hashes[0] for x in out.requests if len(x.block_hashes) > 1]
    assert len(set(hashes)) < len(hashes), "the shared prefix is still shared"


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_a_bad_trace_for_bench_is_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"type": "header", "format": 1}\n{"type": "request", "id": "x"')
    r = kvctl("bench", "--base-url", "http://127.0.0.1:9", "--trace", str(tmp_path / "bad.jsonl"))
    assert r.returncode != 0 and "Traceback" not in r.stderr and "truncated" in r.stderr


def test_a_live_servers_snapshot_holds_its_trace_and_whatif_reads_it(server, tmp_path):
    _, path = small_trace(tmp_path)
    assert kvctl("bench", "--base-url", server.url, "--trace", str(path)).returncode == 0
    server.wait_idle()
    snap = tmp_path / "live.kvsnap"
    r = kvctl("snapshot", "--socket", str(server.socket), "-o", str(snap))
    assert r.returncode == 0, r.stderr
    trace = load_trace(snap)
    assert len(trace.requests) >= 8 and trace.steps and trace.config["block_size"] == 16
    cal = tmp_path / "cal.json"
    StepTimeModel((0.005, 2e-5, 2e-4, 1e-8), 0.0005, source="test").save(cal)
    r = kvctl("whatif", str(snap), "--calibration", str(cal), "--max-num-seqs", "2", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["recorded"]["requests"] == doc["whatif"]["requests"] == len(trace.requests)
    assert doc["whatif"]["concurrency_mean"] <= 2
