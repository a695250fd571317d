"""Admission of every HTTP request, as a plain ASGI middleware (it adds no cost per streamed
chunk, unlike a BaseHTTPMiddleware):

- a body over XLSERVE_MAX_REQUEST_BODY_BYTES gets 413 with a message naming the limit, from its
  Content-Length up front, or while reading a body sent without one (chunked); a session state's
  body (import, PUT state: binary, never parsed as JSON, hundreds of MB at real size) is under
  its own limit instead, XLSERVE_MAX_STATE_BODY_BYTES (AppState.state_body_limit);
- while the server drains for shutdown, new requests get 503 (`/health`, `/ready` and
  `/metrics` stay open so orchestrators can watch the drain);
- requests in flight are counted on the app state, so shutdown can wait for them to finish
  and commit their sessions before the cache closes;
- text at the edges: a URL path or query string that is not UTF-8 once percent-decoded (an
  encoded surrogate such as %ED%A0%80 included) gets 400, and so does a JSON body nested deeper
  than MAX_JSON_DEPTH (server/api/protocol.py), before any parser recurses into it. Both are
  plain answers on a connection that stays open for the next request. A body is JSON when its
  Content-Type says so: FastAPI (0.132 on, `strict_content_type`, left on) parses no other body as
  JSON, one without a Content-Type included;
- a body is read here only from a caller with one of the API keys, when the server has keys:
  without one the answer is 401 before the body is read, so that no one without a key can make
  the server read, scan and parse megabytes (every route that takes a body authenticates).

Websocket connections pass through: `/v1/stream` admits (and counts) each request it runs.
Every refusal here is counted as the error it is (server/api/errors.py `send_error`).
"""

from __future__ import annotations

import re
import time
from urllib.parse import unquote_to_bytes

import anyio

from starlette.types import ASGIApp, Receive, Scope, Send

from xlserve.server.api.deps import STATE_BODY_SETTING, authenticated_owner
from xlserve.server.api.errors import (APIError, InvalidRequest, RequestTimeout, RequestTooLarge, Unavailable,
                                       send_error)
from xlserve.server.api.protocol import json_depth_exceeded, too_deep

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})


