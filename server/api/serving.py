"""What a request does, between its protocol (server/api/protocol.py) and the engine process.

The routers (server/api/routers/) parse a request and hand it here. This module

- builds what the engine runs: sampling parameters, prompt tokens, the server's limits;
- holds a request's session (`session_lease`): taken before its work is queued and released
  when the request ends, however it ends. A request makes its session's new memory permanent
  with an explicit commit, on success only; after a commit the release changes nothing, so a
  disconnect, an error or a cancel leaves the session as it was;
- assembles the answers: OpenAI completion bodies and SSE chunks, websocket frames, `usage`;
- feeds document chunks into sessions (`append_to_session`), the one flow behind both
  POST /v1/sessions/{id}/append and the websocket's `append`.

What the engine process and the session cache raise reaches the client through the one table
in server/api/errors.py; this module raises API errors only for what it checks itself.

A streamed answer (SSE, websocket frames) is an async generator that first yields `QUEUED`,
once its request is validated, holds its session and is queued in the engine. `queued()` runs
it that far before the response starts, so what is refused up to then is still refused as a
whole (an HTTP status), and the lease is held by the one `async with` around everything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from xlserve.server.api.deps import AppState, ServedModel, app_state, owner_of
from xlserve.server.api.errors import APIError, Conflict, InvalidRequest, RequestTooLarge, as_api_error
from xlserve.server.api.protocol import MAX_STOPS, AppendFrame, CompletionRequest, GenerateFrame, SamplingFields
from xlserve.server.cache.errors import SessionInfo
from xlserve.server.engine.client import RemoteLease
from xlserve.server.engine.types import (
    Cancelled,
    ChoiceFinished,
    Finished,
    PromptLogprobs,
    SamplingParams,
    Submission,
    TokenEvent,
    appended,
)

# what the routers use; the app's state, authentication and the errors a router raises itself
# come from deps and errors, and reach the routers through here
__all__ = [
    "APIError", "AppState", "Cancellation", "Completion", "Conflict", "EventStream", "InvalidRequest",
    "append_frames", "append_to_session", "app_state", "complete", "error_frame", "generation_frames", "owner_of",
    "read_body", "stream_completion",
]


# -- building a request ---------------------------------------------------------------------------


def sampling_params(body: SamplingFields, echo: bool = False, n: int = 1) -> SamplingParams:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"at most {MAX_STOPS} stop strings", param="stop")
    return SamplingParams(
        max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed, stop=stops, logprobs=body.logprobs, echo=echo, n=n,
    )


def prompt_tokens(state: AppState, served: ServedModel, prompt: str | list[int]) -> list[int]:
    """Tokenise a prompt (text or token ids), enforcing XLSERVE_MAX_PROMPT_BYTES."""
    limit = state.settings.max_prompt_bytes
    if isinstance(prompt, str):
        size = len(prompt.encode("utf-8"))
        if size > limit:
            raise InvalidRequest(f"prompt is {size} bytes; the limit is {limit} (XLSERVE_MAX_PROMPT_BYTES)",
                                 param="prompt", code="prompt_too_long")
        return served.tokenizer.encode(prompt)
    tokens = list(prompt)
    if len(tokens) > limit:
        raise InvalidRequest(f"prompt is {len(tokens)} tokens; the limit is {limit} (XLSERVE_MAX_PROMPT_BYTES)",
                             param="prompt", code="prompt_too_long")
    vocab = served.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    return tokens


async def read_body(request: Request) -> bytes:
    """The raw body (a session state), refused past XLSERVE_MAX_REQUEST_BODY_BYTES even when no
    Content-Length announced it."""
    limit = app_state(request).settings.max_request_body_bytes
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"request body is over {limit} bytes (XLSERVE_MAX_REQUEST_BODY_BYTES)")
        chunks.append(chunk)
    return b"".join(chunks)


def error_for(error: BaseException) -> APIError:
    """The APIError a client sees for anything a request raised; a ValueError from the engine
    is a request it could not run as asked."""
    return as_api_error(InvalidRequest(str(error)) if isinstance(error, ValueError) else error)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's `usage`; `prompt_tokens_details.cached_tokens`, the context that came from the
    session's memory instead of being computed, when the request got that far."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


# -- a request's hold on its session --------------------------------------------------------------


@asynccontextmanager
async def session_lease(state: AppState, session_id: str | None,
                        owner: str | None) -> AsyncIterator[RemoteLease | None]:
    """Hold a session for the duration of the block (None without a session id). Taking it may
    bring the state back from host RAM, disk or Redis in the engine process. Leaving the block
    releases it: after a commit that changes nothing, otherwise the session stays as it was."""
    if not session_id:
        yield None
        return
    acquiring = asyncio.ensure_future(state.engine.acquire(session_id, owner))
    try:
        lease = await asyncio.shield(acquiring)
    except asyncio.CancelledError:
        # the caller is gone (a client that left) but the lease is on its way: let it go when it
        # arrives, so the session never stays pinned
        acquiring.add_done_callback(
            lambda done: done.cancelled() or done.exception() is not None or state.engine.release(done.result()))
        raise
    try:
        yield lease
    finally:
        state.engine.release(lease)


QUEUED = object()  # a streamed answer's first item: its request holds its session and is queued


async def queued(answer: AsyncGenerator) -> AsyncGenerator:
    """Run a streamed answer up to its QUEUED mark here: what refuses the request until then
    (validation, its session missing or busy, a full queue) raises from this call; after it the
    answer only streams."""
    if await anext(answer) is not QUEUED:
        raise RuntimeError("a streamed answer must first yield QUEUED")
    return answer


# -- generations ----------------------------------------------------------------------------------


class Generation:
    """One generation (HTTP or websocket), validated: the served model, sampling parameters and
    prompt tokens. `async with leased()` holds its session; within it, `submit()` queues it in the
    engine process and `commit()` makes its effect on the session permanent."""

    def __init__(self, state: AppState, body: SamplingFields, owner: str | None, echo: bool = False, n: int = 1):
        self.state, self.body, self.owner, self.echo = state, body, owner, echo
        self.served = state.served(body.model)
        self.params = sampling_params(body, echo, n)
        limit = state.settings.max_tokens_limit
        if body.max_tokens > limit:
            raise InvalidRequest(f"max_tokens is {body.max_tokens}; the limit is {limit} (XLSERVE_MAX_TOKENS_LIMIT)",
                                 param="max_tokens")
        if n > 1 and body.session_id:
            raise InvalidRequest("n > 1 cannot be combined with session_id: a session keeps one continuation",
                                 param="n")
        self.tokens = prompt_tokens(state, self.served, body.prompt)
        self.lease: RemoteLease | None = None

    @asynccontextmanager
    async def leased(self) -> AsyncIterator["Generation"]:
        """Hold the generation's session (if it names one) for the block, refusing a session of
        another model, and an empty prompt with nothing in memory to continue from."""
        body = self.body
        async with session_lease(self.state, body.session_id, self.owner) as lease:
            self.lease = lease
            if lease is not None and lease.info.model != body.model:
                raise InvalidRequest(f"session '{body.session_id}' belongs to model '{lease.info.model}'",
                                     param="model")
            has_history = lease is not None and lease.has_history
            if not self.tokens and not has_history and (body.max_tokens > 0 or self.echo):
                raise InvalidRequest("prompt is empty and there is no session history to continue", param="prompt")
            yield self

    async def submit(self) -> Submission:
        """Queue the generation; raises QueueFull / ShuttingDown / ValueError before anything started."""
        try:
            return await self.state.engine.submit(self.served.name, self.tokens, dataclasses.asdict(self.params),
                                                  self.lease)
        except BaseException as error:
            self.count_error(error)
            raise

    def count_error(self, error: BaseException) -> None:
        """Outcomes: xlserve_requests_total by finish reason (the engine counts stop, length and
        cancelled), xlserve_request_errors_total by error type (here)."""
        if not isinstance(error, (Cancelled, asyncio.CancelledError)):
            self.state.metrics.request_errors.labels(self.body.model, error_for(error).type).inc()

    async def commit(self, finished: Finished) -> SessionInfo | None:
        """Make the generation's effect on its session permanent (durable when this returns);
        returns the session's info, or None without a session. On a cache error nothing changed."""
        self.state.metrics.memory_reused_tokens.labels(self.body.model).inc(finished.cached_tokens)
        if self.lease is None:
            return None
        info = await self.state.engine.commit(self.lease)
        self.state.metrics.state_bytes_per_session.labels(self.body.model).observe(info.state_bytes)
        return info


