"""Building what the engine runs from a request: sampling parameters, prompt tokens, the
server's limits, `usage`, and the Idempotency-Key fingerprint of a session-changing request."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import Header, Request, Response
from fastapi.responses import JSONResponse
from fastapi.dependencies.models import Dependant
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection

from xlserve.server.api.deps import STATE_BODY_SETTING, AppState, ServedModel, app_state
from xlserve.server.api.errors import (
    APIError,
    InvalidRequest,
    RequestTimeout,
    RequestTooLarge,
    TooManyRequests,
    as_api_error,
)
from xlserve.server.api.protocol import (
    IDEMPOTENCY_KEY_PATTERN,
    MAX_STOP_CHARACTERS,
    SamplingFields,
)
from xlserve.server.engine.errors import ShuttingDown
from xlserve.server.engine.types import SamplingParams
from xlserve.server.errors import RegisteredError

log = logging.getLogger("xlserve.server")


# -- building a request ---------------------------------------------------------------------------


def sampling_params(body: SamplingFields, echo: bool = False, n: int = 1) -> SamplingParams:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])  # at most MAX_STOPS (protocol.py)
    if any(len(stop) > MAX_STOP_CHARACTERS for stop in stops):
        raise InvalidRequest(f"a stop string has at most {MAX_STOP_CHARACTERS} characters", param="stop")
    return SamplingParams(
        max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed, stop=stops, logprobs=body.logprobs, echo=echo, n=n,
        logit_bias={int(token): bias for token, bias in body.logit_bias.items()} if body.logit_bias else None,
        ignore_eos=body.ignore_eos,
    )


def check_logit_bias(params: SamplingParams, served: ServedModel) -> None:
    """Refuse a logit_bias naming a token the model does not have, before anything is queued."""
    outside = sorted(token for token in params.logit_bias or {} if token >= served.vocab_size)
    if outside:
        raise InvalidRequest(f"logit_bias names token ids outside the vocabulary [0, {served.vocab_size}): "
                             f"{outside[:5]}", param="logit_bias", code="invalid_logit_bias")


def check_prompt_size(state: AppState, prompt: str | list[int], param: str = "prompt") -> None:
    """XLSERVE_MAX_PROMPT_BYTES for a prompt (text: its UTF-8 bytes; token ids: their number),
    which needs no model: checked before any work (an append's, before its session is fetched)."""
    limit = state.settings.server.max_prompt_bytes
    size, unit = (len(prompt.encode("utf-8")), "bytes") if isinstance(prompt, str) else (len(prompt), "tokens")
    if size > limit:
        raise InvalidRequest(f"{param} is {size} {unit}; the limit is {limit} (XLSERVE_MAX_PROMPT_BYTES)",
                             param=param, code="prompt_too_long")


# work on a request past this many characters or token ids (tokenizing it, checking its ids,
# rendering its chat template) runs on a worker thread: at real size a MB of text took 27 ms to
# encode with transfo-xl-wt103's 267,735 words, and an 8 MB body of token ids 100 ms to check,
# every other client of the event loop waiting meanwhile
OFF_THE_LOOP_ITEMS = 64 << 10


async def sized_work(size: int, work: Callable, *args, **kwargs):
    """`work(*args, **kwargs)`, on a worker thread past OFF_THE_LOOP_ITEMS (`size`: characters or
    token ids, or a body's bytes)."""
    return await asyncio.to_thread(work, *args, **kwargs) if size > OFF_THE_LOOP_ITEMS else work(*args, **kwargs)


def body_size(request: Request) -> int:
    """A request's body's bytes as its Content-Length says (admission measured one without: as
    large as can be)."""
    length = request.headers.get("content-length")
    return int(length) if length is not None and length.isdigit() else OFF_THE_LOOP_ITEMS + 1


def prompt_tokens(state: AppState, served: ServedModel, prompt: str | list[int], param: str = "prompt") -> list[int]:
    """Tokenise a prompt (text or token ids), enforcing XLSERVE_MAX_PROMPT_BYTES; `param` names
    the field it came in."""
    check_prompt_size(state, prompt, param)
    if isinstance(prompt, str):
        try:
            return served.tokenizer.encode(prompt)
        except ValueError as error:  # a word-level vocabulary without <unk> meets a word it lacks
            raise InvalidRequest(str(error), param=param, code="word_not_in_vocabulary") from None
    tokens = list(prompt)
    vocab = served.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param,
                             code="token_id_out_of_vocabulary")
    return tokens


# Session states moving through the API process at once (imports, PUT states, exports): each is
# held whole here while the engine process checks or writes it, up to a whole state (237 MB at
# transfo-xl-wt103 in float32), so their number bounds the memory they take; one more is 429
MAX_STATES_IN_FLIGHT = 4
# of which one API key may hold this many: one key's slow transfers cannot take every place
MAX_STATES_IN_FLIGHT_PER_KEY = 2


