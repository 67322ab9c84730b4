"""glibc malloc's settings for an engine that runs on the CPU: keep freed memory for the next step.

A prefill step allocates and frees hundreds of MB of activations (gate/up alone is 12.6 MB a layer
at 2,048 tokens). By default glibc gives freed memory back to the OS — it trims the heap's top,
unmaps chunks above its mmap threshold, and shrinks a thread's own arena — so the next step faults
every page in again, zeroed by the kernel. Measured in `kvctl serve`, where the engine steps in its
own thread (its own arena): 50–240 K page faults over `kvctl bench --num-prompts 32 --input-len 256
--output-len 128 --max-concurrency 16`, 100 K in one 2,048-token step; with the settings below, under
1 K over the whole run, and that load's TTFT P50 1.46–2.22 s → 1.21–1.44 s (five alternated starts
each way). The cost: the process keeps its peak heap (the largest step's activations) instead of
returning it between steps.

The settings: one arena for every thread (the engine thread's allocations go to the main heap, which
the trim threshold governs), no trimming below 1 GiB of free top, 64 MiB of padding when the heap
grows, and a fixed mmap threshold of 32 MiB (glibc's largest), so that a step's tensors come from
the heap. `KVTOP_MALLOC=0` keeps glibc's defaults; elsewhere than glibc nothing is done.

Memory freed at load is not a step's: `return_free_memory` hands the heap's free pages back
(malloc_trim) once the weights are where they stay (engine/runtime/huge_pages.py moves them).
"""

from __future__ import annotations

import ctypes
import functools
import platform

from engine.runtime.knobs import knob

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8
SETTINGS = ((M_ARENA_MAX, 1), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20), (M_MMAP_THRESHOLD, 32 << 20))


@functools.cache
def keep_freed_memory() -> bool:
    """Apply SETTINGS once per process (before the engine's threads start, so that they share the
    main arena). True when they are in force. (Two first calls at once would both apply them: the
    same values, no harm.)"""
    if knob("KVTOP_MALLOC") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)


def return_free_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing): after a
    load that freed what it copied, that memory is not kept for steps to come."""
    if platform.libc_ver()[0] != "glibc":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
