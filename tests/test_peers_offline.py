"""`benchmarks/peers.py` offline, ours alone on a tiny load: the figures and tokens it reports come from
the engine configured as asked (the README's tables are read off this script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ours_runs_with_the_kv_cache_dtype_asked_and_says_so(smollm2_dir, tmp_path):
    out = tmp_path / "peers.json"
    cmd = [sys.executable, "benchmarks/peers.py", "--engines", "ours", "--dtype", "float32", "--workload", "fixed",
           "--num-prompts", "2", "--output-len", "4", "--kv-gib", "1", "--kv-cache-dtype", "int8", "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    [result] = json.loads(out.read_text())
    assert result["engine"] == "ours" and result["info"]["kv_cache_dtype"] == "int8"  # the engine's own stats
    [run] = result["runs"]["fixed"]
    assert [len(t) for t in run["tokens"]] == [4, 4] and run["tok_s"] > 0
    assert "ours: the KV cache in int8 (the peers keep the model's dtype)" in r.stdout
    assert "float32   fixed    ours" in r.stdout
