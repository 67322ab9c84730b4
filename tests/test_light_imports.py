"""The tools stand without the engine: every kvtop module imports with neither torch, transformers,
fastapi, uvicorn nor the engine loaded, and a command that runs the engine, where it is missing,
says in one line what to install (issue #38). The install itself, a wheel in a fresh venv, is
tests/test_light_install.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # each test runs Python processes: start-up seconds each

HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "triton", "numpy", "engine")

IMPORT_EVERY_KVTOP_MODULE = """
import importlib, json, pkgutil, sys
import kvtop
names = [m.name for m in pkgutil.walk_packages(kvtop.__path__, "kvtop.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "loaded": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def test_every_kvtop_module_imports_without_the_engine_or_torch():
    done = subprocess.run([sys.executable, "-c", IMPORT_EVERY_KVTOP_MODULE], capture_output=True, text=True,
                          timeout=300, check=True)  # fmt: skip
    report = json.loads(done.stdout)
    assert {"kvtop.ctl.serve_cmd", "kvtop.ctl.run_cmd", "kvtop.dashboard.app", "kvtop.protocol.snapshot_reader",
            "kvtop.sources.replay", "kvtop.ctl.bench_trace"} <= set(report["imported"])  # fmt: skip
    assert len(report["imported"]) > 60
    loaded = [name for name in HEAVY if name in report["loaded"]]
    assert loaded == [], f"importing kvtop loaded {loaded}"


# the engine's dependencies made absent in this process only, as in a light install
WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # `import torch` now raises ModuleNotFoundError, as where it is not installed
from kvtop.ctl.cli import main
main(sys.argv[1:])
"""


def _kvctl_without_torch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True, text=True, timeout=300)


def test_a_command_that_runs_the_engine_says_what_to_install(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    gguf = tmp_path / "model.gguf"  # a .gguf's shape is read by the engine's reader
    gguf.write_bytes(b"GGUF")
    for args in (["serve"], ["run", str(prompts)], ["plan", str(gguf)], ["calibrate"]):
        done = _kvctl_without_torch(*args)
        assert done.returncode == 1, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, (args, done.stderr)
        assert 'pip install "kvtop[engine]"' in lines[0] and f"kvctl {args[0]}" in lines[0], lines[0]


def test_the_talking_commands_work_without_torch(tmp_path):
    """`kvctl status` with no engine there is the usual one line and exit 2, not a missing torch;
    `--help` of an engine command lists its flags (declared from kvtop.protocol.config)."""
    done = _kvctl_without_torch("status", "--socket", str(tmp_path / "none.sock"))
    assert done.returncode == 2, done.stderr
    assert "no engine at" in done.stderr and "kvtop[engine]" not in done.stderr
    helped = _kvctl_without_torch("serve", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--kv-cache-memory" in helped.stdout and "--max-queue" in helped.stdout


def test_plan_works_without_torch_and_agrees_with_the_full_install(tiny_dir):
    """`kvctl plan` is the seed's arithmetic: a preset or a config.json needs no engine, and the figures
    are the ones the full install prints (which tests/test_plan.py checks against a live engine)."""
    llama = _kvctl_without_torch("plan", "llama3-8b", "--memory", "80GiB", "--json")
    assert llama.returncode == 0, llama.stderr
    auto = json.loads(llama.stdout)["options"][0]
    assert auto["bytes_per_token"] == 32 * 2 * 8 * 128 * 2  # layers × K,V × KV heads × head_dim × bf16
    args = ("plan", str(tiny_dir / "config.json"), "--kv-cache-memory", "3MiB", "--json", "--context", "100")
    light = _kvctl_without_torch(*args)
    full = subprocess.run([sys.executable, "-m", "kvtop.ctl.cli", *args], capture_output=True, text=True, timeout=300)
    assert light.returncode == 0 and full.returncode == 0, (light.stderr, full.stderr)
    assert json.loads(light.stdout) == json.loads(full.stdout)