def take_state_place(state: AppState, owner: str | None = None) -> Callable[[], None]:
    """A place for one session state among MAX_STATES_IN_FLIGHT (and, for an API key's `owner`,
    among its MAX_STATES_IN_FLIGHT_PER_KEY), and the call that gives it back (once); 429
    states_in_flight (Retry-After: 1) when there is none."""
    if state.states_in_flight >= MAX_STATES_IN_FLIGHT:
        raise TooManyRequests(f"{state.states_in_flight} session states are moving through this server already "
                              f"(imports, PUT states and exports: at most {MAX_STATES_IN_FLIGHT} at once, each held "
                              "whole in memory); retry shortly", code="states_in_flight", headers={"Retry-After": "1"})
    by_owner = state.states_in_flight_by_owner
    if owner is not None and by_owner.get(owner, 0) >= MAX_STATES_IN_FLIGHT_PER_KEY:
        raise TooManyRequests(f"this API key has {by_owner[owner]} session states moving through this server already "
                              f"(imports, PUT states and exports: at most {MAX_STATES_IN_FLIGHT_PER_KEY} of one key's at "
                              "once); retry when one ends", code="states_in_flight", headers={"Retry-After": "1"})
    state.states_in_flight += 1
    if owner is not None:
        by_owner[owner] = by_owner.get(owner, 0) + 1
    given_back = False

    def give_back() -> None:
        nonlocal given_back
        if not given_back:
            given_back = True
            state.states_in_flight -= 1
            if owner is not None:
                left = by_owner.pop(owner) - 1
                if left:
                    by_owner[owner] = left

    return give_back


@asynccontextmanager
async def state_in_flight(state: AppState, owner: str | None = None) -> AsyncIterator[None]:
    """`take_state_place` for the block."""
    give_back = take_state_place(state, owner)
    try:
        yield
    finally:
        give_back()


def send_within(send, timeout: float | None):
    """`send`, each of its messages failing with TimeoutError once it has waited `timeout`
    seconds for the client's full socket (None: `send` as it is). A streamed answer's and an
    exported state's: a client that stops reading must not hold its request or its place."""
    if timeout is None:
        return send

    async def timed_send(message) -> None:
        with anyio.fail_after(timeout):
            await send(message)

    return timed_send


# an exported state is sent in parts of this size: the server (uvicorn) waits for a full socket to
# drain only at the start of a send, so the state sent as one message would be taken into its
# write buffer at once, the place given back at once, and a client that stops reading would hold
# the whole state in this process for as long as it kept the connection open
STATE_SEND_BYTES = 1 << 20


async def send_in_parts(send, start: dict, body: memoryview, paced_from: float | None = None) -> bool:
    """`start` (http.response.start), then `body` in parts of STATE_SEND_BYTES through `send`
    (`send_within`'s: TimeoutError once one part waits past its timeout). With `paced_from` (a
    monotonic time), after STATE_BODY_GRACE_SECONDS from it the body must go at
    STATE_BODY_BYTES_PER_SECOND on average: False, the rest unsent, when it does not."""
    await send(start)
    for offset in range(0, max(len(body), 1), STATE_SEND_BYTES):
        message = {"type": "http.response.body", "body": bytes(body[offset:offset + STATE_SEND_BYTES]),
                   "more_body": offset + STATE_SEND_BYTES < len(body)}
        if paced_from is None:
            await send(message)
            continue
        allowed = paced_from + STATE_BODY_GRACE_SECONDS + offset / STATE_BODY_BYTES_PER_SECOND - time.monotonic()
        with anyio.move_on_after(max(allowed, 0.0)) as pace:
            await send(message)
        if pace.cancelled_caught:
            return False
    return True


class PartedJSONResponse(JSONResponse):
    """A JSON answer that is not streamed (a completion's, up to about 20 MB with every token's
    log-probabilities), sent in parts of STATE_SEND_BYTES, each within the stream send timeout
    (XLSERVE_STREAM_SEND_TIMEOUT_SECONDS, read from the app's state): sent as one message it went
    into the server's write buffer at once, and a client that never read held it in this process
    for as long as it kept the connection open. Written by json.dumps, as JSONResponse writes it."""

    async def __call__(self, scope, receive, send) -> None:
        app_state_ = getattr(getattr(scope.get("app"), "state", None), "xlserve", None)
        timeout = getattr(getattr(getattr(app_state_, "settings", None), "server", None),
                          "stream_send_timeout_seconds", None)
        try:
            await send_in_parts(send_within(send, timeout), {"type": "http.response.start", "status": self.status_code,
                                                             "headers": self.raw_headers}, memoryview(self.body))
        except TimeoutError:  # the server closes the connection of an answer it did not complete
            log.warning("a client took no write of its %d-byte answer for %gs (XLSERVE_STREAM_SEND_TIMEOUT_SECONDS): "
                        "its answer is ended", len(self.body), timeout)
            return
        if self.background is not None:
            await self.background()


