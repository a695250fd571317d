"""/v1/sessions: long-lived model memory that requests continue.

    POST   /v1/sessions                  {"model"} -> a new, empty session
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
like any request does: while another request holds it they answer 409 `session_busy`. An imported state must be of the same
model (metadata `model`) and fit it (`LanguageModel.check_state`: state class, tensor names,
dtypes, fixed dimensions); anything else is a 400. The exported metadata carries the model
name, architecture, token count and version; the owner is left out.
"""

from __future__ import annotations

import math

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from xlserve.server.api.completions import prompt_tokens
from xlserve.server.api.deps import app_state, owner_of
from xlserve.server.cache import CacheError
from xlserve.server.engine.types import appended
from xlserve.server.api.errors import InvalidRequest, RequestTooLarge, as_api_error

router = APIRouter()


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str


class AppendRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str | list[int]
    score: bool = False


async def _session_call(coroutine, session_id: str = ""):
    """Await a session operation of the engine process, its cache errors as API errors."""
    try:
        return await coroutine
    except CacheError as error:
        raise as_api_error(error) from None


@router.post("/v1/sessions")
async def create_session(body: CreateSession, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    state.served(body.model)
    info = await _session_call(state.engine.session_call("create", model=body.model, owner=owner))
    return info.public()


@router.post("/v1/sessions/import")
async def import_new_session(request: Request, model: str | None = None, owner: str | None = Depends(owner_of)):
    """The engine process decodes the body and checks that it fits the model (400 otherwise)."""
    state = app_state(request)
    if model is not None:
        state.served(model)
    blob = await _read_body(request, state.settings.max_request_body_bytes)
    info = await _session_call(state.engine.session_call("import_new", blob, model=model, owner=owner))
    return info.public()


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    info = await _session_call(state.engine.session_call("info", session_id=session_id, owner=owner), session_id)
    return info.public()


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    await _session_call(state.engine.call("delete", session_id=session_id, owner=owner), session_id)
    return {"id": session_id, "object": "session", "deleted": True}


@router.post("/v1/sessions/{session_id}/fork")
async def fork_session(session_id: str, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    info = await _session_call(state.engine.session_call("fork", session_id=session_id, owner=owner), session_id)
    return {**info.public(), "forked_from": session_id}


@router.get("/v1/sessions/{session_id}/state")
async def export_state(session_id: str, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    info, blob = await _session_call(state.engine.export(session_id, owner), session_id)
    return Response(content=blob, media_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{session_id}.safetensors"',
        "X-Session-Version": str(info.version), "X-Session-Tokens": str(info.tokens),
    })


@router.put("/v1/sessions/{session_id}/state")
async def import_state(session_id: str, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    # 404 for a session that is not yours before reading a body that may be large
    await _session_call(state.engine.session_call("info", session_id=session_id, owner=owner), session_id)
    blob = await _read_body(request, state.settings.max_request_body_bytes)
    info = await _session_call(state.engine.session_call("replace", blob, session_id=session_id, owner=owner),
                               session_id)
    return info.public()


@router.post("/v1/sessions/{session_id}/append")
async def append(session_id: str, body: AppendRequest, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    lease = await _session_call(state.engine.acquire(session_id, owner), session_id)
    try:
        served = state.served(lease.info.model)
        tokens = prompt_tokens(state, served, body.text)
        if not tokens:
            raise InvalidRequest("text is empty", param="text")
        cached = lease.info.tokens
        fed = await appended(await state.engine.append(lease, tokens, body.score))
        logprob, scored = fed.logprob, fed.scored
        info = await _session_call(state.engine.commit(lease), session_id)
    finally:
        state.engine.release(lease)  # no-op after the commit
    state.metrics.memory_reused_tokens.labels(info.model).inc(cached)
    state.metrics.state_bytes_per_session.labels(info.model).observe(info.state_bytes)
    result = {"id": session_id, "tokens": len(tokens), "session_tokens": info.tokens, "version": info.version,
              "cached_tokens": cached}
    if body.score:
        # bits per byte over the scored tokens (a session's very first token has no context)
        text_bytes = len(tokens) if isinstance(body.text, list) else len(body.text.encode("utf-8"))
        scored_bytes = text_bytes - (len(tokens) - scored)
        result.update(logprob=logprob, scored_tokens=scored,
                      bits_per_byte=(-logprob / math.log(2) / scored_bytes) if scored_bytes else None)
    return result


# -- bodies -------------------------------------------------------------------------------------


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused past `limit` bytes even when no Content-Length announced it."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"request body is over {limit} bytes (XLSERVE_MAX_REQUEST_BODY_BYTES)")
        chunks.append(chunk)
    return b"".join(chunks)
