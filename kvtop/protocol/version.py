"""kvtop's version: the engine and the operator tools ship as one distribution (pyproject.toml)."""

__version__ = "0.1.0"
