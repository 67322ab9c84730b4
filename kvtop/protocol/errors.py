"""The errors both sides raise on purpose: each message says what to do, and kvctl and kvtop
print it as one line (kvtop/entry.py). The engine's own (`engine.errors.EngineError` and its
kinds) derive from `KvtopError` too, so the tools need not import the engine to catch them."""


class KvtopError(Exception):
    """Base class of every error kvtop raises on purpose, in the engine or in the tools."""


class ConfigError(KvtopError, ValueError):
    """A setting that cannot work (bad size string, budget too small for one block…)."""
