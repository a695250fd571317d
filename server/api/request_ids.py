"""`X-Request-Id` on every HTTP answer, as OpenAI's API sends it (its Python SDK reads it into
`response._request_id`) and vLLM echoes it: the handle a user quotes when something went wrong,
and the one that ties a proxy's access log to a replica's log.

A client (or a proxy in front, deploy/nginx/xlserve.conf) may send its own: it is kept when it is
1-128 visible ASCII characters (what fits in a log line and a header unchanged), and replaced
by a fresh random one otherwise. The id lives in the request's scope (`request_id_of`), so a
route, an error handler and a log line all name the same one. A plain ASGI middleware: one call
per response start, nothing per streamed chunk.

An answer the app's last-resort handler gives (an unexpected exception, a 500) is sent by
Starlette's outermost middleware, outside this one: server/api/errors.py adds the header to it
from the scope.
"""

from __future__ import annotations

import re
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
_HEADER_BYTES = REQUEST_ID_HEADER.encode()
_ACCEPTED = re.compile(rb"[\x21-\x7e]{1,128}")  # visible ASCII, no spaces: a log line's one word


def new_request_id() -> str:
    return secrets.token_hex(16)


def request_id_of(scope: Scope) -> str | None:
    """The id the middleware gave this request (None outside it: a test's bare app)."""
    return scope.get("state", {}).get("request_id")


class RequestIdMiddleware:
    """Gives each HTTP request an id (the client's when acceptable) and sends it back."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((value for name, value in scope.get("headers", ()) if name == _HEADER_BYTES), None)
        request_id = sent.decode("ascii") if sent is not None and _ACCEPTED.fullmatch(sent) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        encoded = request_id.encode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(name.lower() == _HEADER_BYTES for name, _ in headers):
                    headers.append((_HEADER_BYTES, encoded))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
