"""One OpenMP team per process: release the worker threads of a thread that is done computing.

libgomp keeps a pool of worker threads for every thread that has started a parallel region, and
once the process holds more such threads than it has CPUs it stops letting idle workers spin
between regions: each region then wakes its worker through a futex and waits for it at the end.
`kvctl serve` loads the model and warms it up on the main thread (one pool) and steps it on the
engine thread (a second): on a 2-core machine every kernel of every step paid that wake-up. Measured
with `kvctl bench --num-prompts 32 --input-len 256 --output-len 128 --max-concurrency 16`, bf16
SmolLM2, two servers alternated four times: 309 → 474 output tok/s, ITL P50 44 → 27.5 ms, TTFT P50
648 → 572 ms, once the main thread's pool is released after the warm-up (benchmarks/HISTORY.md).

`release_thread_pool()` frees the calling thread's pool with OpenMP 5.0's `omp_pause_resource_all`
on the libgomp this process has loaded (torch's). Elsewhere (another OpenMP runtime, none loaded)
it does nothing and says so by returning False; `KVTOP_OMP_RELEASE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os

from engine.runtime.knobs import knob

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads, not only idle them
ENV = "KVTOP_OMP_RELEASE"


def loaded_libgomp() -> str | None:
    """The path of the libgomp mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if "libgomp" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def release_thread_pool() -> bool:
    """Free the OpenMP worker threads that parallel regions started from the calling thread. Call it
    on a thread that will run no more parallel regions (a later one would start a new pool). True
    when the runtime did it."""
    if knob(ENV) == "0":
        return False
    path = loaded_libgomp()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = (ctypes.c_int,), ctypes.c_int
    return pause(OMP_PAUSE_HARD) == 0
