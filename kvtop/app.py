"""kvtop: the live KV-cache dashboard (being built; see issue "kvtop: the live dashboard")."""

from __future__ import annotations

import sys


def main() -> None:
    print("kvtop: the dashboard is not built yet; use `kvctl run` for now", file=sys.stderr)
    sys.exit(2)