# -- POST /v1/completions -------------------------------------------------------------------------


class CompletionChoice:
    """The pieces of one choice's answer: its text and OpenAI-style logprobs."""

    def __init__(self, index: int, want_logprobs: bool):
        self.index = index
        self.text: list[str] = []
        self.want_logprobs = want_logprobs
        self.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.text_length = 0
        self.finish_reason: str | None = None

    def add(self, token_name, tokens, logprobs, tops, pieces) -> dict | None:
        """Record text pieces (one per token) and their logprobs; returns this piece's logprobs."""
        self.text.extend(pieces)
        if not self.want_logprobs:
            self.text_length += sum(len(t) for t in pieces)
            return None
        piece = {
            "tokens": [token_name(t) for t in tokens],
            "token_logprobs": list(logprobs),
            "top_logprobs": [None if lp is None else {token_name(t): v for t, v in top}
                             for top, lp in zip(tops, logprobs)],
            "text_offset": [],
        }
        for text in pieces:
            piece["text_offset"].append(self.text_length)
            self.text_length += len(text)
        for key in self.logprobs:
            self.logprobs[key].extend(piece[key])
        return piece


class Completion(Generation):
    """A generation asked for through /v1/completions: its id, and the answer of each choice."""

    body: CompletionRequest

    def __init__(self, state: AppState, body: CompletionRequest, owner: str | None):
        super().__init__(state, body, owner, echo=body.echo, n=body.n)
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.choices = [CompletionChoice(i, body.logprobs is not None) for i in range(body.n)]
        self.token_name = self.served.tokenizer.token_text

    def echo_text(self) -> str:
        return self.served.tokenizer.decode(self.tokens)

    def echo_pieces(self, event: PromptLogprobs) -> list[str]:
        detokenizer = self.served.tokenizer.detokenizer()
        pieces = [detokenizer.push(t) for t in event.tokens]
        pieces[-1] += detokenizer.flush()
        return pieces

    def add_token(self, event: TokenEvent) -> dict | None:
        return self.choices[event.index].add(self.token_name, [event.token], [event.logprob], [event.top],
                                             [event.text])

    def envelope(self, choices: list[dict], **extra) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.body.model,
                "choices": choices, **extra}
        if self.lease is not None:
            body["session_id"] = self.lease.session_id
        return body


