"""One error schema for every endpoint and stream, one map from exceptions to statuses, and one
message format for requests that fail validation.

Every error body is {"error": {"message", "type", "param", "code"}}, as OpenAI's API does it.
The engine process and the session cache raise plain Python exceptions; `ERROR_KINDS` is the one
place that says what a client sees for each of them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from xlserve.server.cache.errors import (
    CacheError,
    CacheFull,
    SessionConflict,
    SessionLocked,
    SessionNotFound,
    SessionUnavailable,
)
from xlserve.server.engine.errors import EngineError, EngineGone, InvalidInput, ModelNotFound, QueueFull, ShuttingDown


class APIError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequest(APIError):
    status, type = 400, "invalid_request_error"


class AuthenticationFailed(APIError):
    status, type = 401, "authentication_error"


class NotFound(APIError):
    status, type = 404, "not_found_error"


class SessionBusy(APIError):
    status, type = 409, "session_busy"


class Conflict(APIError):
    status, type = 409, "conflict"


class RequestTooLarge(APIError):
    status, type = 413, "request_too_large"


class TooManyRequests(APIError):
    status, type = 429, "rate_limit_error"


class Unavailable(APIError):
    status, type = 503, "service_unavailable"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- request validation: one message format for HTTP bodies and websocket frames -----------------

REQUEST_PARTS = frozenset({"body", "query", "path"})  # where FastAPI found a field: not part of its name


def validation_error(errors: Sequence[Mapping], containers: Collection[str] = (),
                     code: str | None = None) -> InvalidRequest:
    """The InvalidRequest for pydantic's validation errors: the first of them, named by the path
    of the field at fault ("stream_options.include_usage"), without the location parts in
    `containers`, which say where the field sat rather than what it is."""
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part not in containers]
    param = ".".join(location) or None
    reason = str(first.get("msg", "invalid request"))
    return InvalidRequest(f"{param}: {reason}" if param else reason, param=param, code=code)


# -- the one table: engine and cache exceptions -> what a client sees ----------------------------


def _session_message(text: str):
    return lambda error: text.format(session=error.session_id or "")


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: str
    code: str | None = None  # when the exception carries none of its own
    param: str | None = None  # likewise
    headers: dict[str, str] = field(default_factory=dict)
    message: Callable[[BaseException], str] = str


ERROR_KINDS: dict[type[BaseException], ErrorKind] = {
    InvalidInput: ErrorKind(InvalidRequest.status, InvalidRequest.type),
    ModelNotFound: ErrorKind(NotFound.status, NotFound.type, code="model_not_found", param="model"),
    QueueFull: ErrorKind(TooManyRequests.status, TooManyRequests.type, code="queue_full",
                         headers={"Retry-After": "1"}),
    ShuttingDown: ErrorKind(Unavailable.status, Unavailable.type, code="shutting_down"),
    EngineGone: ErrorKind(Unavailable.status, Unavailable.type, code="engine_gone"),
    SessionNotFound: ErrorKind(NotFound.status, NotFound.type, code="session_not_found", param="session_id",
                               message=_session_message("session '{session}' does not exist")),
    SessionLocked: ErrorKind(SessionBusy.status, SessionBusy.type, code="session_busy", param="session_id",
                             message=_session_message("session '{session}' is busy with another request; "
                                                      "retry when it finishes")),
    SessionConflict: ErrorKind(Conflict.status, Conflict.type, code="session_version_conflict", param="session_id",
                               message=_session_message(
                                   "session '{session}' was changed by another request (another replica) since "
                                   "this one started; nothing was written. Retry from the current version")),
    CacheFull: ErrorKind(Unavailable.status, Unavailable.type, code="session_cache_full", param="session_id",
                         headers={"Retry-After": "1"}),
    SessionUnavailable: ErrorKind(Unavailable.status, Unavailable.type, code="session_unavailable",
                                  param="session_id"),
}


def as_api_error(error: BaseException) -> APIError:
    """The APIError a client sees for any exception: API errors as they are, engine and cache
    errors through ERROR_KINDS, anything else a plain 500 that names only the class."""
    if isinstance(error, APIError):
        return error
    kind = next((ERROR_KINDS[cls] for cls in type(error).__mro__ if cls in ERROR_KINDS), None)
    if kind is None:
        return APIError(f"internal error: {type(error).__name__}")
    mapped = APIError(kind.message(error), param=getattr(error, "param", None) or kind.param,
                      code=getattr(error, "code", None) or kind.code, headers=dict(kind.headers))
    mapped.status, mapped.type = kind.status, kind.type
    return mapped


def install_error_handlers(app: FastAPI) -> None:
    """Whatever a route lets out becomes the one error body: API errors as raised, engine and
    cache errors through ERROR_KINDS, invalid requests in the one validation format, unknown
    paths and methods as their HTTP status, anything else a 500 that names only the class."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(CacheError)
    @app.exception_handler(EngineError)
    async def _mapped(request: Request, error: Exception):
        api_error = as_api_error(error)
        return JSONResponse(api_error.body(), status_code=api_error.status, headers=api_error.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError):
        invalid = validation_error(error.errors(), containers=REQUEST_PARTS)
        return JSONResponse(invalid.body(), status_code=invalid.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):
        kinds = {404: NotFound.type, 405: InvalidRequest.type, 413: RequestTooLarge.type}
        return JSONResponse(error_body(str(error.detail), kinds.get(error.status_code, "http_error")),
                            status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception):
        api_error = as_api_error(error)
        return JSONResponse(api_error.body(), status_code=api_error.status)
