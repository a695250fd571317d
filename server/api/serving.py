"""What a request does, between its protocol (server/api/protocol.py) and the engine process.

The routers (server/api/routers/) parse a request and hand it here. This module

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
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import Request
from pydantic import ValidationError
from fastapi.responses import StreamingResponse

from xlserve.server.api.deps import AppState, ServedModel, app_state, owner_of
from xlserve.server.api.chat import ChatTemplateError
from xlserve.server.api.errors import (
    APIError,
    Conflict,
    InvalidRequest,
    RequestTooLarge,
    as_api_error,
    validation_error,
)
from xlserve.server.api.protocol import (
    IDEMPOTENCY_KEY_PATTERN,
    MAX_PROMPTS,
    MAX_STOP_CHARACTERS,
    MAX_STOPS,
    AppendFrame,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    GenerateFrame,
    SamplingFields,
    SamplingOptions,
    TokenizeRequest,
)
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
    "APIError", "AppState", "Cancellation", "ChatCompletion", "Completion", "Conflict", "EventStream",
    "IDEMPOTENCY_KEY_HEADER", "InvalidRequest", "append_frames", "append_to_session", "app_state", "complete",
    "delete_session", "detokenize", "error_frame", "fork_session", "generation_frames", "list_sessions", "owner_of",
    "read_body", "replace_session_state", "replayed_headers", "stream_completion", "tokenize",
]


# -- building a request ---------------------------------------------------------------------------


def sampling_params(body: SamplingFields, echo: bool = False, n: int = 1) -> SamplingParams:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"at most {MAX_STOPS} stop strings", param="stop")
    if any(len(stop) > MAX_STOP_CHARACTERS for stop in stops):
        raise InvalidRequest(f"a stop string has at most {MAX_STOP_CHARACTERS} characters", param="stop")
    return SamplingParams(
        max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed, stop=stops, logprobs=body.logprobs, echo=echo, n=n,
        logit_bias={int(token): bias for token, bias in body.logit_bias.items()} if body.logit_bias else None,
    )


def check_logit_bias(params: SamplingParams, served: ServedModel) -> None:
    """Refuse a logit_bias naming a token the model does not have, before anything is queued."""
    outside = sorted(token for token in params.logit_bias or {} if token >= served.vocab_size)
    if outside:
        raise InvalidRequest(f"logit_bias names token ids outside the vocabulary [0, {served.vocab_size}): "
                             f"{outside[:5]}", param="logit_bias", code="invalid_logit_bias")


def prompt_tokens(state: AppState, served: ServedModel, prompt: str | list[int], param: str = "prompt") -> list[int]:
    """Tokenise a prompt (text or token ids), enforcing XLSERVE_MAX_PROMPT_BYTES; `param` names
    the field it came in."""
    limit = state.settings.max_prompt_bytes
    if isinstance(prompt, str):
        size = len(prompt.encode("utf-8"))
        if size > limit:
            raise InvalidRequest(f"{param} is {size} bytes; the limit is {limit} (XLSERVE_MAX_PROMPT_BYTES)",
                                 param=param, code="prompt_too_long")
        try:
            return served.tokenizer.encode(prompt)
        except ValueError as error:  # a word-level vocabulary without <unk> meets a word it lacks
            raise InvalidRequest(str(error), param=param) from None
    tokens = list(prompt)
    if len(tokens) > limit:
        raise InvalidRequest(f"{param} is {len(tokens)} tokens; the limit is {limit} (XLSERVE_MAX_PROMPT_BYTES)",
                             param=param, code="prompt_too_long")
    vocab = served.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)
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


# -- Idempotency-Key --------------------------------------------------------------------------------

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"  # on an answer that is the remembered one of an earlier request


def idempotency(key: str | None, kind: str, request: dict) -> dict | None:
    """A session-changing request's Idempotency-Key with the fingerprint of the request (a hash
    of its kind and body: the same key with another request is refused, 422), or None."""
    if key is None:
        return None
    if not re.fullmatch(IDEMPOTENCY_KEY_PATTERN, key):
        raise InvalidRequest(f"{IDEMPOTENCY_KEY_HEADER} must be 1 to 255 visible ASCII characters",
                             param=IDEMPOTENCY_KEY_HEADER, code="invalid_idempotency_key")
    canonical = json.dumps({"kind": kind, **request}, sort_keys=True, separators=(",", ":"))
    return {"key": key, "fingerprint": hashlib.sha256(canonical.encode()).hexdigest()}


def replayed_headers(replayed: bool) -> dict[str, str]:
    return {REPLAYED_HEADER: "true"} if replayed else {}


# -- a request's hold on its session --------------------------------------------------------------


@asynccontextmanager
async def session_lease(state: AppState, session_id: str | None, owner: str | None,
                        key: dict | None = None) -> AsyncIterator[RemoteLease | None]:
    """Hold a session for the duration of the block (None without a session id). Taking it may
    bring the state back from host RAM, disk or Redis in the engine process. Leaving the block
    releases it: after a commit that changes nothing, otherwise the session stays as it was.
    With `key` (see `idempotency`) seen before on the session, the lease holds nothing and its
    `replay` is the first request's remembered answer."""
    if not session_id:
        yield None
        return
    acquiring = asyncio.ensure_future(state.engine.acquire(session_id, owner, key))
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

    def __init__(self, state: AppState, body: SamplingFields, owner: str | None, echo: bool = False, n: int = 1,
                 idempotency_key: str | None = None, kind: str = "generate"):
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
        check_logit_bias(self.params, self.served)
        # OpenAI's batched form (completions only): several prompts, each run with n choices
        batch = body.prompts() if isinstance(body, CompletionRequest) else None
        if batch is not None:
            if body.session_id:
                raise InvalidRequest("a list of prompts cannot be combined with session_id: a session continues "
                                     "one text", param="prompt")
            if len(batch) > MAX_PROMPTS:
                raise InvalidRequest(f"at most {MAX_PROMPTS} prompts in one request; this one has {len(batch)}",
                                     param="prompt")
        self.prompts = [prompt_tokens(state, self.served, prompt) for prompt in (batch or [body.prompt])]
        self.tokens = self.prompts[0]
        self.lease: RemoteLease | None = None
        # a key only means something for a request that changes a session
        request = {**body.model_dump(include=set(SamplingFields.model_fields)), "echo": echo, "n": n}
        self.key = idempotency(idempotency_key, kind, request) if body.session_id else None

    @property
    def replay(self) -> dict | None:
        """The remembered entry when this request's Idempotency-Key was seen before."""
        return None if self.lease is None else self.lease.replay

    @property
    def remembering(self) -> bool:
        """Whether the commit remembers an answer (the request carries an Idempotency-Key)."""
        return self.lease is not None and self.lease.idempotency is not None

    @asynccontextmanager
    async def leased(self) -> AsyncIterator["Generation"]:
        """Hold the generation's session (if it names one) for the block, refusing a session of
        another model, and an empty prompt with nothing in memory to continue from."""
        body = self.body
        async with session_lease(self.state, body.session_id, self.owner, self.key) as lease:
            self.lease = lease
            if lease is not None and lease.replay is not None:  # answered before: nothing to check or run
                yield self
                return
            if lease is not None and lease.info.model != body.model:
                raise InvalidRequest(f"session '{body.session_id}' belongs to model '{lease.info.model}'",
                                     param="model")
            has_history = lease is not None and lease.has_history
            if not all(self.prompts) and not has_history and (body.max_tokens > 0 or self.echo):
                raise InvalidRequest("prompt is empty and there is no session history to continue", param="prompt")
            yield self

    async def submit(self) -> Submission:
        """Queue the generation; raises QueueFull / ShuttingDown / ValueError before anything started."""
        try:
            if len(self.prompts) > 1:
                return await PromptBatch.submit(self.state, self.served.name, self.prompts, self.params)
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

    async def commit(self, finished: Finished, result: dict | None = None) -> SessionInfo | None:
        """Make the generation's effect on its session permanent (durable when this returns);
        returns the session's info, or None without a session. On a cache error nothing changed.
        `result`, the answer, is remembered with the request's Idempotency-Key."""
        self.state.metrics.memory_reused_tokens.labels(self.body.model).inc(finished.cached_tokens)
        if self.lease is None:
            return None
        info = await self.state.engine.commit(self.lease, result)
        self.state.metrics.state_bytes_per_session.labels(self.body.model).observe(info.state_bytes)
        return info


