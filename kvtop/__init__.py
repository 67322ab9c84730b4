"""The operator side of kvtop: the `kvctl` CLI and the `kvtop` dashboard, and `kvtop.protocol`,
what they and the engine share. Kept light: importing it loads neither torch nor the engine."""

from kvtop.protocol.version import __version__

__all__ = ["__version__"]
