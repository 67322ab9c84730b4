"""A CPU engine keeps the memory a step frees for the next step (engine/runtime/host_memory.py): a tensor of a
step's size allocated again after it was freed faults no page in. Each case runs in a fresh
process, since malloc's settings are process-wide and earlier tests move glibc's own thresholds."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Allocate, touch and free 24 MiB twice through malloc (as two steps' activations would be: torch's
# CPU tensors come from malloc too, but its huge-page advice makes their fault counts erratic); report
# the page faults of the second time, and whether the settings are in force. With an engine: built
# first, from argv[1].
PROBE = """
import ctypes, json, resource, sys, threading
from engine.runtime.host_memory import keep_freed_memory
if len(sys.argv) > 1:
    from engine import LLM
    LLM(sys.argv[1], dtype="float32", kv_cache_memory="8MiB", quiet=True)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
def step():
    p = libc.malloc(24 << 20)
    libc.memset(p, 1, 24 << 20)
    libc.free(p)
faults = {}
def run():  # on a thread of its own, as kvctl serve's engine steps
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults["second"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
t = threading.Thread(target=run); t.start(); t.join()
print(json.dumps({"faults": faults["second"], "kept": keep_freed_memory() if len(sys.argv) == 1 else None}))
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")


def probe(*args: str, malloc: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVTOP_MALLOC", None)
    if malloc is not None:
        env["KVTOP_MALLOC"] = malloc
    hook = "from engine.runtime.host_memory import keep_freed_memory\n"
    code = PROBE if args else PROBE.replace(hook, hook + "keep_freed_memory()\n", 1)
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc
def test_a_cpu_engine_keeps_freed_memory(tiny_dir):
    assert probe(str(tiny_dir))["faults"] < 200  # 6,144 pages of 4 KiB if the memory went back


@glibc
@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_the_settings_are_what_keeps_it():
    """The same probe without an engine: with the settings no page faults again; with KVTOP_MALLOC=0
    (glibc's defaults) the second allocation faults its pages in again, so the test above can fail."""
    tuned = probe(malloc=None)
    assert tuned["kept"] is True and tuned["faults"] < 200
    plain = probe(malloc="0")
    assert plain["kept"] is False and plain["faults"] > 3000
