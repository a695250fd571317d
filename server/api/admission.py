"""Admission of every HTTP request, as a plain ASGI middleware (it adds no cost per streamed
chunk, unlike a BaseHTTPMiddleware):

- a body over XLSERVE_MAX_REQUEST_BODY_BYTES gets 413 with a message naming the limit, from its
  Content-Length up front, or while reading a body sent without one (chunked);
- while the server drains for shutdown, new requests get 503 (`/health`, `/ready` and
  `/metrics` stay open so orchestrators can watch the drain);
- requests in flight are counted on the app state, so shutdown can wait for them to finish
  and commit their sessions before the cache closes.

Websocket connections pass through: `/v1/stream` admits (and counts) each request it runs.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from xlserve.server.api.errors import RequestTooLarge, Unavailable

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


async def _send_error(send: Send, error) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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
            await _send_error(send, Unavailable("the server is shutting down and admits no new requests",
                                                code="shutting_down"))
            return
        limit = self.max_body_bytes
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        too_large = lambda size: RequestTooLarge(  # noqa: E731
            f"request body is {size} bytes; the limit is {limit} (XLSERVE_MAX_REQUEST_BODY_BYTES)")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_error(send, too_large(int(length)))
            return
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            # no length announced: read (at most limit + 1 bytes of) the body here, then replay it
            messages, size = [], 0
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request":
                    break
                size += len(message.get("body", b""))
                if size > limit:
                    await _send_error(send, too_large(f"more than {limit}"))
                    return
                if not message.get("more_body", False):
                    break
            replay = iter(messages)

            async def receive_replayed():
                return next(replay, None) or await receive()

            receive = receive_replayed
        if state is not None:
            state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if state is not None:
                state.inflight -= 1