async def _cancel_on_disconnect(request: Request, submission: Submission) -> None:
    """Cancel a non-streamed generation whose client went away (nothing is committed)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            submission.cancel()
            return


async def complete(completion: Completion, request: Request) -> dict:
    """The whole answer of a non-streamed completion, as OpenAI's body."""
    body = completion.body
    finished = None
    async with completion.leased():
        submission = await completion.submit()  # 429 / 503 here
        watcher = asyncio.create_task(_cancel_on_disconnect(request, submission))
        try:
            if body.echo and body.logprobs is None:
                for choice in completion.choices:
                    choice.text.append(completion.echo_text())
            async for event in submission.events():
                if isinstance(event, TokenEvent):
                    completion.add_token(event)
                elif isinstance(event, ChoiceFinished):
                    completion.choices[event.index].text.append(event.text_tail)
                    completion.choices[event.index].finish_reason = event.finish_reason
                elif isinstance(event, PromptLogprobs):
                    pieces = completion.echo_pieces(event)
                    for choice in completion.choices:
                        choice.add(completion.token_name, event.tokens, event.logprobs, event.top, pieces)
                elif isinstance(event, Finished):
                    finished = event
            watcher.cancel()
            await completion.commit(finished)
        except BaseException as error:
            completion.count_error(error)
            if isinstance(error, ValueError):
                raise InvalidRequest(str(error)) from None
            raise
        finally:
            watcher.cancel()
    choices = [{"text": "".join(c.text), "index": c.index, "finish_reason": c.finish_reason,
                "logprobs": c.logprobs if body.logprobs is not None else None} for c in completion.choices]
    return completion.envelope(choices, usage=usage(finished.prompt_tokens, finished.completion_tokens,
                                                    finished.cached_tokens))


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


class EventStream(StreamingResponse):
    """A streaming response that notices a client disconnect at once (not only at the next
    write) and closes the stream, so the generation is cancelled within one engine step."""

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            try:
                await self.stream_response(send)
            except OSError:  # the client went away mid-write
                pass
            finally:
                task_group.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                task_group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


