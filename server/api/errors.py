"""One error schema for every endpoint and stream, one map from exceptions to statuses, and one
message format for requests that fail validation.

Every error body is {"error": {"message", "type", "param", "code"}}, as OpenAI's API does it.
The engine process and the session cache raise plain Python exceptions, each of which declares
what a client sees for it (server/errors.py `RegisteredError`); `ERROR_KINDS`, the status table,
is built from those declarations, and nothing here repeats them.

Every error a client is answered with is counted once, by `count_error`
(xlserve_request_errors_total{model, type, code}), where it is answered: here for HTTP error
responses (the app's exception handlers and `send_error`, which the ASGI middlewares use),
and by serving for errors sent inside an SSE stream or as a websocket error frame.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Scope, Send

# the engine's and the cache's errors modules are imported for their classes: defining a class
# registers it (server/errors.py), and the table below is built from the registry
import xlserve.server.cache.errors  # noqa: F401
from xlserve.server.api.request_ids import REQUEST_ID_HEADER, request_id_of
from xlserve.server.engine.errors import Cancelled
from xlserve.server.errors import RegisteredError, answered_error_classes
from xlserve.server.metrics import error_code_label

log = logging.getLogger("xlserve.server")


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


class Forbidden(APIError):
    status, type = 403, "permission_error"


class NotFound(APIError):
    status, type = 404, "not_found_error"


class SessionBusy(APIError):
    status, type = 409, "session_busy"


class Conflict(APIError):
    status, type = 409, "conflict"


class RequestTimeout(APIError):
    status, type = 408, "invalid_request_error"  # as StreamNotRead, the other 408


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
BODY_NOT_AN_OBJECT = "the body must be a JSON object, sent with 'Content-Type: application/json'"
# pydantic's words for a string (a field name, say) that holds an unpaired surrogate
NOT_UTF8 = "text must be valid Unicode that can be encoded as UTF-8; a string holds an unpaired surrogate"


def json_syntax_message(what: str, reason: str, document: str, position: int) -> str:
    """"body is not valid JSON: Expecting ',' delimiter at line 1, column 9": where a JSON text
    went wrong, by line and column (1-based) as an editor shows them."""
    line = document.count("\n", 0, position) + 1
    column = position - document.rfind("\n", 0, position)
    return f"{what} is not valid JSON: {reason} at line {line}, column {column}"


def validation_error(errors: Sequence[Mapping], containers: Collection[str] = (),
                     code: str | None = None, document: Any = None) -> InvalidRequest:
    """The InvalidRequest for pydantic's validation errors: the first of them, named by the path
    of the field at fault ("stream_options.include_usage"), without the location parts in
    `containers`, which say where the field sat rather than what it is. FastAPI reports a body
    that is not JSON as an error at ("body", position) of `document`: that becomes a message
    with its line and column, and no param."""
    first = errors[0] if errors else {}
    location = tuple(first.get("loc", ()))
    kind = first.get("type")
    if kind == "json_invalid" and len(location) == 2 and isinstance(location[1], int):
        reason = str((first.get("ctx") or {}).get("error", "invalid JSON"))
        text = document if isinstance(document, str) else ""
        return InvalidRequest(json_syntax_message("body", reason, text, location[1]), code=code)
    if kind == "string_unicode":
        location = tuple(part for part in location if part not in containers)
        return InvalidRequest(NOT_UTF8, param=".".join(str(part) for part in location) or None,
                              code=code or "invalid_text")
    if location == ("body",):  # the body as a whole
        reason = "the request needs a JSON body" if kind == "missing" else BODY_NOT_AN_OBJECT
        return InvalidRequest(reason, code=code)
    parts = [str(part) for part in location if part not in containers]
    key = None
    if len(parts) >= 2 and parts[-1] == "[key]":  # a mapping's key is at fault, not a field
        key, parts = parts[-2], parts[:-2]
    param = ".".join(parts) or None
    if key is not None:
        reason = f"key '{key}': {first.get('msg', 'invalid key')}"
    elif kind == "extra_forbidden":
        reason = "unknown or unsupported field: this endpoint does not take it (no field is ignored silently)"
    else:
        reason = str(first.get("msg", "invalid request"))
    if kind == "invalid_text":  # the same code as text that cannot be UTF-8 in a URL (admission.py)
        code = code or "invalid_text"
    return InvalidRequest(f"{param}: {reason}" if param else reason, param=param, code=code)


# -- the one table: engine and cache exceptions -> what a client sees ----------------------------


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: str
    code: str | None = None  # when the exception carries none of its own
    param: str | None = None  # likewise
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, error_class: type[RegisteredError]) -> ErrorKind:
        """The row of an exception class, from what the class declares."""
        seconds = error_class.retry_after_seconds
        return cls(error_class.http_status, error_class.error_type, error_class.default_code,
                   error_class.default_param, {} if seconds is None else {"Retry-After": str(seconds)})


# every registered error a client is answered with a body for (the classes themselves say what;
# Cancelled is answered without one, by its own handler below)
ERROR_KINDS: dict[type[RegisteredError], ErrorKind] = {
    error_class: ErrorKind.of(error_class) for error_class in answered_error_classes()
}


# every `type` an error body can carry (the API errors' own, and those ERROR_KINDS maps to), and
# every status they are answered with
ERROR_TYPES = sorted({cls.type for cls in (APIError, *APIError.__subclasses__())}
                     | {kind.type for kind in ERROR_KINDS.values()})
ERROR_STATUSES = sorted({cls.status for cls in (APIError, *APIError.__subclasses__())}
                        | {kind.status for kind in ERROR_KINDS.values()})


def as_api_error(error: BaseException) -> APIError:
    """The APIError a client sees for any exception: API errors as they are, engine and cache
    errors through ERROR_KINDS, anything else a plain 500 that names only the class."""
    if isinstance(error, APIError):
        return error
    kind = next((ERROR_KINDS[cls] for cls in type(error).__mro__ if cls in ERROR_KINDS), None)
    if kind is None:
        return APIError(f"internal error: {type(error).__name__}")
    mapped = APIError(error.client_message(), param=getattr(error, "param", None) or kind.param,
                      code=getattr(error, "code", None) or kind.code, headers=dict(kind.headers))
    mapped.status, mapped.type = kind.status, kind.type
    return mapped


# -- counting: every error a client is answered with, once -----------------------------------------


def count_error(state: Any, error: APIError, model: str | None = None) -> None:
    """Count one error answer in xlserve_request_errors_total{model, type, code}, where it is
    answered (an HTTP error response, an error event in a stream, a websocket error frame).
    `state` is the app's AppState (None before the app has started: nothing to count in); `model`
    the model the request names, kept only when the server serves it ("" otherwise: a name a
    client chose must never become a label value); `code` the body's code when the error registry
    knows it ("none" without one: server/metrics.py `error_code_label`)."""
    if state is None:
        return
    label = model if isinstance(model, str) and model in state.models else ""
    state.metrics.request_errors.labels(label, error.type, error_code_label(error.code)).inc()


def requested_model(request: Request, body: Any = None) -> str | None:
    """The model a request names: `model` in its JSON body (`body`, or the one FastAPI parsed,
    which starlette keeps on the request; nothing is read here) or in its query string."""
    if body is None:
        body = getattr(request, "_json", None)
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        return body["model"]
    return request.query_params.get("model")


def _app_state(app: Any) -> Any:
    return getattr(app.state, "xlserve", None)


async def send_error(scope: Scope, send: Send, error: APIError) -> None:
    """Answer an HTTP request with `error` from an ASGI middleware (before any route runs), counted."""
    count_error(_app_state(scope["app"]), error)
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# a request whose client went away before its answer (nginx's code): nobody reads this answer,
# and it is no error of the server's, so it is not counted as one
CLIENT_CLOSED_REQUEST = Cancelled.http_status


class AsciiErrorResponse(JSONResponse):
    """An error body as ASCII JSON (non-ASCII escaped): whatever a message or param quotes,
    even text that cannot become UTF-8, can be sent, so an error never turns into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def install_error_handlers(app: FastAPI) -> None:
    """Whatever a route lets out becomes the one error body: API errors as raised, engine and
    cache errors through ERROR_KINDS, invalid requests in the one validation format, unknown
    paths and methods as their HTTP status, anything else a 500 that names only the class.
    Each is counted (`count_error`) as it is answered."""

    def answer(request: Request, error: APIError, body: Any = None, raised: BaseException | None = None) -> AsciiErrorResponse:
        model = getattr(raised if raised is not None else error, "session_model", None)  # session_lease's
        count_error(_app_state(request.app), error, model or requested_model(request, body))
        if error.status >= 500:  # the server's side: logged with the id the client was given
            log.warning("request %s (%s %s) answered %d %s: %s", request_id_of(request.scope), request.method,
                        request.url.path, error.status, error.code or error.type, error.message)
        return AsciiErrorResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return answer(request, error)

    @app.exception_handler(RegisteredError)  # Cancelled, one of them, has its own handler below
    async def _mapped(request: Request, error: Exception):
        return answer(request, as_api_error(error), raised=error)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError):
        invalid = validation_error(error.errors(), containers=REQUEST_PARTS, document=error.body)
        return answer(request, invalid, error.body)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):
        kinds = {400: InvalidRequest.type, 404: NotFound.type, 405: InvalidRequest.type, 413: RequestTooLarge.type}
        message = str(error.detail)
        # FastAPI answers a body its JSON parser choked on with a bare "error parsing the body":
        # say what it was
        cause = error.__cause__
        if isinstance(cause, RecursionError):
            message = "the body nests arrays and objects too deeply"
        elif isinstance(cause, UnicodeDecodeError):
            message = f"the body is not valid UTF-8: {cause.reason} at byte {cause.start}"
        elif isinstance(cause, ClientDisconnect):  # not a body it choked on: the client left while sending it
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        http_error = APIError(message, headers=dict(getattr(error, "headers", None) or {}))
        http_error.status, http_error.type = error.status_code, kinds.get(error.status_code, "http_error")
        return answer(request, http_error)

    @app.exception_handler(Cancelled)
    @app.exception_handler(ClientDisconnect)
    async def _cancelled(request: Request, error: Exception):
        # the client of a plain (not streamed) request went away and its generation was dropped,
        # or it went away while sending its body (a state upload cut off): no error of the server's
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception):
        # answered by Starlette's outermost middleware, outside RequestIdMiddleware: the id is
        # added here (`answer` logs it with the request: the traceback uvicorn logs after this
        # answer names neither)
        request_id = request_id_of(request.scope)
        response = answer(request, as_api_error(error), raised=error)
        if request_id is not None:
            response.headers[REQUEST_ID_HEADER] = request_id
        return response
