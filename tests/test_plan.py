"""`kvctl plan` agrees with what a live engine actually allocates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import LLM
from engine.planning import plan


@pytest.mark.parametrize("kvd", ["auto", "fp8_e4m3", "int8"])
def test_plan_matches_the_engine(tiny_dir, kvd):
    llm = LLM(str(tiny_dir), dtype="bfloat16", kv_cache_memory="3MiB", kv_cache_dtype=kvd, quiet=True)
    kv = llm.stats()["kv"]
    p = plan(str(tiny_dir), dtype="bfloat16", kv_cache_memory=3 * 1024**2, contexts=[100, 1000])
    option = next(o for o in p.options if o.kv_cache_dtype == kvd)
    assert option.bytes_per_token == kv["bytes_per_token"]
    assert option.num_blocks == kv["num_blocks"]
    assert option.max_seqs[100] == kv["num_blocks"] // 7  # 100 tokens need 7 blocks of 16
    assert p.weights_bytes == llm.stats()["memory"]["weights"]


def test_plan_gqa_saving_and_cli_json(tiny_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "kvtop.cli", "plan", str(tiny_dir / "config.json"), "--memory", "1GiB", "--json",
         "--context", "512,2048"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["gqa_saving"] == 2.0  # 4 query heads over 2 KV heads
    auto = body["options"][0]
    assert auto["mha_bytes_per_token"] == 2 * auto["bytes_per_token"]
    assert body["kv_memory_bytes"] == 1024**3 - body["weights_bytes"]
    assert set(auto["max_seqs"]) == {"512", "2048"}


def test_plan_table_and_errors(tiny_dir):
    ok = subprocess.run([sys.executable, "-m", "kvtop.cli", "plan", str(tiny_dir), "--kv-cache-memory", "1GiB"],
                        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "bytes/element" in ok.stdout and "GQA" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "kvtop.cli", "plan", "no-such-model"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "unknown model" in bad.stderr and "Traceback" not in bad.stderr
