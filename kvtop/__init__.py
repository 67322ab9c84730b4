"""The operator side of kvtop: the `kvctl` CLI and the `kvtop` dashboard."""

from engine.version import __version__

__all__ = ["__version__"]
