"""The app's shared state (`AppState`: settings, metrics, the engine client, the served models),
authentication (`owner_of`) and model lookup. The routers reach them through
server/api/serving/; server/app.py fills the state in its lifespan."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from fastapi import Request

from xlserve.server.engine.client import EngineClient
from xlserve.server.api.chat import ChatTemplate
from xlserve.server.api.errors import APIError, AuthenticationFailed, Forbidden
from xlserve.server.engine.errors import ModelNotFound
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings


# room in a session-state body beyond its tensors: the safetensors header (a name, dtype, shape
# and offsets per tensor) and the metadata (model, architecture, tokens, version; an export
# carries no remembered Idempotency-Keys)
STATE_BODY_SLACK = 1 << 20
# what a 413 for a session-state body names
STATE_BODY_SETTING = "XLSERVE_MAX_STATE_BODY_BYTES; by default the largest served model's full state in float32 plus 1 MiB"


@dataclass
class ServedModel:
    """A model as the API process knows it: the model itself runs in the engine process."""

    name: str
    tokenizer: object
    vocab_size: int
    card: dict  # what /v1/models says about it
    chat_template: ChatTemplate | None = None  # for /v1/chat/completions (server/api/chat.py)
    # bytes of an exported full state in float32; None where the state grows without bound
    state_body_bytes: int | None = None


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    engine: EngineClient | None = None  # the engine process: engines and the session cache
    models: dict[str, ServedModel] = field(default_factory=dict)
    ready: bool = False
    api_keys: list[str] = field(default_factory=list)
    draining: bool = False  # shutting down: new requests get 503 while running ones finish
    cutting: bool = False  # the shutdown's grace is over: a state upload still arriving is answered 503 at once
    inflight: int = 0  # requests being served (HTTP and websocket), counted by admission
    states_in_flight: int = 0  # session states held whole here now (serving/requests.py state_in_flight)
    # of those, each API key's (owner id -> count, absent at 0)
    states_in_flight_by_owner: dict = field(default_factory=dict)

    def state_body_limit(self) -> int:
        """The largest session-state body taken (import, PUT state): XLSERVE_MAX_STATE_BODY_BYTES,
        or, at 0, the largest served model's full state in float32 (what an export of any
        XLSERVE_STATE_DTYPE holds at most) with STATE_BODY_SLACK for its header and metadata,
        and never less than XLSERVE_MAX_REQUEST_BODY_BYTES."""
        server = self.settings.server
        if server.max_state_body_bytes:
            return server.max_state_body_bytes
        sizes = [model.state_body_bytes for model in self.models.values() if model.state_body_bytes is not None]
        return max([server.max_request_body_bytes] + [size + STATE_BODY_SLACK for size in sizes])

    def served(self, name: str) -> ServedModel:
        try:
            return self.models[name]
        except KeyError:
            raise ModelNotFound.named(name, self.models) from None


def app_state(request: Request) -> AppState:
    return request.app.state.xlserve


# Browsers cannot set headers on a websocket, but they can offer subprotocols: a page sends
# ["xlserve", "xlserve.key." + base64url(key)] (no padding) and the server accepts "xlserve",
# never echoing the key (docs/websocket.md, "Authentication").
WEBSOCKET_SUBPROTOCOL = "xlserve"
KEY_SUBPROTOCOL_PREFIX = "xlserve.key."


def offered_subprotocols(request: Request) -> list[str]:
    """The subprotocols a websocket client offered, in order: from every Sec-WebSocket-Protocol
    header line (RFC 6455 lets a client split its list over several), less empty list items."""
    items = [item.strip() for header in request.headers.getlist("sec-websocket-protocol") for item in header.split(",")]
    return [item for item in items if item]


# base64url without padding: the only alphabet a subprotocol token can carry whole (RFC 6455
# subprotocols are HTTP tokens, in which standard base64's '/' and '=' are not allowed, and
# conforming clients refuse to send them). '+' is a token character: checked here, so that a key
# in standard base64 is refused by name rather than decoded leniently.
BASE64URL_UNPADDED = re.compile(r"[A-Za-z0-9_-]*")
BAD_KEY_SUBPROTOCOL = (f"the {KEY_SUBPROTOCOL_PREFIX} subprotocol must carry the key in base64url without padding "
                       "(letters, digits, '-' and '_'; not standard base64's '+' and '/', no '=')")


def subprotocol_key(request: Request) -> str | None:
    """The API key a browser sent as a websocket subprotocol, or None; AuthenticationFailed
    (naming the alphabet, never echoing the key) when it is not base64url of a UTF-8 key, or
    when more than one key subprotocol was offered."""
    keys = [item for item in offered_subprotocols(request) if item.startswith(KEY_SUBPROTOCOL_PREFIX)]
    # two keys leave it open which one authenticates: neither is tried
    if len(keys) > 1:
        raise AuthenticationFailed(f"more than one {KEY_SUBPROTOCOL_PREFIX} subprotocol was offered: send one key",
                                   code="invalid_api_key")
    if not keys:
        return None
    encoded = keys[0][len(KEY_SUBPROTOCOL_PREFIX):]
    # a length of 1 modulo 4 is no whole byte in any base64
    if not BASE64URL_UNPADDED.fullmatch(encoded) or len(encoded) % 4 == 1:
        raise AuthenticationFailed(BAD_KEY_SUBPROTOCOL, code="invalid_api_key")
    try:
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        raise AuthenticationFailed(f"the {KEY_SUBPROTOCOL_PREFIX} subprotocol is base64url, but not of a "
                                   "UTF-8 key", code="invalid_api_key") from None


DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}


def cross_origin_error(websocket, allowed: list[str]) -> APIError | None:
    """The 403 for a websocket opened by a web page of another origin than this server's (or
    one of `allowed`, XLSERVE_ALLOWED_ORIGINS; "*" allows any). A browser applies no same-origin
    rule to a websocket and sends every page's Origin: without this, any site a user visits could
    drive a server on their machine (one without keys, as `make serve` starts it) and append to
    its sessions. A client that is no browser sends no Origin, and is not asked for one. The
    page's host is compared with the Host the request came to (or a proxy's X-Forwarded-Host), and
    its port too where that names one (a proxy's `$host` names none). Not a defence against DNS
    rebinding, where the page's origin and the Host are both the attacker's name: API keys are."""
    origin = websocket.headers.get("origin")
    if origin is None or "*" in allowed or origin.strip().rstrip("/").lower() in allowed:
        return None
    try:
        page = urlsplit(origin.strip())
        page_port = page.port or DEFAULT_PORTS.get(page.scheme.lower())
    except ValueError:
        page, page_port = None, None
    # the Host the request came to, or the one a proxy that rewrites Host passed on (nginx's
    # proxy_pass without `proxy_set_header Host`, Apache without ProxyPreserveHost)
    forwarded = websocket.headers.get("x-forwarded-host", "").split(",")[0].strip()
    for host in filter(None, (websocket.headers.get("host", ""), forwarded)):
        try:
            target = urlsplit("//" + host)
            target_port = target.port
        except ValueError:
            continue
        if (page is not None and page.hostname and page.hostname == target.hostname
                and (target_port is None or target_port == page_port)):
            return None
    return Forbidden("a web page of another origin may not open this websocket (its Origin is not this server's; "
                     "the operator may allow it with XLSERVE_ALLOWED_ORIGINS)", code="cross_origin")


def owner_of(request: Request) -> str | None:
    """Authenticate the request; returns the owner id sessions are filed under (a hash of the
    API key), or None when the server has no keys. The key comes in `Authorization: Bearer`, or,
    for a websocket from a browser, as the `xlserve.key.` subprotocol."""
    state = app_state(request)
    if not state.api_keys:
        return None
    header = request.headers.get("authorization", "")
    if not header and request.scope.get("type") == "websocket":
        header = "Bearer " + (subprotocol_key(request) or "")
    return authenticated_owner(header, state.api_keys)


def authenticated_owner(authorization: str, api_keys: list[str]) -> str:
    """The owner id of the key an `Authorization: Bearer <key>` header carries (`owner_of`; and
    server/api/admission.py, before it reads a body); AuthenticationFailed when it names none of
    `api_keys`."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationFailed("missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    # compare against every key in constant time, so timing says nothing about which matched
    matched = False
    for key in api_keys:
        matched |= hmac.compare_digest(token.encode(), key.encode())
    if not matched:
        raise AuthenticationFailed("invalid API key", code="invalid_api_key")
    return hashlib.sha256(token.encode()).hexdigest()[:32]