def unreadable_target(scope: Scope) -> InvalidRequest | None:
    """The 400 for a path or query string that is not UTF-8 once percent-decoded, or None."""
    for part, raw in (("path", scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")),
                      ("query string", scope.get("query_string", b""))):
        try:
            unquote_to_bytes(raw).decode("utf-8")
        except UnicodeDecodeError as error:
            return InvalidRequest(f"the URL {part} is not valid UTF-8 once percent-decoded ({error.reason} at "
                                  f"byte {error.start}): text must be Unicode that can be encoded as UTF-8",
                                  code="invalid_text")
    return None


def is_json(headers: dict[bytes, bytes]) -> bool:
    media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    return media_type == b"application/json" or media_type.endswith(b"+json")


def authentication_error(state, headers: dict[bytes, bytes]) -> APIError | None:
    """The 401 for a request without one of the server's API keys (None when it has one, or the
    server has none): as the routes answer it (server/api/deps.py `owner_of`)."""
    if state is None or not state.api_keys:
        return None
    try:
        authenticated_owner(headers.get(b"authorization", b"").decode("latin-1"), state.api_keys)
    except APIError as error:
        return error
    return None


# a body admission reads (JSON, or one without a length) must have come within this, and after it
# keep coming at this rate on average: what a session state's body must do (serving/requests.py
# STATE_BODY_GRACE_SECONDS, STATE_BODY_BYTES_PER_SECOND; a test keeps the two the same)
BODY_GRACE_SECONDS = 30.0
BODY_BYTES_PER_SECOND = 256 * 1024

# the requests whose body is a session state (safetensors bytes), under their own limit
STATE_BODY_PATH = re.compile(r"^/v1/sessions/(import|[^/]+/state)$")


def carries_a_state(scope: Scope) -> bool:
    """A session-state upload: POST /v1/sessions/import or PUT /v1/sessions/{id}/state."""
    matched = STATE_BODY_PATH.match(scope["path"])
    return matched is not None and scope["method"] == ("POST" if matched.group(1) == "import" else "PUT")


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        state = getattr(scope["app"].state, "xlserve", None)
        if state is not None and state.draining:
            await send_error(scope, send, Unavailable("the server is shutting down and admits no new requests",
                                                      code="shutting_down"))
            return
        unreadable = unreadable_target(scope)
        if unreadable is not None:
            await send_error(scope, send, unreadable)
            return
        limit, setting = self.max_body_bytes, "XLSERVE_MAX_REQUEST_BODY_BYTES"
        state_upload = state is not None and carries_a_state(scope)
        if state_upload:
            limit, setting = state.state_body_limit(), STATE_BODY_SETTING
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:  # a header sent twice: its first value, as Starlette reads it
            headers.setdefault(name, value)
        length = headers.get(b"content-length")
        too_large = lambda size: RequestTooLarge(  # noqa: E731
            f"request body is {size} bytes; the limit is {limit} ({setting})")
        # a state sent while the models load is answered 503 loading by the gate after this one:
        # its limit is sized to the served models, none yet, and a 413 naming a limit of 8 MB
        # would tell a client with a 237 MB state that it can never fit
        loading = state_upload and not state.models and state.engine is not None
        if length is not None and length.isdigit() and int(length) > limit and not loading:
            await send_error(scope, send, too_large(int(length)))
            return
        json_body = is_json(headers)
        # a state's body is never buffered here, with a length or without: its route reads and
        # measures it (serving/requests.py read_body) once it holds a place among the states in
        # flight, which bounds the memory they take
        if scope["method"] in ("POST", "PUT", "PATCH"):
            # whatever its Content-Type: FastAPI reads a body of another type whole (a text/plain
            # one of 8 MB) before the route's own key check runs
            unauthenticated = authentication_error(state, headers)
            if unauthenticated is not None:
                await send_error(scope, send, unauthenticated)
                return
        if scope["method"] in ("POST", "PUT", "PATCH") and not state_upload and (json_body or length is None):
            # read (at most limit + 1 bytes of) the body here, then replay it: a body sent
            # without a length is measured, a JSON body's nesting checked
            messages, size, started = [], 0, time.monotonic()
            while True:
                # the state bodies' pace (after BODY_GRACE_SECONDS, BODY_BYTES_PER_SECOND): a
                # client that sends most of 8 MB and stops held them here for as long as it kept
                # its connection open, and a thousand such, 8 GB
                allowed = started + BODY_GRACE_SECONDS + size / BODY_BYTES_PER_SECOND - time.monotonic()
                try:
                    with anyio.fail_after(max(allowed, 0.0)):
                        message = await receive()
                except TimeoutError:
                    await send_error(scope, send, RequestTimeout(
                        f"the request body came slower than {BODY_BYTES_PER_SECOND} bytes/s after "
                        f"{BODY_GRACE_SECONDS:g}s ({size} bytes in {time.monotonic() - started:.0f}s)",
                        code="body_too_slow"))
                    return
                messages.append(message)
                if message["type"] != "http.request":
                    break
                size += len(message.get("body", b""))
                if size > limit:
                    await send_error(scope, send, too_large(f"more than {limit}"))
                    return
                if not message.get("more_body", False):
                    break
            if json_body and json_depth_exceeded(b"".join(m.get("body", b"") for m in messages)):
                await send_error(scope, send, too_deep("the body"))
                return
            replay, receive_from_client = iter(messages), receive

            async def receive_replayed():
                # the buffered messages first, then the client's (a disconnect, later)
                return next(replay, None) or await receive_from_client()

            receive = receive_replayed
        if state is not None:
            state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if state is not None:
                state.inflight -= 1
