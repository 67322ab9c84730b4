"""Errors a user of the engine can hit. Each message says what to do about it.

All derive from `kvtop.protocol.errors.KvtopError`, which the tools catch; `ConfigError` lives
there too, since the configs it guards are the protocol's (kvtop/protocol/config.py)."""

from kvtop.protocol.errors import KvtopError


class EngineError(KvtopError):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request that can never be served as given (empty, too long, bad sampling values)."""


class ModelLoadError(EngineError):
    """The model could not be found, fetched or understood."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model exists but is not a Llama-family decoder this engine implements."""


class EngineDrainingError(EngineError):
    """The engine is draining or drained and admits no new requests until resumed."""


class ServeError(EngineError):
    """The server cannot start as asked (socket taken, port busy, bad setting)."""
