"""/v1/sessions: long-lived model memory that requests continue.

    POST   /v1/sessions                  {"model"} -> a new, empty session
    GET    /v1/sessions                  your sessions, newest first (?limit=1..100, default 20; ?after=<id>)
    GET    /v1/sessions/{id}             tokens, version, state_bytes, tier, in_use, timestamps
    DELETE /v1/sessions/{id}
    POST   /v1/sessions/{id}/append      {"text" | token ids, "score"}: feed a document chunk
    POST   /v1/sessions/{id}/fork        a new session starting from this one's committed state
    GET    /v1/sessions/{id}/state       export: safetensors bytes (see server/cache/codec.py)
    PUT    /v1/sessions/{id}/state       import into this session: its state is replaced (one commit)
    POST   /v1/sessions/import           import as a new session (?model= optional, else the file's)

A session belongs to the API key that created it (another key sees 404) and its id is 128
random bits. `append` feeds a document chunk into the memory and, with `score`, returns its
log-probability: appending a document chunk by chunk scores it exactly as one pass would,
which is how users evaluate long documents.

Import never creates a session under an id the client picked: ids stay random and an
existing id of another key stays invisible, so PUT replaces the state of a session you own
and a new session comes from POST /v1/sessions/import. Fork, export and import take the session
like any request does: while another request holds it they answer 409 `session_busy`. An
imported state must be of the same model (metadata `model`) and fit it
(`LanguageModel.check_state`: state class, tensor names, dtypes, fixed dimensions); anything
else is a 400. The exported metadata carries the model name, architecture, token count and
version; the owner is left out.

Requests that change a session (append, fork, PUT state, delete; and completions with a
`session_id`) take an `Idempotency-Key` header: the same key on the same session returns the first
answer (with `Idempotent-Replayed: true`) instead of applying twice, the same key with another
request is 422 `idempotency_key_reused`. A session remembers its 32 most recent keys, in its
durable copy; a delete's key is remembered for a day. A create or an import with a key makes its
session under an id derived from the caller and the key: its retry (on any replica, after a
restart) answers that session as it is now instead of making a second, until it is deleted (then
422: the key is spent); while the first is still writing it, a retry is 409 `session_busy`.

The session operations run in the engine process, where the cache is; what the cache refuses
reaches the client through the app's error handlers (server/api/errors.py).
"""

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response

from xlserve.server.api.protocol import (
    AppendRequest,
    AppendResponse,
    CreateSession,
    ForkedSession,
    SessionDeleted,
    SessionList,
    SessionObject,
    error_responses,
)
from xlserve.server.api.serving import (
    IDEMPOTENCY_KEY_HEADER,
    Cancellation,
    StateResponse,
    app_state,
    append_to_session,
    cancel_on_disconnect,
    create_session as create_one,
    delete_session as delete_one,
    fork_session as fork_one,
    import_new_session as import_one,
    list_sessions,
    owner_of,
    read_body,
    replace_session_state,
    replayed_headers,
    session_header_matches_path,
    state_in_flight,
    take_state_place,
)

router = APIRouter(default_response_class=JSONResponse)  # json.dumps writes the bodies (routers/completions.py)
# a route about one session checks that an X-Session-Id header (what a proxy routed it by) names it
PER_SESSION = [Depends(session_header_matches_path)]
# what an exported state is, with what its headers say about it
STATE_FILE = {
    "description": "The session's state: safetensors bytes (server/cache/codec.py), for PUT .../state or "
                   "POST /v1/sessions/import.",
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    "headers": {"X-Session-Version": {"description": "the session's version", "schema": {"type": "integer"}},
                "X-Session-Tokens": {"description": "the tokens in its memory", "schema": {"type": "integer"}}},
}


@router.post("/v1/sessions", response_model=SessionObject, response_model_exclude_unset=True,
             responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503))
async def create_session(body: CreateSession, request: Request, response: Response,
                         owner: str | None = Depends(owner_of),
                         idempotency_key: str | None = Header(None, alias=IDEMPOTENCY_KEY_HEADER)):
    result, replayed = await create_one(app_state(request), owner, body.model, idempotency_key)
    response.headers.update(replayed_headers(replayed))
    return result


@router.post("/v1/sessions/import", response_model=SessionObject, response_model_exclude_unset=True,
             responses=error_responses(400, 401, 403, 404, 408, 409, 413, 422, 429, 503))
