"""One error schema for every endpoint and stream, and one map from exceptions to statuses.

Every error body is {"error": {"message", "type", "param", "code"}}, as OpenAI's API does it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.cache import CacheError


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


def model_not_found(name: str, served) -> NotFound:
    """The 404 for a model that is not loaded (the API and the engine process both raise it)."""
    return NotFound(f"model '{name}' does not exist; served: {sorted(served)}", param="model", code="model_not_found")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def as_api_error(error: BaseException) -> APIError:
    """Map any exception to the APIError a client sees (internal ones become a plain 500)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, CacheError):  # mapped in one place, next to the other session errors
        from server.api.deps import session_errors

        return session_errors(error, error.session_id or "")
    return APIError(f"internal error: {type(error).__name__}")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(CacheError)
    async def _cache_error(request: Request, error: CacheError):
        api_error = as_api_error(error)
        return JSONResponse(api_error.body(), status_code=api_error.status, headers=api_error.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        location = [str(part) for part in first.get("loc", []) if part not in ("body", "query", "path")]
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg", "invalid request"))
        return JSONResponse(error_body(message, InvalidRequest.type, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):
        kinds = {404: NotFound.type, 405: InvalidRequest.type, 413: RequestTooLarge.type}
        return JSONResponse(error_body(str(error.detail), kinds.get(error.status_code, "http_error")),
                            status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception):
        api_error = as_api_error(error)
        return JSONResponse(api_error.body(), status_code=api_error.status)
