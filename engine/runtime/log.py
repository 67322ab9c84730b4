"""The engine's one log line format: `[kvtop] message` on stderr, flushed (the server's stderr is
the operator's log)."""

from __future__ import annotations

import sys


def log(msg: str) -> None:
    print(f"[kvtop] {msg}", file=sys.stderr, flush=True)
