"""Run a command while other processes keep every core busy, as on a shared CI machine.

A test that passes on a quiet machine and fails on a busy one has a race in it (a fixed timeout,
a sleep standing in for a condition). This finds them: `make test-busy` runs the whole suite
beside one busy-looping process per core (by default), at the same priority as the tests.

    .venv/bin/python scripts/beside_a_cpu_hog.py -- make test
    .venv/bin/python scripts/beside_a_cpu_hog.py --hogs 4 -- .venv/bin/python -m pytest -q tests/test_record.py

Exits with the command's status; the hogs end with it (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time


def _spin() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per core)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name a command after --")
    if args.hogs < 0:
        parser.error("--hogs must be >= 0")
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    started = time.monotonic()
    print(f"beside_a_cpu_hog: {args.hogs} busy processes beside: {' '.join(command)}", file=sys.stderr, flush=True)
    try:
        status = subprocess.call(command)
    except KeyboardInterrupt:
        status = 130
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.join()
    print(f"beside_a_cpu_hog: exit {status} after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
