"""What the engine tells its callers when it cannot do what was asked (used in both processes).

Plain Python exceptions: the engine process never imports the HTTP stack. The API layer maps
each of them to a status, an error type and headers in one table (server/api/errors.py); the
wire (server/engine/wire.py) carries them from the engine process to the API process by name.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's refusals: a message for the client, and optionally the request
    field at fault (`param`) and a machine-readable `code`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class InvalidInput(EngineError):
    """The request cannot run as asked (nothing to continue from, a state that does not fit)."""


class RequestFailed(EngineError):
    """This request alone could not be computed: its row of log-probabilities is not finite
    (code "sampling_failed"), or the model's forward raised for its row alone ("forward_failed").
    Every other request in the batch goes on."""


class ModelNotFound(EngineError):
    """No model of that name is loaded."""

    @classmethod
    def named(cls, name: str, served) -> "ModelNotFound":
        return cls(f"model '{name}' does not exist; served: {sorted(served)}", param="model", code="model_not_found")


class QueueFull(EngineError):
    """More requests wait for this model than XLSERVE_MAX_QUEUED_REQUESTS allows."""


class ShuttingDown(EngineError):
    """The server is draining for shutdown and admits no new work."""


class EngineGone(EngineError):
    """The engine process exited; nothing more can be served."""


class EngineRestarting(EngineError):
    """The engine process died and a new one is being started (its sessions are on disk, so
    nothing committed is lost); the request may be sent again shortly."""


class EngineLoading(EngineError):
    """The server has started but the engine process is still loading its models."""


class Cancelled(Exception):
    """The request was cancelled before it completed; nothing is committed."""