class StateResponse(Response):
    """An exported state's response, sent in parts of STATE_SEND_BYTES, which gives its place
    back (`take_state_place`) once the last part is taken, or the sending failed: the bytes are
    held until then. A client that stops reading is gone once one part has waited
    `send_timeout` seconds for its full socket (XLSERVE_STREAM_SEND_TIMEOUT_SECONDS), as a
    streamed answer's: its connection is closed and the place given back, where it would
    otherwise hold both for as long as it kept the connection open. And as an upload
    (`read_body`), after STATE_BODY_GRACE_SECONDS the state must go at STATE_BODY_BYTES_PER_SECOND
    on average: a client that reads just fast enough for each part would otherwise hold its place
    for hours (237 MB at 17 kB/s)."""

    def __init__(self, *args, give_back: Callable[[], None], send_timeout: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.give_back = give_back
        self.send_timeout = send_timeout

    async def __call__(self, scope, receive, send) -> None:
        body = memoryview(self.body)
        if scope.get("method") == "HEAD":
            body = body[:0]
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            if not await send_in_parts(send_within(send, self.send_timeout), start, body, paced_from=time.monotonic()):
                # the server closes the connection of an answer it did not complete
                log.warning("an exported state's client read slower than %d bytes/s after %gs: its answer is "
                            "ended", STATE_BODY_BYTES_PER_SECOND, STATE_BODY_GRACE_SECONDS)
        except TimeoutError:  # the server closes the connection of an answer it did not complete
            log.warning("an exported state's client took no write for %gs (XLSERVE_STREAM_SEND_TIMEOUT_SECONDS): "
                        "its answer is ended", self.send_timeout)
        except OSError:  # the client went away mid-answer
            pass
        finally:
            self.give_back()


# A session state's upload holds one of the MAX_STATES_IN_FLIGHT places while it arrives: after a
# grace, it must keep coming at this rate on average (2 Mbit/s), or it is refused with 408 and its
# place given back. Four clients that send a few bytes and stop would otherwise hold every place,
# and every other client's import, export and PUT state would be 429 for as long as they liked.
STATE_BODY_GRACE_SECONDS = 30.0
STATE_BODY_BYTES_PER_SECOND = 256 * 1024


async def read_body(request: Request) -> bytes:
    """The raw body (a session state), refused past the state body limit (AppState
    state_body_limit) even when no Content-Length announced it, and with 408 when it arrives
    slower than STATE_BODY_BYTES_PER_SECOND once its STATE_BODY_GRACE_SECONDS are spent."""
    state = app_state(request)
    limit = state.state_body_limit()
    chunks, size = [], 0
    started = time.monotonic()
    stream = request.stream().__aiter__()
    while True:
        allowed = started + STATE_BODY_GRACE_SECONDS + size / STATE_BODY_BYTES_PER_SECOND - time.monotonic()
        try:
            with anyio.fail_after(max(allowed, 0.0)):
                chunk = await stream.__anext__()
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise RequestTimeout(f"the state body came slower than {STATE_BODY_BYTES_PER_SECOND} bytes/s after "
                                 f"{STATE_BODY_GRACE_SECONDS:g}s ({size} bytes in {time.monotonic() - started:.0f}s); "
                                 "its place among the states in flight is given back", code="state_body_too_slow") from None
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"request body is over {limit} bytes ({STATE_BODY_SETTING})")
        if state.cutting:  # answered with why, where the server's stop would drop its connection unanswered
            raise ShuttingDown("the server is shutting down and this state's upload did not arrive within its grace "
                               "period (XLSERVE_SHUTDOWN_GRACE_SECONDS); nothing was imported: send it again",
                               code="server_shutting_down")
        chunks.append(chunk)
    return await asyncio.to_thread(b"".join, chunks)  # 237 MB copied off the event loop


# A proxy routes a session's requests to the replica that holds it warm by this header
# (deploy/nginx/, the ingress's upstream-hash-by); the server checks that it names the session
# the request is about, so a client cannot be routed by one session and act on another.
SESSION_ID_HEADER = "X-Session-Id"


def check_session_header(header: str | None, session_id: str | None) -> None:
    """400 when an X-Session-Id header names another session than the request's body or path
    (or names one for a request about none)."""
    if header is not None and header != session_id:
        about = f"session '{session_id}'" if session_id is not None else "no session"
        raise InvalidRequest(f"the {SESSION_ID_HEADER} header names session '{header}' but the request is about "
                             f"{about}; send the same id, or leave the header out", param=SESSION_ID_HEADER,
                             code="session_id_mismatch")


