"""The session operations that change a session: the one append flow (HTTP and websocket),
fork, replacing a state, delete, and the caller's list."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import os
import time

from xlserve.server.api.deps import AppState
from xlserve.server.api.errors import InvalidRequest
from xlserve.server.api.protocol import AppendResponse, ForkedSession, SessionDeleted, SessionList, SessionObject
from xlserve.server.cache.errors import SessionInfo
from xlserve.server.engine.client import RemoteLease
from xlserve.server.engine.types import appended
from xlserve.server.api.serving.cancellation import Cancellation
from xlserve.server.api.serving.leases import session_lease
from xlserve.server.api.serving.requests import check_prompt_size, idempotency, prompt_tokens, sized_work


# -- POST /v1/sessions/{id}/append, and the websocket's `append` ----------------------------------


@dataclasses.dataclass
class AppendResult:
    """A document chunk fed into a session's memory and committed."""

    session_id: str
    tokens: int  # the chunk's
    cached_tokens: int  # what the session's memory held before
    info: SessionInfo  # the session after the commit
    scores: dict | None  # logprob, scored_tokens, bits_per_byte: when asked for
    replayed: bool = False  # the remembered answer of an earlier request with the same Idempotency-Key

    @classmethod
    def remembered(cls, session_id: str, lease: RemoteLease) -> "AppendResult":
        """The answer an earlier append with the same Idempotency-Key got (its entry: `result`,
        and the session's version and tokens after it)."""
        entry = lease.replay
        result = entry["result"]
        info = dataclasses.replace(lease.info, tokens=entry["tokens"], version=entry["version"])
        return cls(session_id, result["tokens"], result["cached_tokens"], info, result["scores"], replayed=True)

    def body(self) -> AppendResponse:
        """The answer of POST /v1/sessions/{id}/append."""
        return AppendResponse(id=self.session_id, tokens=self.tokens, session_tokens=self.info.tokens,
                              version=self.info.version, cached_tokens=self.cached_tokens, **(self.scores or {}))


def scored_text_bytes(tokenizer, tokens: list[int], scored: int) -> int:
    """The UTF-8 bytes of the text the last `scored` of `tokens` decode to: what bits per byte
    divides by. Measured on the tokenizer's text, so that the same tokens score the same sent as
    text or as token ids, whatever bytes each token stands for (one for the byte tokenizer, a word
    or a BPE piece for others). The unscored tokens before them (a session's first token) own the
    text they decode to alone, up to where the whole text still agrees with it: a character split
    between an unscored token and a scored one counts with the scored."""
    if scored <= 0:
        return 0
    if hasattr(tokenizer, "byte_length"):  # a tokenizer that knows its tokens' bytes (the byte tokenizer)
        return tokenizer.byte_length(tokens[len(tokens) - scored :])
    whole = tokenizer.decode(tokens)
    unscored = len(tokens) - scored
    if unscored == 0:
        return len(whole.encode("utf-8"))
    before = tokenizer.decode(tokens[:unscored])
    agreed = len(os.path.commonprefix([whole, before]))
    return len(whole[agreed:].encode("utf-8"))


async def append_to_session(state: AppState, owner: str | None, session_id: str, text: str | list[int], score: bool,
                            cancellation: Cancellation | None = None,
                            idempotency_key: str | None = None) -> AppendResult:
    """Feed a document chunk into a session's memory and commit it; with `score`, also its
    log-probability given the memory. Appending a document chunk by chunk scores it exactly as
    one pass would. Raises Cancelled when `cancellation` asks for it before the commit begins;
    nothing is committed then (see server/api/serving/cancellation.py).
    With an Idempotency-Key seen before on the session, the first answer comes back, nothing runs."""
    arrived_at = time.monotonic()  # its latency counts its tokenizing and the wait for its session
    cancellation = cancellation or Cancellation()
    key = idempotency(idempotency_key, "append", {"text": text, "score": score})
    # what needs no model is refused before the session is fetched (from disk or Redis, perhaps
    # moving others off the device to make room); the vocabulary's checks follow the lease
    check_prompt_size(state, text, param="text")
    if len(text) == 0:
        raise InvalidRequest("text is empty", param="text")
    async with session_lease(state, session_id, owner, key) as lease:
        if lease.replay is not None:
            return AppendResult.remembered(session_id, lease)
        served = state.served(lease.info.model)
        tokens = await sized_work(len(text), prompt_tokens, state, served, text, "text")
        if not tokens:
            raise InvalidRequest("text is empty", param="text")
        cached = lease.info.tokens
        cancellation.check()  # a cancel while the session was being fetched
        submission = cancellation.track(await state.engine.append(lease, tokens, score))
        submission.arrived(arrived_at)
        fed = await appended(submission)
        scores = None
        if score:
            # bits per byte over the scored tokens (a session's very first token has no context)
            scored_bytes = await sized_work(len(tokens), scored_text_bytes, served.tokenizer, tokens, fed.scored)
            scores = {"logprob": fed.logprob, "scored_tokens": fed.scored,
                      "bits_per_byte": (-fed.logprob / math.log(2) / scored_bytes) if scored_bytes else None}
        cancellation.begin_commit()  # a cancel or disconnect before this point wins: nothing is committed
        try:
            info = await state.engine.commit(lease, {"tokens": len(tokens), "cached_tokens": cached, "scores": scores})
        except Exception:  # the engine counted it appended: an error ratio subtracts it (metrics.py)
            state.metrics.requests_not_committed.labels(lease.info.model).inc()
            raise
    state.metrics.memory_reused_tokens.labels(info.model).inc(cached)
    state.metrics.state_bytes_per_session.labels(info.model).observe(info.state_bytes)
    return AppendResult(session_id, len(tokens), cached, info, scores)


