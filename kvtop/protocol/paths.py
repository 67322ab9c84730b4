"""Where kvtop keeps what it fetches and builds: models, wheels, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("KVTOP_CACHE") or Path.home() / ".cache" / "kvtop")
