"""What a request does, between its protocol (server/api/protocol.py) and the engine process.

The routers (server/api/routers/) parse a request and hand it here, importing from this package
only (its modules import each other, never this file). The package

- builds what the engine runs: sampling parameters, prompt tokens, the server's limits;
- holds a request's session (`session_lease`): taken before its work is queued and released
  when the request ends, however it ends. A request makes its session's new memory permanent
  with an explicit commit, on success only; after a commit the release changes nothing, so a
  disconnect, an error or a cancel leaves the session as it was;
- assembles the answers: OpenAI completion bodies and SSE chunks, websocket frames, `usage`;
- feeds document chunks into sessions (`append_to_session`), the one flow behind both
  POST /v1/sessions/{id}/append and the websocket's `append`;
- applies a session-changing request at most once per Idempotency-Key (`idempotency`): the key
  and a fingerprint of the request go to the engine process with the acquire (a key seen before
  comes back as the lease's `replay`, the first answer, which is answered again) and with the
  commit (the answer, remembered in the same write as the change).

What the engine process and the session cache raise reaches the client through the one table
in server/api/errors.py; this module raises API errors only for what it checks itself.

A streamed answer (SSE, websocket frames) is an async generator that first yields `QUEUED`,
once its request is validated, holds its session and is queued in the engine. `queued()` runs
it that far before the response starts, so what is refused up to then is still refused as a
whole (an HTTP status), and the lease is held by the one `async with` around everything.

Modules: requests.py (building a request, usage, Idempotency-Key), leases.py (session_lease,
queued), generation.py (Generation, PromptBatch), completions.py (completion and chat answers,
SSE), tokens.py (tokenize, detokenize), sessions.py (append and the other session changes),
websocket.py (the websocket's frames), cancellation.py (a cancel or disconnect against a commit:
exactly one of them wins).
"""

from __future__ import annotations

from xlserve.server.api.deps import (WEBSOCKET_SUBPROTOCOL, AppState, app_state, cross_origin_error,
                                     offered_subprotocols, owner_of)
from xlserve.server.api.errors import APIError, Conflict, InvalidRequest
from xlserve.server.api.serving.completions import (
    ChatCompletion,
    Completion,
    EventStream,
    complete,
    stream_completion,
)
from xlserve.server.api.serving.requests import (
    IDEMPOTENCY_KEY_HEADER,
    SESSION_ID_HEADER,
    PartedJSONResponse,
    StateResponse,
    body_size,
    check_session_header,
    read_body,
    refuse_unknown_query_parameters,
    replayed_headers,
    session_header_matches_path,
    sized_work,
    state_in_flight,
    take_state_place,
)
from xlserve.server.api.serving.cancellation import Cancellation, cancel_on_disconnect
from xlserve.server.api.serving.sessions import (
    append_to_session,
    create_session,
    delete_session,
    fork_session,
    import_new_session,
    list_sessions,
    replace_session_state,
)
from xlserve.server.api.serving.tokens import detokenize, tokenize
from xlserve.server.api.serving.websocket import (
    append_frames,
    cancelled_generation_frame,
    error_frame,
    generation_frames,
)

# what the routers (and the app, for error frames) use
__all__ = [
    "APIError",
    "AppState",
    "Cancellation",
    "ChatCompletion",
    "Completion",
    "Conflict",
    "EventStream",
    "IDEMPOTENCY_KEY_HEADER",
    "InvalidRequest",
    "app_state",
    "append_frames",
    "cancelled_generation_frame",
    "append_to_session",
    "cancel_on_disconnect",
    "complete",
    "create_session",
    "delete_session",
    "detokenize",
    "error_frame",
    "fork_session",
    "import_new_session",
    "generation_frames",
    "list_sessions",
    "owner_of",
    "cross_origin_error",
    "read_body",
    "PartedJSONResponse",
    "StateResponse",
    "state_in_flight",
    "take_state_place",
    "refuse_unknown_query_parameters",
    "replace_session_state",
    "replayed_headers",
    "stream_completion",
    "tokenize",
    "WEBSOCKET_SUBPROTOCOL",
    "SESSION_ID_HEADER",
    "body_size",
    "check_session_header",
    "session_header_matches_path",
    "sized_work",
    "offered_subprotocols",
]
