"""The GPU check's engine script (`benchmarks/gpu_engine.py`), dry-run on the CPU.

CI has no GPU, and a GPU is lent to few sessions: a script that rotted between two leases would
waste one. Its `--device cpu` mode runs the same code (our C++ kernels instead of Triton), so
here it must still run to the end, find the float32 tokens equal to transformers' through the
prefix cache, and write its speed and profile rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_engine_check_runs_on_the_cpu_and_finds_the_tokens_equal(smollm2_dir, tmp_path):
    out = tmp_path / "engine.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_engine.py"), "--device", "cpu", "--batches", "2",
           "--profile-batches", "2", "--profile-torch-batches", "1", "--model-dir", str(smollm2_dir),
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["dtype"], r["kv"]): r for r in result["tokens"]}
    assert set(rows) == {("float32", "auto"), ("float32", "int8"), ("float32", "fp8_e4m3"), ("bfloat16", "auto")}
    exact = rows["float32", "auto"]
    assert exact["equal_first_pass"] == exact["equal_second_pass"] == exact["prompts"] == 16
    assert exact["prefix_hit_tokens"] > 0  # the second pass really came from the prefix cache
    assert all(r["passes_equal"] == 16 for r in rows.values())  # greedy is deterministic, cache or not
    (speed,) = result["speed"]
    assert speed["batch"] == 2 and speed["ours_tok_s"] > 0 and speed["transformers_tok_s"] > 0
    assert "equal to transformers: 16/16 first pass" in proc.stdout
    # where a decode step's time goes: the step, and our ops in it; then again with torch's element-wise
    # ops (on a GPU; the CPU backend keeps its own, and the row names the kernels that ran)
    profile, torch_ops = result["profile"]
    assert profile["batch"] == 2 and profile["wall_ms_per_step"] > 0 and torch_ops["batch"] == 1
    assert any(op["name"].startswith("kvtop_cpu::") for op in profile["top_host_ops"])
    assert profile["kernels"] == torch_ops["kernels"] == exact["kernels"] == "engine.kernels.cpu"
    assert profile["launches_per_step"] == 0  # no GPU, no launches
    assert "launches from the host" in proc.stdout


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_the_gpu_engine_check_refuses_a_machine_without_a_gpu_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_engine.py")], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "benchmarks/gpu_engine.py: needs a CUDA GPU and torch sees none (--device cpu for a dry run)"
    ]
