"""`kvctl run` as a user runs it: a real subprocess, a JSONL in, a JSONL and a summary out."""

from __future__ import annotations

import json
import subprocess
import sys

BIN = [sys.executable, "-m", "kvtop.ctl.cli"]


def kvctl(*args, **kw):
    return subprocess.run([*BIN, *args], capture_output=True, text=True, timeout=300, **kw)


def test_run_writes_outputs_and_summary(tmp_path, tiny_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(x)
            for x in [
                {"id": "a", "prompt": "Hello there", "max_tokens": 5},
                {"id": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
                {"prompt_token_ids": [5, 6, 7, 8]},
            ]
        )
    )
    out = tmp_path / "out.jsonl"
    proc = kvctl("run", str(prompts), "-o", str(out), "--model", str(tiny_dir), "--dtype", "float32",
                 "--kv-cache-memory", "4MiB", "--max-tokens", "4", "--ignore-eos", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 3
    assert summary["generated_tokens"] == 5 + 3 + 4
    assert summary["ttft_s"]["p50"] > 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b", "3"]
    assert [r["completion_tokens"] for r in records] == [5, 3, 4]
    assert all(r["finish_reason"] == "length" for r in records)


def test_run_table_summary(tmp_path, tiny_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    proc = kvctl("run", str(prompts), "--model", str(tiny_dir), "--kv-cache-memory", "4MiB", "--max-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    for label in ("requests", "throughput", "TTFT ms P50/P95/P99", "preemptions", "peak KV usage"):
        assert label in proc.stdout
    assert "generating" in proc.stderr  # the progress bar


def test_run_errors_are_one_line(tmp_path, tiny_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json}\n')
    cases = [
        (["run", str(tmp_path / "missing.jsonl")], "no such prompts file"),
        (["run", str(bad), "--model", str(tiny_dir), "--kv-cache-memory", "4MiB"], "bad.jsonl:2: not JSON"),
        (["run", str(bad), "--kv-cache-memory", "lots"], "cannot read size 'lots'"),
        (["run", str(bad), "--model", "no-such-model"], "unknown model 'no-such-model'"),
    ]
    for args, message in cases:
        proc = kvctl(*args)
        assert proc.returncode != 0
        assert message in proc.stderr
        assert "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr  # the engine's load line at most