# -- several prompts in one request (OpenAI's batched `prompt`) -----------------------------------


@dataclasses.dataclass
class BatchedPromptLogprobs(PromptLogprobs):
    """PromptLogprobs of one prompt of a PromptBatch, saying which."""

    prompt: int = 0


class PromptBatch:
    """The prompts of one batched completion, each run as its own engine request and seen as one
    submission: their events merged into one stream whose choice indexes are OpenAI's
    (prompt_index * n + choice_index), ending with one Finished that adds up their counts. A
    failure of any prompt fails the request (the others are dropped); a cancel cancels all."""

    def __init__(self, submissions: list[Submission], n: int):
        self.submissions, self.n = submissions, n
        self.queue: asyncio.Queue = asyncio.Queue()  # (prompt index, event or exception)
        self.forwarders = [asyncio.ensure_future(self._forward(prompt, submission))
                           for prompt, submission in enumerate(submissions)]

    @classmethod
    async def submit(cls, state: AppState, model: str, prompts: list[list[int]],
                     params: SamplingParams) -> "PromptBatch":
        """Queue every prompt; if one is refused (QueueFull, ...), those queued already are dropped."""
        submissions: list[Submission] = []
        try:
            for tokens in prompts:
                submissions.append(await state.engine.submit(model, tokens, dataclasses.asdict(params), None))
        except BaseException:
            for submission in submissions:
                submission.cancel()
            raise
        return cls(submissions, params.n)

    async def _forward(self, prompt: int, submission: Submission) -> None:
        try:
            async for event in submission.events():
                self.queue.put_nowait((prompt, event))
        except Exception as error:  # Cancelled, or the prompt's failure: the merged stream raises it
            self.queue.put_nowait((prompt, error))

    def cancel(self) -> None:
        for submission in self.submissions:
            submission.cancel()

    async def events(self) -> AsyncIterator[object]:
        ends: dict[int, Finished] = {}
        try:
            while len(ends) < len(self.submissions):
                prompt, event = await self.queue.get()
                if isinstance(event, BaseException):
                    raise event
                offset = prompt * self.n
                if isinstance(event, (TokenEvent, ChoiceFinished)):
                    yield dataclasses.replace(event, index=event.index + offset)
                elif isinstance(event, PromptLogprobs):
                    yield BatchedPromptLogprobs(event.tokens, event.logprobs, event.top, prompt=prompt)
                elif isinstance(event, Finished):
                    ends[prompt] = event
            finished = [ends[prompt] for prompt in range(len(self.submissions))]
            yield Finished(
                choices=[dataclasses.replace(choice, index=choice.index + prompt * self.n)
                         for prompt, end in enumerate(finished) for choice in end.choices],
                prompt_tokens=sum(end.prompt_tokens for end in finished),
                completion_tokens=sum(end.completion_tokens for end in finished),
                cached_tokens=sum(end.cached_tokens for end in finished), data=None)
        finally:  # a prompt still running (after a failure, a cancel, a client that left) is dropped
            for forwarder in self.forwarders:
                forwarder.cancel()


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

    def __init__(self, state: AppState, body: CompletionRequest, owner: str | None, idempotency_key: str | None = None):
        super().__init__(state, body, owner, echo=body.echo, n=body.n, idempotency_key=idempotency_key,
                         kind="completion")
        self.replayed = False  # the answer is the remembered one of an earlier request with the same key
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        # with several prompts, choice prompt_index * n + choice_index answers prompt prompt_index (as OpenAI)
        self.choices = [CompletionChoice(i, body.logprobs is not None) for i in range(len(self.prompts) * body.n)]
        self.token_name = self.served.tokenizer.token_text

    def echo_text(self, index: int = 0) -> str:
        """The prompt of choice `index`, as text."""
        return self.served.tokenizer.decode(self.prompts[index // self.body.n])

    def choices_for(self, event: PromptLogprobs) -> list[CompletionChoice]:
        """The choices that answer the prompt `event` scores (PromptBatch says which)."""
        prompt = getattr(event, "prompt", 0)
        return self.choices[prompt * self.body.n:(prompt + 1) * self.body.n]

    def chunk_format(self, extra: dict) -> Callable[..., bytes]:
        """The SSE event of one chunk of one choice (see `_chunk_format`)."""
        return _chunk_format(self, extra)

    def echo_pieces(self, event: PromptLogprobs) -> list[str]:
        detokenizer = self.served.tokenizer.detokenizer()
        pieces = [detokenizer.push(t) for t in event.tokens]
        pieces[-1] += detokenizer.flush()
        return pieces

    def add_token(self, event: TokenEvent) -> dict | None:
        return self.choices[event.index].add(self.token_name, [event.token], [event.logprob], [event.top],
                                             [event.text])

    def response(self, finished: Finished) -> dict:
        """The whole answer, as OpenAI's non-streamed body (also what an Idempotency-Key remembers)."""
        choices = [{"text": "".join(c.text), "index": c.index, "finish_reason": c.finish_reason,
                    "logprobs": c.logprobs if self.body.logprobs is not None else None} for c in self.choices]
        return self.envelope(choices, usage=usage(finished.prompt_tokens, finished.completion_tokens,
                                                  finished.cached_tokens))

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
        if completion.replay is not None:
            completion.replayed = True
            return completion.replay["result"]
        submission = await completion.submit()  # 429 / 503 here
        watcher = asyncio.create_task(_cancel_on_disconnect(request, submission))
        try:
            if body.echo and body.logprobs is None:
                for choice in completion.choices:
                    choice.text.append(completion.echo_text(choice.index))
            async for event in submission.events():
                if isinstance(event, TokenEvent):
                    completion.add_token(event)
                elif isinstance(event, ChoiceFinished):
                    completion.choices[event.index].text.append(event.text_tail)
                    completion.choices[event.index].finish_reason = event.finish_reason
                elif isinstance(event, PromptLogprobs):
                    pieces = completion.echo_pieces(event)
                    for choice in completion.choices_for(event):
                        choice.add(completion.token_name, event.tokens, event.logprobs, event.top, pieces)
                elif isinstance(event, Finished):
                    finished = event
            watcher.cancel()
            answer = completion.response(finished)
            await completion.commit(finished, answer if completion.remembering else None)
        except BaseException as error:
            completion.count_error(error)
            if isinstance(error, ValueError):
                raise InvalidRequest(str(error)) from None
            raise
        finally:
            watcher.cancel()
    return answer


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
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                **replayed_headers(completion.replayed)})