async def stream_completion(completion: Completion) -> EventStream:
    """A streamed completion's response, once the generation is queued (a refusal before then
    is an HTTP error)."""
    chunks = await queued(_completion_chunks(completion))
    return EventStream(chunks, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _chunk_format(completion: Completion, extra: dict) -> Callable[..., bytes]:
    """The SSE event of one chunk of one choice."""
    # a text-only chunk is the same JSON every time but for its text: format it from a template
    templates = [json.dumps(completion.envelope([{"text": "\x00", "index": i, "logprobs": None, "finish_reason": None}],
                                                **extra)).split('"\\u0000"') for i in range(len(completion.choices))]

    def chunk(index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> bytes:
        if logprobs is None and finish_reason is None:
            head, tail = templates[index]
            return f"data: {head}{json.dumps(text)}{tail}\n\n".encode()
        return sse(completion.envelope([{"text": text, "index": index, "logprobs": logprobs,
                                         "finish_reason": finish_reason}], **extra))

    return chunk


async def _completion_chunks(completion: Completion) -> AsyncGenerator:
    """SSE chunks as OpenAI sends them: one per released piece of text per choice, a last one per
    choice with its `finish_reason`, with `stream_options.include_usage` a final one with empty
    `choices` and the `usage`, then `data: [DONE]`. An error after the stream started is sent in
    the stream. Chunks that are ready together (the client or the loop fell behind) go out in
    one write."""
    body = completion.body
    extra = {"usage": None} if body.stream_options and body.stream_options.include_usage else {}
    pending: list[bytes] = []
    failure: APIError | None = None
    async with completion.leased():
        submission = await completion.submit()
        yield QUEUED
        chunk = _chunk_format(completion, extra)  # now that the lease is held: chunks name its session
        try:
            if body.echo and body.logprobs is None and completion.tokens:
                for choice in completion.choices:
                    pending.append(chunk(choice.index, completion.echo_text()))
            async for event in submission.events():
                if isinstance(event, TokenEvent):
                    logprobs = completion.add_token(event)
                    if event.text or logprobs:
                        pending.append(chunk(event.index, event.text, logprobs))
                elif isinstance(event, ChoiceFinished):
                    pending.append(chunk(event.index, event.text_tail, None, event.finish_reason))
                elif isinstance(event, PromptLogprobs):
                    pieces = completion.echo_pieces(event)
                    for choice in completion.choices:
                        logprobs = choice.add(completion.token_name, event.tokens, event.logprobs, event.top, pieces)
                        pending.append(chunk(choice.index, "".join(pieces), logprobs))
                elif isinstance(event, Finished):
                    await completion.commit(event)
                    if extra:
                        pending.append(sse(completion.envelope([], usage=usage(
                            event.prompt_tokens, event.completion_tokens, event.cached_tokens))))
                if pending and submission.queue.empty():
                    yield b"".join(pending)
                    pending = []
            pending.append(sse("[DONE]"))
        except Exception as error:  # not a client that left: that ends the stream with GeneratorExit or CancelledError
            completion.count_error(error)
            failure = error_for(error)
    if failure is not None:  # after the release: the session is free again when the client reads this
        pending += [sse(failure.body()), sse("[DONE]")]
    yield b"".join(pending)


# -- POST /v1/sessions/{id}/append, and the websocket's `append` ----------------------------------


@dataclasses.dataclass
class AppendResult:
    """A document chunk fed into a session's memory and committed."""

    session_id: str
    tokens: int  # the chunk's
    cached_tokens: int  # what the session's memory held before
    info: SessionInfo  # the session after the commit
    scores: dict | None  # logprob, scored_tokens, bits_per_byte: when asked for

    def body(self) -> dict:
        """The answer of POST /v1/sessions/{id}/append."""
        return {"id": self.session_id, "tokens": self.tokens, "session_tokens": self.info.tokens,
                "version": self.info.version, "cached_tokens": self.cached_tokens, **(self.scores or {})}


class Cancellation:
    """A client's wish to stop its request, which may come before the request reaches the engine:
    the request checks `requested` before it queues, then `track`s its submission, through which
    a cancel that comes later stops it in the engine."""

    def __init__(self):
        self.requested = False
        self.submission: Submission | None = None

    def cancel(self) -> None:
        self.requested = True
        if self.submission is not None:
            self.submission.cancel()

    def track(self, submission: Submission) -> Submission:
        self.submission = submission
        if self.requested:
            submission.cancel()
        return submission


async def append_to_session(state: AppState, owner: str | None, session_id: str, text: str | list[int], score: bool,
                            cancellation: Cancellation | None = None) -> AppendResult:
    """Feed a document chunk into a session's memory and commit it; with `score`, also its
    log-probability given the memory. Appending a document chunk by chunk scores it exactly as
    one pass would. Raises Cancelled when `cancellation` asks for it; nothing is committed then."""
    cancellation = cancellation or Cancellation()
    async with session_lease(state, session_id, owner) as lease:
        tokens = prompt_tokens(state, state.served(lease.info.model), text)
        if not tokens:
            raise InvalidRequest("text is empty", param="text")
        cached = lease.info.tokens
        if cancellation.requested:  # while the session was being fetched
            raise Cancelled()
        submission = cancellation.track(await state.engine.append(lease, tokens, score))
        fed = await appended(submission)
        info = await state.engine.commit(lease)
    state.metrics.memory_reused_tokens.labels(info.model).inc(cached)
    state.metrics.state_bytes_per_session.labels(info.model).observe(info.state_bytes)
    scores = None
    if score:
        # bits per byte over the scored tokens (a session's very first token has no context)
        text_bytes = len(tokens) if isinstance(text, list) else len(text.encode("utf-8"))
        scored_bytes = text_bytes - (len(tokens) - fed.scored)
        scores = {"logprob": fed.logprob, "scored_tokens": fed.scored,
                  "bits_per_byte": (-fed.logprob / math.log(2) / scored_bytes) if scored_bytes else None}
    return AppendResult(session_id, len(tokens), cached, info, scores)


# -- the websocket's answers (docs/websocket.md) --------------------------------------------------


def error_frame(request_id: str | None, error: BaseException) -> dict:
    """The `error` frame for anything a request raised; `retry_after` (seconds) where an HTTP
    answer would carry Retry-After."""
    api_error = error_for(error)
    frame = {"type": "error", "id": request_id, **api_error.body()}
    if "Retry-After" in api_error.headers:
        frame["retry_after"] = int(api_error.headers["Retry-After"])
    return frame


async def generation_frames(state: AppState, frame: GenerateFrame, owner: str | None,
                            cancellation: Cancellation) -> AsyncGenerator:
    """The answer to `generate`, started (see `queued`): a `token` frame per generated token, then
    one `done` frame, whose `finish_reason` is "cancelled" after a cancel. A failure after the
    start is raised, for the caller to answer with an error frame."""
    return await queued(_generation_frames(Generation(state, frame, owner), frame.id, cancellation))


async def _generation_frames(generation: Generation, request_id: str | None,
                             cancellation: Cancellation) -> AsyncGenerator:
    body = generation.body
    want_top = body.logprobs is not None and body.logprobs > 0
    token_name = generation.served.tokenizer.token_text
    choice_end: ChoiceFinished | None = None
    generated = 0
    try:
        async with generation.leased():
            submission = cancellation.track(await generation.submit())
            yield QUEUED
            try:
                async for event in submission.events():
                    if isinstance(event, TokenEvent):
                        generated += 1
                        token = {"type": "token", "id": request_id, "text": event.text, "token": event.token,
                                 "logprob": event.logprob}
                        if want_top:
                            token["top_logprobs"] = {token_name(t): v for t, v in event.top}
                        yield token
                    elif isinstance(event, ChoiceFinished):
                        choice_end = event
                    elif isinstance(event, Finished):
                        info = await generation.commit(event)
                        done = {"type": "done", "id": request_id, "finish_reason": event.finish_reason,
                                "text": choice_end.text_tail if choice_end else "",
                                "usage": usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens),
                                "session_id": body.session_id}
                        if info is not None:
                            done.update(session_tokens=info.tokens, version=info.version)
                        yield done
            except Exception as error:
                generation.count_error(error)
                raise
    except Cancelled:
        yield {"type": "done", "id": request_id, "finish_reason": "cancelled", "text": "",
               "usage": usage(len(generation.tokens), generated), "session_id": body.session_id}


async def append_frames(state: AppState, frame: AppendFrame, owner: str | None,
                        cancellation: Cancellation) -> AsyncGenerator:
    """The answer to `append`: one `done` frame (`finish_reason` null, or "cancelled"). A failure
    is raised, for the caller to answer with an error frame."""
    try:
        result = await append_to_session(state, owner, frame.session_id, frame.text, frame.score, cancellation)
    except Cancelled:
        yield {"type": "done", "id": frame.id, "finish_reason": "cancelled", "session_id": frame.session_id}
        return
    yield {"type": "done", "id": frame.id, "finish_reason": None, "session_id": frame.session_id,
           "usage": usage(result.tokens, 0, result.cached_tokens), "session_tokens": result.info.tokens,
           "version": result.info.version, **(result.scores or {})}
