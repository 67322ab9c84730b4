"""`kvctl plan` agrees with what a live engine actually allocates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import LLM
from engine.runtime import devices
from kvtop.planning import plan
from kvtop.protocol.config import CPU_DEFAULT_KV_MEMORY


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
        [sys.executable, "-m", "kvtop.ctl.cli", "plan", str(tiny_dir / "config.json"), "--memory", "1GiB", "--json",
         "--context", "512,2048"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["gqa_saving"] == 2.0  # 4 query heads over 2 KV heads
    auto = body["options"][0]
    assert auto["mha_bytes_per_token"] == 2 * auto["bytes_per_token"]
    # vLLM's --gpu-memory-utilization 0.9: the engine may take 90 % of the memory, weights first
    assert body["kv_memory_bytes"] == int(1024**3 * 0.9) - body["weights_bytes"]
    assert set(auto["max_seqs"]) == {"512", "2048"}


def test_plan_table_and_errors(tiny_dir):
    ok = subprocess.run([sys.executable, "-m", "kvtop.ctl.cli", "plan", str(tiny_dir), "--kv-cache-memory", "1GiB"],
                        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "bytes/element" in ok.stdout and "GQA" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "kvtop.ctl.cli", "plan", "no-such-model"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "unknown model" in bad.stderr and "Traceback" not in bad.stderr


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtop.ctl.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_plan_refuses_weights_that_do_not_fit_in_one_line():
    # Llama-3-8B in bf16 is 15 GiB of weights: 8 GiB (7.2 GiB usable) leaves nothing for KV
    proc = _plan("llama3-8b", "--memory", "8GiB")
    assert proc.returncode == 1
    assert proc.stdout == ""  # no table of zeros
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "the weights (15.0 GiB) do not fit in 7.2 GiB usable (8.0 GiB × 0.9)" in lines[0]


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_plan_memory_and_kv_budget_agree_or_are_refused():
    ok = _plan("llama3-8b", "--memory", "80GiB", "--kv-cache-memory", "8GiB", "--json")
    assert ok.returncode == 0, ok.stderr
    body = json.loads(ok.stdout)
    assert body["kv_memory_bytes"] == 8 * 1024**3  # the KV budget asked for, not what the memory leaves
    assert body["memory_bytes"] == 80 * 1024**3 and body["gpu_memory_utilization"] == 0.9
    table = _plan("llama3-8b", "--memory", "80GiB", "--kv-cache-memory", "8GiB")
    assert "8.0 GiB for KV (of 57.0 GiB left: 80.0 GiB × 0.9 − 15.0 GiB weights)" in " ".join(table.stdout.split())
    too_much = _plan("llama3-8b", "--memory", "80GiB", "--kv-cache-memory", "70GiB")
    assert too_much.returncode == 1 and len(too_much.stderr.strip().splitlines()) == 1
    assert "at most 57.0 GiB is left for KV" in too_much.stderr


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_plan_flags_a_context_beyond_the_models_positions_and_takes_utilization():
    proc = _plan("llama3-8b", "--memory", "80GiB", "--context", "8192,32768")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "context 32768 is beyond the model's max_position_embeddings 8192" in text
    assert "context 8192 is beyond" not in text
    body = json.loads(_plan("llama3-8b", "--memory", "80GiB", "--gpu-memory-utilization", "0.5", "--json").stdout)
    assert body["kv_memory_bytes"] == 40 * 1024**3 - body["weights_bytes"]
    assert body["options"][0]["bytes_per_token"] == 32 * 2 * 8 * 128 * 2  # layers × K,V × kv heads × dim × bf16


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_plan_counts_the_default_models_blocks_and_says_a_gpu_would_dequantize_them():
    """The default (--quantization auto, --device cpu) counts a GGUF's weights as the CPU holds them; a
    GPU operator reading the plan is told that the engine there de-quantizes, and how to plan that:
    --device cuda counts them de-quantized, and the KV gets what that leaves."""
    blocks = " ".join(_plan("smollm2-135m", "--memory", "8GiB").stdout.split())
    assert "92.0 MiB of Q4_1, Q8_0, bfloat16 weights" in blocks
    assert "on a GPU the engine de-quantizes them to bfloat16: plan that with --device cuda" in blocks
    dense = " ".join(_plan("smollm2-135m", "--memory", "8GiB", "--quantization", "none").stdout.split())
    assert "of bfloat16 weights" in dense and "de-quantizes" not in dense
    assert "the engine's KV gets 256.0 MiB + the 164.5 MiB they save = 420.5 MiB" in blocks
    gpu = _plan("smollm2-135m", "--memory", "8GiB", "--device", "cuda")
    assert "Weights counted in bfloat16, as the engine holds them on cuda" in " ".join(gpu.stdout.split())
    cpu_json = json.loads(_plan("smollm2-135m", "--memory", "8GiB", "--json").stdout)
    gpu_json = json.loads(_plan("smollm2-135m", "--memory", "8GiB", "--device", "cuda", "--json").stdout)
    assert gpu_json["weights_bytes"] == gpu_json["parameters"] * 2 > cpu_json["weights_bytes"]
    assert (
        gpu_json["kv_memory_bytes"]
        == cpu_json["kv_memory_bytes"] - gpu_json["weights_bytes"] + cpu_json["weights_bytes"]
    )
    assert gpu_json["cpu_auto_kv_bytes"] is None and cpu_json["cpu_auto_kv_bytes"] > 0
    bad = _plan("smollm2-135m", "--device", "tpu")
    assert bad.returncode == 1 and bad.stderr.strip() == "kvctl: --device 'tpu' is not one of cpu, cuda"


def test_the_cpu_auto_kv_gets_what_quantized_weights_save_as_the_plan_says(monkeypatch):
    """SmolLM2's Q4_1 file held as blocks takes 92 MiB where float32 takes 513: with no
    --kv-cache-memory the KV cache gets the default 256 MiB plus the 421 MiB saved, the figure
    `kvctl plan` gives; de-quantized, the default alone. (The host's free memory, which caps the
    growth, is held at 64 GiB here: a machine short of memory is the next test's.)"""
    monkeypatch.setattr(devices, "host_memory_available", lambda: 64 * 1024**3)
    p = plan("smollm2-135m", dtype="float32", kv_cache_memory=CPU_DEFAULT_KV_MEMORY)
    assert p.bytes_saved > 400 * 1024**2
    quantized = LLM("smollm2-135m", dtype="float32", quiet=True)  # quantization auto: the blocks
    assert quantized.engine.kv_budget == p.cpu_auto_kv_bytes
    kv, quantized_weights = quantized.stats()["kv"], quantized.stats()["memory"]["weights"]
    assert kv["num_blocks"] == p.cpu_auto_kv_bytes // (kv["bytes_per_token"] * kv["block_size"])
    assert "(auto: 256.0 MiB + 421.0 MiB the weights' blocks save)" in quantized.engine.summary()
    del quantized
    dense = LLM("smollm2-135m", dtype="float32", quantization="none", quiet=True)
    assert p.bytes_saved == p.parameters * 4 - quantized_weights  # the plan's saving: float32 less the blocks
    assert dense.stats()["memory"]["weights"] == p.parameters * 4  # ... is what the de-quantized load holds
    assert dense.engine.kv_budget == CPU_DEFAULT_KV_MEMORY and "blocks save" not in dense.engine.summary()
    assert dense.stats()["kv"]["num_blocks"] == 364  # 5,824 tokens, as before


def test_the_cpu_auto_kv_takes_at_most_half_the_free_memory(monkeypatch):
    """A large saving (an 8B Q4_K file against float32: ~27 GB) never takes the host's last memory:
    the growth stops at half of what is available, and a host with little free keeps the default."""
    mib = 1024**2
    assert devices.host_memory_available() > 0
    monkeypatch.setattr(devices, "host_memory_available", lambda: 600 * mib)
    assert devices.cpu_kv_growth(421 * mib) == 300 * mib - CPU_DEFAULT_KV_MEMORY
    assert devices.cpu_kv_growth(20 * mib) == 20 * mib and devices.cpu_kv_growth(0) == 0
    monkeypatch.setattr(devices, "host_memory_available", lambda: 300 * mib)
    assert devices.cpu_kv_growth(421 * mib) == 0
