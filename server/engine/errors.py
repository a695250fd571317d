"""What the engine tells its callers when it cannot do what was asked (used in both processes).

Plain Python exceptions: the engine process never imports the HTTP stack. Each class declares
what a client sees when it is raised (a status number, an error type, a default code; the
attributes of `RegisteredError`, server/errors.py), and defining it registers it: the wire
(server/engine/wire.py) carries it from the engine process to the API process by name, and the
API's status table (server/api/errors.py) is built from the same registry.
"""

from __future__ import annotations

from typing import Any

from xlserve.server.errors import RegisteredError


class EngineError(RegisteredError, abstract=True):
    """Base of the engine's refusals: a message for the client, and optionally the request
    field at fault (`param`) and a machine-readable `code`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def wire_fields(self) -> dict[str, Any]:
        return {"message": self.message, "param": self.param, "code": self.code}

    @classmethod
    def from_wire_fields(cls, fields: dict[str, Any]) -> EngineError:
        return cls(fields.get("message", ""), param=fields.get("param"), code=fields.get("code"))


class InvalidInput(EngineError):
    """The request cannot run as asked (nothing to continue from, a state that does not fit)."""

    http_status, error_type = 400, "invalid_request_error"


class ContextLengthExceeded(InvalidInput):
    """The request would take the context past the model's `max_context`, where the model stops
    (models/interface.py `history_limit`: the Reformer's position embeddings end there): the
    session's history plus the prompt or appended text, plus the first token of a generation.
    Refused when it is queued (`Engine.check_context`), before anything runs."""

    default_code = "context_length_exceeded"


class MessageTooLarge(EngineError):
    """The request's message to the engine process would be over the frame header the engine
    process reads (server/engine/wire.py MAX_HEADER_BYTES: a constraint's text under a raised
    XLSERVE_STRUCTURED_MAX_BYTES, say; token ids cross as the blob). Refused in the API process
    before it is sent: the
    engine process would stop at such a frame, and every other request with it."""

    http_status, error_type, default_code = 413, "request_too_large", "message_too_large"


class RequestFailed(EngineError):
    """This request alone could not be computed: its row of log-probabilities is not finite
    (code "sampling_failed"), or the model's forward raised for its row alone ("forward_failed").
    Every other request in the batch goes on."""

    http_status, error_type, default_code = 500, "internal_error", "sampling_failed"
    internal = True

    def client_message(self) -> str:
        # which part of this one request failed, and that nothing was committed, is the client's
        # to know: the message names no more than that
        return self.message


class StateNotUsable(EngineError):
    """A request that continues a session got a next-token row that is not finite: the values
    came from the session's state (an import or PUT can hold a state that passes every check at
    the door and still overflows later), not from a fault of the server, so the client is told
    to replace or delete the session. Only this request fails; nothing is committed."""

    http_status, error_type, default_code, default_param = 422, "invalid_request_error", "state_not_usable", "session_id"


class ModelNotFound(EngineError):
    """No model of that name is loaded."""

    http_status, error_type, default_code, default_param = 404, "not_found_error", "model_not_found", "model"

    @classmethod
    def named(cls, name: str, served) -> "ModelNotFound":
        return cls(f"model '{name}' does not exist; served: {sorted(served)}", param="model", code="model_not_found")


class QueueFull(EngineError):
    """More requests wait for this model than XLSERVE_MAX_QUEUED_REQUESTS allows."""

    http_status, error_type, default_code = 429, "rate_limit_error", "queue_full"
    retry_after_seconds = 1


class DeviceOutOfMemory(EngineError):
    """The model's device ran out of memory for this request's own work (checking an imported
    state): nothing about the request is wrong, and the memory may be free in a moment."""

    http_status, error_type, default_code = 503, "service_unavailable", "device_out_of_memory"
    retry_after_seconds = 1


class ShuttingDown(EngineError):
    """The server is draining for shutdown and admits no new work."""

    http_status, error_type, default_code = 503, "service_unavailable", "shutting_down"


class EngineGone(EngineError):
    """The engine process exited; nothing more can be served."""

    http_status, error_type, default_code = 503, "service_unavailable", "engine_gone"


class EngineRestarting(EngineError):
    """The engine process died and a new one is being started (its sessions are on disk, so
    nothing committed is lost); the request may be sent again shortly."""

    http_status, error_type, default_code = 503, "service_unavailable", "engine_restarting"
    retry_after_seconds = 2


class EngineLoading(EngineError):
    """The server has started but the engine process is still loading its models."""

    http_status, error_type, default_code = 503, "service_unavailable", "loading"
    retry_after_seconds = 2


class StreamNotRead(EngineError):
    """A stream's client stopped reading: its socket is full and its events waited unread past the
    bound (types.py `MAX_UNREAD_LOGPROBS`). The request is stopped and nothing is committed, so
    that one client that does not read holds no memory for good. Sent as the stream's last event,
    for a client that reads again. (A write that waits XLSERVE_STREAM_SEND_TIMEOUT_SECONDS ends the
    stream itself instead: completions.py EventStream, routers/ws.py.)"""

    http_status, error_type, default_code = 408, "invalid_request_error", "stream_not_read"


class Cancelled(RegisteredError):
    """The request was cancelled before it completed; nothing is committed."""

    # nginx's "client closed request": the client went away, so the answer has no body (nobody
    # reads it), and it is no error of the server's
    http_status, error_type = 499, None

    @classmethod
    def from_wire_fields(cls, fields: dict[str, Any]) -> Cancelled:
        return cls()
