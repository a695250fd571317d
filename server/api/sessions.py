"""/v1/sessions: long-lived model memory that requests continue.

A session belongs to the API key that created it (another key sees 404). `append` feeds a
document chunk into the memory and, with `score`, returns its log-probability: appending a
document chunk by chunk scores it exactly as one pass would, which is how users evaluate
long documents.
"""

from __future__ import annotations

import math

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from server.api.completions import prompt_tokens
from server.api.deps import app_state, owner_of, session_errors
from server.cache import SessionLocked, SessionNotFound
from server.errors import InvalidRequest

router = APIRouter()


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str


class AppendRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str | list[int]
    score: bool = False


def _cache_call(fn, session_id: str):
    try:
        return fn()
    except (SessionNotFound, SessionLocked) as error:
        raise session_errors(error, session_id) from None


@router.post("/v1/sessions")
async def create_session(body: CreateSession, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    served = state.served(body.model)
    info = state.cache.create(body.model, owner, served.engine.fresh_data())
    return info.public()


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    return _cache_call(lambda: state.cache.info(session_id, owner), session_id).public()


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    _cache_call(lambda: state.cache.delete(session_id, owner), session_id)
    return {"id": session_id, "object": "session", "deleted": True}


@router.post("/v1/sessions/{session_id}/append")
async def append(session_id: str, body: AppendRequest, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    lease = _cache_call(lambda: state.cache.acquire(session_id, owner), session_id)
    try:
        served = state.served(lease.info.model)
        tokens = prompt_tokens(state, served, body.text)
        if not tokens:
            raise InvalidRequest("text is empty", param="text")
        cached = lease.data.tokens
        data, logprob, scored = await served.engine.append(lease.data, tokens, body.score)
        info = state.cache.commit(lease, data)
    finally:
        state.cache.release(lease)  # no-op after the commit
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