def _replayed_chunks(answer: dict, include_usage: bool) -> bytes:
    """A remembered completion (Idempotency-Key) as its stream: one chunk per choice with its whole
    text, the usage chunk when asked for, [DONE]."""
    envelope = {name: value for name, value in answer.items() if name not in ("choices", "usage")}
    extra = {"usage": None} if include_usage else {}
    events = [sse({**envelope, "choices": [choice], **extra}) for choice in answer["choices"]]
    if include_usage:
        events.append(sse({**envelope, "choices": [], "usage": answer["usage"]}))
    return b"".join(events) + sse("[DONE]")


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
        if completion.replay is not None:
            completion.replayed = True
            yield QUEUED
            yield _replayed_chunks(completion.replay["result"], bool(extra))
            return
        submission = await completion.submit()
        yield QUEUED
        chunk = completion.chunk_format(extra)  # now that the lease is held: chunks name its session
        try:
            if body.echo and body.logprobs is None and completion.tokens:
                for choice in completion.choices:
                    echoed = completion.echo_text(choice.index)
                    choice.text.append(echoed)  # the whole answer, for an Idempotency-Key
                    pending.append(chunk(choice.index, echoed))
            async for event in submission.events():
                if isinstance(event, TokenEvent):
                    logprobs = completion.add_token(event)
                    if event.text or logprobs:
                        pending.append(chunk(event.index, event.text, logprobs))
                elif isinstance(event, ChoiceFinished):
                    completion.choices[event.index].text.append(event.text_tail)
                    completion.choices[event.index].finish_reason = event.finish_reason
                    pending.append(chunk(event.index, event.text_tail, None, event.finish_reason))
                elif isinstance(event, PromptLogprobs):
                    pieces = completion.echo_pieces(event)
                    for choice in completion.choices_for(event):
                        logprobs = choice.add(completion.token_name, event.tokens, event.logprobs, event.top, pieces)
                        pending.append(chunk(choice.index, "".join(pieces), logprobs))
                elif isinstance(event, Finished):
                    await completion.commit(event, completion.response(event) if completion.remembering else None)
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