def session_header_matches_path(request: Request, session_id: str,
                                header: str | None = Header(None, alias=SESSION_ID_HEADER)) -> None:
    """A dependency of the /v1/sessions/{session_id}... routes: check_session_header. The path
    /v1/sessions/import is a route of its own, for POST only: another method there (GET, DELETE)
    is 405 with `Allow: POST`, not a session named "import" that is not found."""
    route = request.scope.get("route")
    if session_id == "import" and getattr(route, "path", None) == "/v1/sessions/{session_id}":
        raise StarletteHTTPException(405, f"{request.method} is not allowed on /v1/sessions/import; it takes POST "
                                          "(a session's exported state)", headers={"Allow": "POST"})
    check_session_header(header, session_id)


# -- query parameters -------------------------------------------------------------------------------

# what an error message quotes of the unknown names, which a client can make as long as a URL
MAX_NAMES_QUOTED, MAX_NAME_CHARACTERS = 5, 64


def declared_query_parameters(dependant: Dependant) -> set[str]:
    """The query parameter names a route takes: those of its endpoint and of every dependency
    below it, as FastAPI reads them (by alias)."""
    names, pending = set(), [dependant]
    while pending:  # bounded: the dependency tree is the route's, declared in code
        current = pending.pop()
        names.update(field.alias for field in current.query_params)
        pending.extend(current.dependencies)
    return names


def _quoted(names) -> str:
    listed = [repr(name[:MAX_NAME_CHARACTERS] + ("..." if len(name) > MAX_NAME_CHARACTERS else "")) for name in names]
    return ", ".join(listed[:MAX_NAMES_QUOTED]) + (f" and {len(listed) - MAX_NAMES_QUOTED} more"
                                                   if len(listed) > MAX_NAMES_QUOTED else "")


def refuse_unknown_query_parameters(connection: HTTPConnection) -> None:
    """400 `unknown_parameter` naming the query parameters the matched route does not declare:
    a misspelt one (`import?modle=`) would otherwise be ignored and the route's default used,
    as no body field is ignored either. A dependency of every API route (server/app.py); the
    websocket calls it once it has accepted, to answer with an error frame."""
    if not connection.query_params:
        return
    route = connection.scope.get("route")
    known = declared_query_parameters(route.dependant) if route is not None else set()
    unknown = [name for name in dict.fromkeys(connection.query_params.keys()) if name not in known]
    if not unknown:
        return
    takes = f"takes only {_quoted(sorted(known))}" if known else "takes no query parameters"
    plural = "s" if len(unknown) > 1 else ""
    where = getattr(route, "path", None) or connection.url.path
    raise InvalidRequest(f"unknown query parameter{plural} {_quoted(unknown)}: {where} {takes} "
                         "(no parameter is ignored silently)", param=unknown[0][:MAX_NAME_CHARACTERS],
                         code="unknown_parameter")


def error_for(error: BaseException) -> APIError:
    """The APIError a client sees for anything a request raised; a ValueError from the engine
    is a request it could not run as asked. An API or registered error keeps the status its class
    declares even when it is a ValueError too (CorruptState is the server's fault, a 500 that
    names only its class, never a 400 that quotes its details)."""
    if isinstance(error, ValueError) and not isinstance(error, (APIError, RegisteredError)):
        return InvalidRequest(str(error))
    return as_api_error(error)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's `usage`; `prompt_tokens_details.cached_tokens`, the context that came from the
    session's memory instead of being computed, when the request got that far."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


# -- Idempotency-Key --------------------------------------------------------------------------------

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"  # on an answer that is the remembered one of an earlier request


def check_idempotency_key(key: str) -> None:
    """400 for an Idempotency-Key that is not 1 to 255 visible ASCII characters."""
    if not re.fullmatch(IDEMPOTENCY_KEY_PATTERN, key):
        raise InvalidRequest(f"{IDEMPOTENCY_KEY_HEADER} must be 1 to 255 visible ASCII characters",
                             param=IDEMPOTENCY_KEY_HEADER, code="invalid_idempotency_key")


def idempotency(key: str | None, kind: str, request: dict) -> dict | None:
    """A session-changing request's Idempotency-Key with the fingerprint of the request (a hash
    of its kind and body: the same key with another request is refused, 422), or None."""
    if key is None:
        return None
    check_idempotency_key(key)
    canonical = json.dumps({"kind": kind, **request}, sort_keys=True, separators=(",", ":"))
    return {"key": key, "fingerprint": hashlib.sha256(canonical.encode()).hexdigest()}


def replayed_headers(replayed: bool) -> dict[str, str]:
    return {REPLAYED_HEADER: "true"} if replayed else {}