async def import_new_session(request: Request, response: Response, model: str | None = None,
                             owner: str | None = Depends(owner_of),
                             idempotency_key: str | None = Header(None, alias=IDEMPOTENCY_KEY_HEADER)):
    """The engine process decodes the body and checks that it fits the model (400 otherwise)."""
    state = app_state(request)
    if model is not None:
        state.served(model)
    async with state_in_flight(state, owner):
        blob = await read_body(request)
        result, replayed = await import_one(state, owner, model, blob, idempotency_key)
    response.headers.update(replayed_headers(replayed))
    return result


@router.get("/v1/sessions", response_model=SessionList, response_model_exclude_unset=True,
            responses=error_responses(400, 401, 413, 503))
async def list_own_sessions(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None,
                            owner: str | None = Depends(owner_of)):
    """The caller's sessions across every tier (and, with Redis, every replica), newest first."""
    return await list_sessions(app_state(request), owner, limit, after)


@router.get("/v1/sessions/{session_id}", dependencies=PER_SESSION, response_model=SessionObject,
            response_model_exclude_unset=True, responses=error_responses(400, 401, 404, 413, 503))
async def get_session(session_id: str, request: Request, owner: str | None = Depends(owner_of)):
    info = await app_state(request).engine.session_info(session_id, owner)
    return info.public()


@router.delete("/v1/sessions/{session_id}", dependencies=PER_SESSION, response_model=SessionDeleted,
               response_model_exclude_unset=True, responses=error_responses(400, 401, 404, 409, 413, 422, 503))
async def delete_session(session_id: str, request: Request, response: Response, owner: str | None = Depends(owner_of),
                         idempotency_key: str | None = Header(None, alias=IDEMPOTENCY_KEY_HEADER)):
    body, replayed = await delete_one(app_state(request), owner, session_id, idempotency_key)
    response.headers.update(replayed_headers(replayed))
    return body


@router.post("/v1/sessions/{session_id}/fork", dependencies=PER_SESSION, response_model=ForkedSession,
             response_model_exclude_unset=True, responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503))
async def fork_session(session_id: str, request: Request, response: Response, owner: str | None = Depends(owner_of),
                       idempotency_key: str | None = Header(None, alias=IDEMPOTENCY_KEY_HEADER)):
    body, replayed = await fork_one(app_state(request), owner, session_id, idempotency_key)
    response.headers.update(replayed_headers(replayed))
    return body


@router.get("/v1/sessions/{session_id}/state", dependencies=PER_SESSION, response_class=Response,
            responses={**error_responses(400, 401, 404, 409, 413, 429, 503), 200: STATE_FILE})
async def export_state(session_id: str, request: Request, owner: str | None = Depends(owner_of)):
    give_back = take_state_place(app_state(request), owner)
    try:
        info, blob = await app_state(request).engine.export(session_id, owner)
    except BaseException:
        give_back()
        raise
    send_timeout = app_state(request).settings.server.stream_send_timeout_seconds
    return StateResponse(content=blob, give_back=give_back, send_timeout=send_timeout,
                         media_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{session_id}.safetensors"',
        "X-Session-Version": str(info.version), "X-Session-Tokens": str(info.tokens),
    })


@router.put("/v1/sessions/{session_id}/state", dependencies=PER_SESSION, response_model=SessionObject,
            response_model_exclude_unset=True, responses=error_responses(400, 401, 404, 408, 409, 413, 422, 429, 503))
async def import_state(session_id: str, request: Request, response: Response, owner: str | None = Depends(owner_of),
                       idempotency_key: str | None = Header(None, alias=IDEMPOTENCY_KEY_HEADER)):
    state = app_state(request)
    # 404 for a session that is not yours before reading a body that may be large
    await state.engine.session_info(session_id, owner)
    async with state_in_flight(state, owner):
        blob = await read_body(request)
        body, replayed = await replace_session_state(state, owner, session_id, blob, idempotency_key)
    response.headers.update(replayed_headers(replayed))
    return body


@router.post("/v1/sessions/{session_id}/append", dependencies=PER_SESSION, response_model=AppendResponse,
             response_model_exclude_unset=True,
             responses=error_responses(400, 401, 404, 409, 413, 422, 429, 500, 503))
async def append(session_id: str, body: AppendRequest, request: Request, response: Response,
                 owner: str | None = Depends(owner_of),
                 idempotency_key: str | None = Header(None, alias=IDEMPOTENCY_KEY_HEADER)):
    # a client that hangs up stops the append at the engine's next step, and nothing is
    # committed unless the commit had begun (server/api/serving/cancellation.py)
    async with cancel_on_disconnect(request, Cancellation()) as cancellation:
        result = await append_to_session(app_state(request), owner, session_id, body.text, body.score,
                                         cancellation, idempotency_key=idempotency_key)
    response.headers.update(replayed_headers(result.replayed))
    return result.body()