# -- the other session operations that change a session, and the list -----------------------------


async def create_session(state: AppState, owner: str | None, model: str,
                         idempotency_key: str | None = None) -> tuple[SessionObject, bool]:
    """POST /v1/sessions: the new session, and whether it is the one an earlier create with the
    same Idempotency-Key made (as it is now)."""
    state.served(model)
    key = idempotency(idempotency_key, "create", {"model": model})
    info, replayed = await state.engine.create_session(model, owner, key)
    return SessionObject(**info.public()), replayed


MAX_STATE_HEADER_BYTES = 1 << 20  # an exported state's header is a few kB; the engine checks any header


def body_digest_now(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


async def body_digest(blob: bytes) -> str:
    """A state body's SHA-256, on a worker thread: 0.13 s at 237 MB, which on the event loop every
    other client's stream waits out."""
    return await asyncio.to_thread(body_digest_now, blob)


def state_model_name(blob: bytes) -> str | None:
    """The `model` a state body's safetensors header names (read here, without torch, and only
    from a header of at most MAX_STATE_HEADER_BYTES: an exported state's is a few kB), or None
    where it names none or is no such header (the engine process says why). Run off the event
    loop: a header of megabytes takes seconds to parse."""
    length = int.from_bytes(blob[:8], "little") if len(blob) >= 8 else -1
    if not 0 <= length <= min(len(blob) - 8, MAX_STATE_HEADER_BYTES):
        return None
    try:
        header = json.loads(blob[8 : 8 + length])
    except (ValueError, RecursionError):  # not JSON, or nested past the parser
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    named = meta.get("model") if isinstance(meta, dict) else None
    return named if isinstance(named, str) else None


async def import_new_session(state: AppState, owner: str | None, model: str | None, blob: bytes,
                             idempotency_key: str | None = None) -> tuple[SessionObject, bool]:
    """POST /v1/sessions/import: the new session, and whether it is the one an earlier import with
    the same Idempotency-Key (and the same bytes) made (as it is now)."""
    # the model it goes to, as the engine resolves it: a retry that adds ?model= naming the state's
    # own model is the same import. The body's hash only with a key, and off the event loop
    key = None
    if idempotency_key is not None:
        named, digest = await asyncio.to_thread(lambda: (model or state_model_name(blob), body_digest_now(blob)))
        key = idempotency(idempotency_key, "import", {"model": named, "body": digest})
    info, replayed = await state.engine.import_session(model, owner, blob, key)
    return SessionObject(**info.public()), replayed


async def fork_session(state: AppState, owner: str | None, session_id: str,
                       idempotency_key: str | None = None) -> tuple[ForkedSession, bool]:
    """POST /v1/sessions/{id}/fork: the new session, and whether that is the remembered answer."""
    key = idempotency(idempotency_key, "fork", {})
    info, replayed = await state.engine.fork_session(session_id, owner, key)
    return ForkedSession(**info.public(), forked_from=session_id), replayed


async def replace_session_state(state: AppState, owner: str | None, session_id: str, blob: bytes,
                                idempotency_key: str | None = None) -> tuple[SessionObject, bool]:
    """PUT /v1/sessions/{id}/state: the session after its state was replaced (one commit)."""
    key = None if idempotency_key is None else idempotency(idempotency_key, "replace",
                                                             {"body": await body_digest(blob)})
    info, replayed = await state.engine.replace_state(session_id, owner, blob, key)
    return SessionObject(**info.public()), replayed


async def delete_session(state: AppState, owner: str | None, session_id: str,
                         idempotency_key: str | None = None) -> tuple[SessionDeleted, bool]:
    """DELETE /v1/sessions/{id}. With an Idempotency-Key its retry answers the same, not 404."""
    key = idempotency(idempotency_key, "delete", {})
    replayed = await state.engine.delete_session(session_id, owner, key)
    return SessionDeleted(id=session_id, object="session", deleted=True), replayed


async def list_sessions(state: AppState, owner: str | None, limit: int, after: str | None) -> SessionList:
    """GET /v1/sessions: the caller's sessions, newest first, as OpenAI lists objects."""
    infos, has_more = await state.engine.list_sessions(owner, limit, after)
    data = [SessionObject(**info.public()) for info in infos]
    return SessionList(object="list", data=data, first_id=data[0].id if data else None,
                       last_id=data[-1].id if data else None, has_more=has_more)
