"""Errors a user of the engine can hit. Each message says what to do about it."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request that can never be served as given (empty, too long, bad sampling values)."""


class ModelLoadError(EngineError):
    """The model could not be found, fetched or understood."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model exists but is not a Llama-family decoder this engine implements."""


class ConfigError(EngineError, ValueError):
    """An engine setting that cannot work (bad size string, budget too small for one block…)."""


class EngineDrainingError(EngineError):
    """The engine is draining or drained and admits no new requests until resumed."""
