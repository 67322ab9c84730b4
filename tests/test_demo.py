"""`make demo` without a terminal: the first screen a new user sees must show the KV cache
bounding concurrency (blocks short, waiting, preemptions, prefix hits and evictions), in words."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # serves SmolLM2-135M and drives ~30 requests at it


def test_demo_summary_shows_the_kv_cache_bounding_concurrency():
    proc = subprocess.run(
        [sys.executable, "-m", "kvtop.ctl.demo", "--no-dashboard", "--free", "4", "--max-tokens", "32"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "warning" not in out  # the demo's own configuration is coherent
    assert re.search(r"28 ok \(.*\), 0 failed", out), out
    assert re.search(r"peak 100 % of \d+ blocks \(\d+ tokens\): blocks ran short", out), out
    preemptions = int(re.search(r"preemptions\W+(\d+) \(a running request's blocks taken back", out).group(1))
    assert preemptions > 0
    waiting = int(re.search(r"and (\d+) waiting for a slot or blocks", out).group(1))
    assert waiting > 0
    hit = re.search(r"(\d+) % of prompt tokens hit .*?; (\d+) cached blocks evicted to make room", out)
    assert hit and int(hit.group(1)) > 0 and int(hit.group(2)) > 0, out
    assert "diagnosis (seen)" in out and "KV" in out.split("diagnosis (seen)")[1]
    assert "the KV cache, not compute, bounded concurrency" in out
    assert "server stopped (exit 0)" in proc.stderr
