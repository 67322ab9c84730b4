"""The engine's environment knobs (engine/runtime/knobs.py): one table holds every `KVTOP_*` variable the
engine reads, docs/engine.md lists each, and a value that is not one of a knob's choices stops
`kvctl run` with one line naming them rather than falling back to a default unseen."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from engine.runtime.knobs import KNOBS, knob
from kvtop.protocol.errors import ConfigError
from tests.server_harness import kvctl

ROOT = Path(__file__).resolve().parents[1]
TOOLS_OWN = {"KVTOP_SOCKET", "KVTOP_SOCKET_OWNER", "KVTOP_CACHE", "KVTOP_API_KEY"}  # kvctl's and kvtop's options


def test_every_variable_the_engine_names_is_in_the_table_and_the_docs():
    named = set()
    for path in (ROOT / "engine").rglob("*.py"):
        named |= set(re.findall(r"\bKVTOP_[A-Z0-9_]+\b", path.read_text()))
    assert named - TOOLS_OWN == set(KNOBS), "a KVTOP_ variable read outside engine/runtime/knobs.py's table"
    docs = (ROOT / "docs" / "engine.md").read_text()
    table = docs[docs.index("## Environment knobs") :]
    for name, k in KNOBS.items():
        row = next((line for line in table.splitlines() if line.startswith(f"| `{name}`")), None)
        assert row is not None, f"{name} is not in docs/engine.md's table"
        assert f"`{k.default}`" in row or not k.default, row


def test_a_value_outside_the_choices_names_them(monkeypatch):
    monkeypatch.setenv("KVTOP_LARGE_GEMM", "sometimes")
    with pytest.raises(ConfigError, match=r"KVTOP_LARGE_GEMM='sometimes': use one of auto, 1, 0 \(default auto\)"):
        knob("KVTOP_LARGE_GEMM")
    monkeypatch.setenv("KVTOP_LARGE_GEMM", " 0 ")
    assert knob("KVTOP_LARGE_GEMM") == "0"
    monkeypatch.delenv("KVTOP_LARGE_GEMM")
    assert knob("KVTOP_LARGE_GEMM") == "auto"


def test_kvctl_run_with_a_bad_knob_is_one_line(tmp_path, tiny_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    env = {**os.environ, "KVTOP_FUSED_DECODE": "maybe"}
    r = kvctl("run", str(prompts), "--model", str(tiny_dir), "--kv-cache-memory", "4MiB", "--max-tokens", "2", env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith("KVTOP_FUSED_DECODE='maybe': use one of 1, 0 (default 1)")