# -- POST /v1/chat/completions ----------------------------------------------------------------------


def chat_prompt(served: ServedModel, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
    """The prompt text the model's chat template makes of `messages` (server/api/chat.py); 400
    when the model has no template or its template refuses them."""
    template = served.chat_template
    if template is None:
        raise InvalidRequest(f"model '{served.name}' has no chat template, so it cannot take chat messages: use "
                             "/v1/completions with a prompt, or give the checkpoint a chat template "
                             "(chat_template.jinja, or chat_template in tokenizer_config.json or config.json)",
                             param="model", code="no_chat_template")
    rendered = [{"role": message.role, "content": message.text(),
                 **({"name": message.name} if message.name is not None else {})} for message in messages]
    try:
        return template.render(rendered, add_generation_prompt)
    except ChatTemplateError as error:
        raise InvalidRequest(f"the chat template of model '{served.name}' cannot render these messages: {error}",
                             param="messages", code="chat_template_error") from None


class ChatCompletion(Completion):
    """A chat completion: the messages rendered by the model's chat template into a prompt, run as
    a completion, answered in OpenAI's chat shapes (`chat.completion`, streamed as
    `chat.completion.chunk`s whose first delta per choice carries the role)."""

    def __init__(self, state: AppState, body: ChatCompletionRequest, owner: str | None):
        self.chat = body
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        fields = {name: getattr(body, name) for name in SamplingOptions.model_fields}
        fields.update(model=body.model, prompt=chat_prompt(state.served(body.model), body.messages), n=body.n,
                      stream=body.stream, stream_options=body.stream_options,
                      logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        try:
            request = CompletionRequest.model_validate(fields)
        except ValidationError as error:
            raise validation_error(error.errors()) from None
        super().__init__(state, request, owner)
        self.id = "chatcmpl-" + secrets.token_hex(12)

    def envelope(self, choices: list[dict], **extra) -> dict:
        kind = "chat.completion.chunk" if self.body.stream else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.body.model,
                "choices": choices, **extra}

    def chat_logprobs(self, piece: dict | None) -> dict | None:
        """Completion-style logprobs (tokens, token_logprobs, top_logprobs) in chat's shape."""
        if piece is None or not self.chat.logprobs:
            return None
        return {"content": [
            {"token": token, "logprob": logprob, "bytes": None,
             "top_logprobs": [{"token": name, "logprob": value, "bytes": None} for name, value in (top or {}).items()]}
            for token, logprob, top in zip(piece["tokens"], piece["token_logprobs"], piece["top_logprobs"])]}

    def response(self, finished: Finished) -> dict:
        choices = [{"index": choice.index, "message": {"role": "assistant", "content": "".join(choice.text)},
                    "logprobs": self.chat_logprobs(choice.logprobs), "finish_reason": choice.finish_reason}
                   for choice in self.choices]
        return self.envelope(choices, usage=usage(finished.prompt_tokens, finished.completion_tokens,
                                                  finished.cached_tokens))

    def chunk_format(self, extra: dict) -> Callable[..., bytes]:
        started: set[int] = set()  # choices whose role went out

        def chunk(index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> bytes:
            delta: dict = {}
            if index not in started:
                started.add(index)
                delta["role"] = "assistant"
            if text or finish_reason is None:
                delta["content"] = text
            return sse(self.envelope([{"index": index, "delta": delta, "logprobs": self.chat_logprobs(logprobs),
                                       "finish_reason": finish_reason}], **extra))

        return chunk


# -- POST /tokenize and /detokenize (as vLLM) -------------------------------------------------------


def tokenize(state: AppState, body: TokenizeRequest) -> dict:
    """A prompt's tokens as the model sees them (`messages` through its chat template), their
    count and the model's context length (`max_model_len`, null for a model without a bound)."""
    served = state.served(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("send either prompt or messages", param="prompt")
    text = body.prompt if body.prompt is not None else chat_prompt(served, body.messages, body.add_generation_prompt)
    tokens = prompt_tokens(state, served, text)
    return {"count": len(tokens), "max_model_len": served.card.get("max_context"), "tokens": tokens}


def detokenize(state: AppState, body: DetokenizeRequest) -> dict:
    """The text of token ids (bytes that are not UTF-8 become U+FFFD)."""
    served = state.served(body.model)
    tokens = prompt_tokens(state, served, body.tokens, param="tokens")
    return {"prompt": served.tokenizer.decode(tokens)}


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
                            cancellation: Cancellation | None = None,
                            idempotency_key: str | None = None) -> AppendResult:
    """Feed a document chunk into a session's memory and commit it; with `score`, also its
    log-probability given the memory. Appending a document chunk by chunk scores it exactly as
    one pass would. Raises Cancelled when `cancellation` asks for it; nothing is committed then.
    With an Idempotency-Key seen before on the session, the first answer comes back, nothing runs."""
    cancellation = cancellation or Cancellation()
    key = idempotency(idempotency_key, "append", {"text": text, "score": score})
    async with session_lease(state, session_id, owner, key) as lease:
        if lease.replay is not None:
            return AppendResult.remembered(session_id, lease)
        tokens = prompt_tokens(state, state.served(lease.info.model), text)
        if not tokens:
            raise InvalidRequest("text is empty", param="text")
        cached = lease.info.tokens
        if cancellation.requested:  # while the session was being fetched
            raise Cancelled()
        submission = cancellation.track(await state.engine.append(lease, tokens, score))
        fed = await appended(submission)
        scores = None
        if score:
            # bits per byte over the scored tokens (a session's very first token has no context)
            text_bytes = len(tokens) if isinstance(text, list) else len(text.encode("utf-8"))
            scored_bytes = text_bytes - (len(tokens) - fed.scored)
            scores = {"logprob": fed.logprob, "scored_tokens": fed.scored,
                      "bits_per_byte": (-fed.logprob / math.log(2) / scored_bytes) if scored_bytes else None}
        info = await state.engine.commit(lease, {"tokens": len(tokens), "cached_tokens": cached, "scores": scores})
    state.metrics.memory_reused_tokens.labels(info.model).inc(cached)
    state.metrics.state_bytes_per_session.labels(info.model).observe(info.state_bytes)
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
    generation = Generation(state, frame, owner, idempotency_key=frame.idempotency_key, kind="generate")
    return await queued(_generation_frames(generation, frame.id, cancellation))


async def _generation_frames(generation: Generation, request_id: str | None,
                             cancellation: Cancellation) -> AsyncGenerator:
    body = generation.body
    want_top = body.logprobs is not None and body.logprobs > 0
    token_name = generation.served.tokenizer.token_text
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
            try:
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
                        info = await generation.commit(event, remembered if generation.remembering else None)
                        done = {"type": "done", "id": request_id, "finish_reason": event.finish_reason,
                                "text": tail, "usage": counts, "session_id": body.session_id}
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
        result = await append_to_session(state, owner, frame.session_id, frame.text, frame.score, cancellation,
                                         frame.idempotency_key)
    except Cancelled:
        yield {"type": "done", "id": frame.id, "finish_reason": "cancelled", "session_id": frame.session_id}
        return
    yield {"type": "done", "id": frame.id, "finish_reason": None, "session_id": frame.session_id,
           "usage": usage(result.tokens, 0, result.cached_tokens), "session_tokens": result.info.tokens,
           "version": result.info.version, **(result.scores or {}), **({"replayed": True} if result.replayed else {})}


# -- the other session operations that change a session, and the list -----------------------------


async def fork_session(state: AppState, owner: str | None, session_id: str,
                       idempotency_key: str | None = None) -> tuple[dict, bool]:
    """POST /v1/sessions/{id}/fork: the new session, and whether that is the remembered answer."""
    key = idempotency(idempotency_key, "fork", {})
    result, replayed = await state.engine.session_change("fork", idempotency=key, session_id=session_id, owner=owner)
    return {**SessionInfo(**result).public(), "forked_from": session_id}, replayed


async def replace_session_state(state: AppState, owner: str | None, session_id: str, blob: bytes,
                                idempotency_key: str | None = None) -> tuple[dict, bool]:
    """PUT /v1/sessions/{id}/state: the session after its state was replaced (one commit)."""
    key = idempotency(idempotency_key, "replace", {"body": hashlib.sha256(blob).hexdigest()})
    result, replayed = await state.engine.session_change("replace", blob, idempotency=key, session_id=session_id,
                                                         owner=owner)
    return SessionInfo(**result).public(), replayed


async def delete_session(state: AppState, owner: str | None, session_id: str,
                         idempotency_key: str | None = None) -> tuple[dict, bool]:
    """DELETE /v1/sessions/{id}. With an Idempotency-Key its retry answers the same, not 404."""
    key = idempotency(idempotency_key, "delete", {})
    _, replayed = await state.engine.session_change("delete", idempotency=key, session_id=session_id, owner=owner)
    return {"id": session_id, "object": "session", "deleted": True}, replayed


async def list_sessions(state: AppState, owner: str | None, limit: int, after: str | None) -> dict:
    """GET /v1/sessions: the caller's sessions, newest first, as OpenAI lists objects."""
    infos, has_more = await state.engine.list_sessions(owner, limit, after)
    data = [info.public() for info in infos]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
