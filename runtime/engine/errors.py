"""How a request can end without its output, as the server's routes see it (each maps to an HTTP status)."""

from __future__ import annotations


class QueueFullError(Exception):
    """More requests are waiting than max_waiting allows (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine (its thread, or its core process) stopped; no request can make progress."""


class RequestFailedError(RuntimeError):
    """This request alone failed inside the engine (a bug it triggered); the engine goes on serving others."""


class RequestCancelledError(RuntimeError):
    """The server ended this request before it finished (its drain timeout passed)."""


class EngineNotReadyError(RuntimeError):
    """The engine core has not loaded the model yet: nothing can be checked against it (HTTP 503, retry)."""


class ModelNotFoundError(ValueError):
    """The request names a model or LoRA adapter this engine does not serve (HTTP 404)."""

    def __init__(self, name: str):
        super().__init__(f"The model `{name}` does not exist.")
        self.name = name
