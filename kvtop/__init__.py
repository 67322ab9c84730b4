"""The operator side of kvtop: the `kvctl` CLI and the `kvtop` dashboard."""

__version__ = "0.1.0"
