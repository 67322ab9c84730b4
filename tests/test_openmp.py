"""One OpenMP team per process (engine/runtime/openmp.py): a thread done with parallel regions gives its
worker threads back, so that the engine thread's team is the only one and its idle workers keep
spinning between kernels instead of sleeping (what cost `kvctl serve` a third of its throughput)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch  # noqa: F401  (maps libgomp into this process, for the skip below)

from engine.runtime.openmp import loaded_libgomp

SCRIPT = r"""
import os, sys, threading
import torch
torch.set_num_threads(2)  # one worker thread per pool, whatever the machine

def compute():
    x = torch.ones(4_000_000)
    for _ in range(5):
        x = x * 1.0001 + 1  # element-wise ops over 4M floats: parallel regions in every build

from engine.runtime.openmp import release_thread_pool

compute()  # the main thread's pool (as `kvctl serve` loads and warms up)
released = release_thread_pool() if sys.argv[1] == "release" else False
go, done = threading.Event(), threading.Event()

def engine_thread():
    compute()  # the engine thread's pool
    go.set()
    done.wait()

t = threading.Thread(target=engine_thread)
t.start()
go.wait()
print(released, len(os.listdir("/proc/self/task")))
done.set()
t.join()
"""


def _threads(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    released, threads = out.stdout.split()
    return released, int(threads)


@pytest.mark.skipif(loaded_libgomp() is None, reason="this torch does not use libgomp")
@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_the_main_threads_openmp_workers_go_when_released():
    kept, with_both = _threads("keep")
    released, with_one = _threads("release")
    assert kept == "False" and released == "True"
    assert with_both - with_one == 1  # the main thread's one worker is gone; the engine thread's stays


def test_release_is_off_when_asked(monkeypatch):
    from engine.runtime.openmp import release_thread_pool

    monkeypatch.setenv("KVTOP_OMP_RELEASE", "0")
    assert release_thread_pool() is False
