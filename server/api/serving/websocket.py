"""The websocket's answers (docs/websocket.md): generation and append frames, error frames."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from xlserve.server.api.deps import AppState
from xlserve.server.api.errors import count_error
from xlserve.server.api.protocol import AppendFrame, GenerateFrame
from xlserve.server.engine.types import Cancelled, ChoiceFinished, Finished, TokenEvent
from xlserve.server.api.serving.generation import Generation
from xlserve.server.api.serving.leases import QUEUED, queued
from xlserve.server.api.serving.requests import error_for, sized_work, usage
from xlserve.server.api.serving.cancellation import Cancellation
from xlserve.server.api.serving.sessions import append_to_session


# -- the websocket's answers (docs/websocket.md) --------------------------------------------------


def error_frame(request_id: str | None, error: BaseException, state: AppState | None = None,
                model: str | None = None) -> dict:
    """The `error` frame for anything a request raised; `retry_after` (seconds) where an HTTP
    answer would carry Retry-After. With the app's `state` the error is counted, under `model`
    when the frame named a served one (server/api/errors.py's count_error): once per frame sent."""
    api_error = error_for(error)
    count_error(state, api_error, getattr(error, "session_model", None) or model)  # session_lease's, once held
    frame = {"type": "error", "id": request_id, **api_error.body()}
    if "Retry-After" in api_error.headers:
        frame["retry_after"] = int(api_error.headers["Retry-After"])
    return frame


async def generation_frames(state: AppState, frame: GenerateFrame, owner: str | None,
                            cancellation: Cancellation) -> AsyncGenerator:
    """The answer to `generate`, started (see `queued`): a `token` frame per generated token, then
    one `done` frame, whose `finish_reason` is "cancelled" after a cancel. A failure after the
    start is raised, for the caller to answer with an error frame."""
    # tokenized (a large prompt) on a worker thread, as HTTP's (routers/completions.py)
    generation = await sized_work(len(frame.prompt), Generation, state, frame, owner,
                                  idempotency_key=frame.idempotency_key, kind="generate")
    return await queued(_generation_frames(generation, frame.id, cancellation))


async def _generation_frames(generation: Generation, request_id: str | None,
                             cancellation: Cancellation) -> AsyncGenerator:
    body = generation.body
    want_top = body.logprobs is not None and body.logprobs > 0
    token_name = generation.served.tokenizer.token_string  # the text each token adds
    choice_end: ChoiceFinished | None = None
    generated = 0
    texts: list[str] = []  # the whole text, remembered with an Idempotency-Key
    try:
        async with generation.leased():
            if generation.replay is not None:  # answered before: its `done` again, with the whole text
                yield QUEUED
                entry = generation.replay
                yield {"type": "done", "id": request_id, **entry["result"], "session_id": body.session_id,
                       "session_tokens": entry["tokens"], "version": entry["version"], "replayed": True}
                return
            submission = cancellation.track(await generation.submit())
            yield QUEUED
            async for event in submission.events():
                if isinstance(event, TokenEvent):
                    generated += 1
                    texts.append(event.text)
                    token = {"type": "token", "id": request_id, "text": event.text, "token": event.token,
                             "logprob": event.logprob}
                    if want_top:
                        token["top_logprobs"] = {token_name(t): v for t, v in event.top}
                    yield token
                elif isinstance(event, ChoiceFinished):
                    choice_end = event
                elif isinstance(event, Finished):
                    tail = choice_end.text_tail if choice_end else ""
                    counts = usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
                    remembered = {"finish_reason": event.finish_reason, "text": "".join(texts) + tail,
                                  "usage": counts}
                    cancellation.begin_commit()  # a cancel that came first wins: nothing is committed
                    info = await generation.commit(event, remembered if generation.remembering else None)
                    done = {"type": "done", "id": request_id, "finish_reason": event.finish_reason,
                            "text": tail, "usage": counts, "session_id": body.session_id}
                    if info is not None:
                        done.update(session_tokens=info.tokens, version=info.version)
                    yield done
    except Cancelled:
        yield cancelled_generation_frame(request_id, body.session_id, len(generation.tokens), generated)


def cancelled_generation_frame(request_id: str | None, session_id: str | None, prompt_tokens: int = 0,
                               generated: int = 0) -> dict:
    """The `done` frame of a generate that was cancelled: nothing committed; `usage` counts what
    ran (nothing, for one cancelled while it was being queued)."""
    return {"type": "done", "id": request_id, "finish_reason": "cancelled", "text": "",
            "usage": usage(prompt_tokens, generated), "session_id": session_id}


async def append_frames(state: AppState, frame: AppendFrame, owner: str | None,
                        cancellation: Cancellation) -> AsyncGenerator:
    """The answer to `append`: one `done` frame (`finish_reason` null, or "cancelled"). A failure
    is raised, for the caller to answer with an error frame."""
    try:
        result = await append_to_session(state, owner, frame.session_id, frame.text, frame.score, cancellation,
                                         frame.idempotency_key)
    except Cancelled:
        yield {"type": "done", "id": frame.id, "finish_reason": "cancelled", "session_id": frame.session_id}
        return
    yield {"type": "done", "id": frame.id, "finish_reason": None, "session_id": frame.session_id,
           "usage": usage(result.tokens, 0, result.cached_tokens), "session_tokens": result.info.tokens,
           "version": result.info.version, **(result.scores or {}), **({"replayed": True} if result.replayed else {})}
