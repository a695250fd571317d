"""POST /v1/completions: OpenAI's completions API, plus `session_id`, `top_k`, `min_p` and
`repetition_penalty`.

With `session_id` the prompt continues the session's memory instead of starting from nothing:
the history is not recomputed, and `usage.prompt_tokens_details.cached_tokens` says how many
tokens of context came from memory. The session's memory afterwards holds the prompt and every
generated token (a stop string included, since the model produced it), committed only when the
request completes: a client that disconnects (streamed or not), an error or a cancel leaves the
session as it was. `n > 1` cannot be combined with `session_id` (which choice would the session
keep?).

Streaming is SSE as OpenAI does it: `data: {chunk}` events, one per released piece of text per
choice, a last chunk per choice with its `finish_reason`, with `stream_options.include_usage`
a final chunk with empty `choices` and the `usage`, then `data: [DONE]`. An error after the
stream started is sent in the stream as `data: {"error": {...}}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from xlserve.server.api.deps import AppState, app_state, owner_of
from xlserve.server.cache import CacheError
from xlserve.server.engine.types import Cancelled, ChoiceFinished, Finished, PromptLogprobs, SamplingParams, Submission, TokenEvent
from xlserve.server.api.errors import InvalidRequest, as_api_error

router = APIRouter()

MAX_CHOICES = 16  # largest n
MAX_STOPS = 4  # as OpenAI


class SamplingFields(BaseModel):
    """What a generation asks for; shared by /v1/completions and the websocket's `generate`."""

    model: str
    prompt: str | list[int] = ""
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    session_id: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="ignore")

    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None


def sampling_params(body: SamplingFields, echo: bool = False, n: int = 1) -> SamplingParams:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"at most {MAX_STOPS} stop strings", param="stop")
    return SamplingParams(
        max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed, stop=stops, logprobs=body.logprobs, echo=echo, n=n,
    )


def prompt_tokens(state: AppState, served, prompt: str | list[int]) -> list[int]:
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


def error_for(error: BaseException):
    """The APIError a client sees for anything a generation raised."""
    return as_api_error(InvalidRequest(str(error)) if isinstance(error, ValueError) else error)


async def acquire_lease(state: AppState, session_id: str, owner: str | None):
    """Take a session's lease (in the engine process, where the state may come back from disk
    or Redis). If the caller is cancelled meanwhile (client gone), the lease is released when it
    arrives, so it never stays pinned."""
    work = asyncio.ensure_future(state.engine.acquire(session_id, owner))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        work.add_done_callback(
            lambda done: done.cancelled() or done.exception() is not None or state.engine.release(done.result()))
        raise
    except CacheError as error:
        raise as_api_error(error) from None


class Generation:
    """One generation in flight (HTTP or websocket): validated parameters, the session lease.
    `await start()` takes the lease, `await submit()` queues the generation in the engine
    process, `commit()` / `release()` end the lease."""

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
        self.lease = None

    async def start(self) -> "Generation":
        """Take the session's lease (its state may come back from host RAM, disk or Redis)."""
        body, state = self.body, self.state
        if body.session_id:
            self.lease = await acquire_lease(state, body.session_id, self.owner)
            if self.lease.info.model != body.model:
                self.release()
                raise InvalidRequest(f"session '{body.session_id}' belongs to model '{self.lease.info.model}'",
                                     param="model")
        has_history = self.lease is not None and self.lease.has_history
        if not self.tokens and not has_history and (body.max_tokens > 0 or self.echo):
            self.release()
            raise InvalidRequest("prompt is empty and there is no session history to continue", param="prompt")
        return self

    async def submit(self) -> Submission:
        try:
            return await self.state.engine.submit(self.served.name, self.tokens, dataclasses.asdict(self.params),
                                                  self.lease)
        except BaseException as error:
            self.release()
            self.count_error(error)
            raise

    def count_error(self, error: BaseException) -> None:
        """Outcomes: xlserve_requests_total by finish reason (the engine counts stop, length and
        cancelled), xlserve_request_errors_total by error type (here)."""
        if not isinstance(error, (Cancelled, asyncio.CancelledError)):
            self.state.metrics.request_errors.labels(self.body.model, error_for(error).type).inc()

    def release(self) -> None:
        if self.lease is not None:
            self.state.engine.release(self.lease)

    async def commit(self, finished: Finished):
        """Make the request's effect on its session permanent (durable when this returns);
        returns the session's info, or None without a session. On a cache error nothing changed."""
        self.state.metrics.memory_reused_tokens.labels(self.body.model).inc(finished.cached_tokens)
        if self.lease is None:
            return None
        try:
            info = await self.state.engine.commit(self.lease)
        except CacheError as error:
            self.release()
            raise as_api_error(error) from None
        self.state.metrics.state_bytes_per_session.labels(self.body.model).observe(info.state_bytes)
        return info

    @staticmethod
    def usage(finished: Finished) -> dict:
        return {
            "prompt_tokens": finished.prompt_tokens,
            "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
        }


class _Choice:
    """The pieces of one choice's answer (text, OpenAI-style logprobs)."""

    def __init__(self, index: int, want_logprobs: bool):
        self.index = index
        self.text: list[str] = []
        self.want_logprobs = want_logprobs
        self.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.text_length = 0
        self.finish_reason: str | None = None

    def add(self, name, tokens, logprobs, tops, pieces) -> dict | None:
        """Record text pieces (one per token) and their logprobs; returns this piece's logprobs."""
        self.text.extend(pieces)
        if not self.want_logprobs:
            self.text_length += sum(len(t) for t in pieces)
            return None
        piece = {
            "tokens": [name(t) for t in tokens],
            "token_logprobs": list(logprobs),
            "top_logprobs": [None if lp is None else {name(t): v for t, v in top} for top, lp in zip(tops, logprobs)],
            "text_offset": [],
        }
        for text in pieces:
            piece["text_offset"].append(self.text_length)
            self.text_length += len(text)
        for key in self.logprobs:
            self.logprobs[key].extend(piece[key])
        return piece


class _Completion(Generation):
    def __init__(self, state: AppState, body: CompletionRequest, owner: str | None):
        super().__init__(state, body, owner, echo=body.echo, n=body.n)
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.choices = [_Choice(i, body.logprobs is not None) for i in range(body.n)]
        self.name = self.served.tokenizer.token_text

    def echo_text(self) -> str:
        return self.served.tokenizer.decode(self.tokens)

    def echo_pieces(self, event: PromptLogprobs) -> list[str]:
        detokenizer = self.served.tokenizer.detokenizer()
        pieces = [detokenizer.push(t) for t in event.tokens]
        pieces[-1] += detokenizer.flush()
        return pieces

    def envelope(self, choices: list[dict], **extra) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.body.model,
                "choices": choices, **extra}
        if self.lease is not None:
            body["session_id"] = self.lease.session_id
        return body


async def _watch_disconnect(request: Request, submission: Submission) -> None:
    """Cancel a non-streamed generation whose client went away (nothing is committed)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            submission.cancel()
            return


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    call = await _Completion(state, body, owner).start()
    submission = await call.submit()  # 429 / 503 here, before any response has started
    if body.stream:
        return EventStream(_stream(call, submission), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_watch_disconnect(request, submission))
    finished = None
    try:
        if body.echo and body.logprobs is None:
            for choice in call.choices:
                choice.text.append(call.echo_text())
        async for event in submission.events():
            if isinstance(event, TokenEvent):
                call.choices[event.index].add(call.name, [event.token], [event.logprob], [event.top], [event.text])
            elif isinstance(event, ChoiceFinished):
                call.choices[event.index].text.append(event.text_tail)
                call.choices[event.index].finish_reason = event.finish_reason
            elif isinstance(event, PromptLogprobs):
                pieces = call.echo_pieces(event)
                for choice in call.choices:
                    choice.add(call.name, event.tokens, event.logprobs, event.top, pieces)
            elif isinstance(event, Finished):
                finished = event
        watcher.cancel()
        await call.commit(finished)
    except BaseException as error:
        call.release()
        call.count_error(error)
        if isinstance(error, ValueError):
            raise InvalidRequest(str(error)) from None
        raise
    finally:
        watcher.cancel()
    choices = [{"text": "".join(c.text), "index": c.index, "finish_reason": c.finish_reason,
                "logprobs": c.logprobs if body.logprobs is not None else None} for c in call.choices]
    return call.envelope(choices, usage=call.usage(finished))


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


async def _stream(call: _Completion, submission: Submission):
    """SSE chunks as OpenAI sends them; an error after the stream started is sent in-band.
    Chunks that are ready together (the client or the loop fell behind) go out in one write."""
    options = call.body.stream_options
    extra = {"usage": None} if options and options.include_usage else {}
    # a text-only chunk is the same JSON every time but for its text: format it from a template
    templates = [json.dumps(call.envelope([{"text": "\x00", "index": i, "logprobs": None, "finish_reason": None}],
                                          **extra)).split('"\\u0000"') for i in range(len(call.choices))]

    def chunk(index: int, text: str, logprobs=None, finish_reason=None) -> bytes:
        if logprobs is None and finish_reason is None:
            head, tail = templates[index]
            return f"data: {head}{json.dumps(text)}{tail}\n\n".encode()
        return sse(call.envelope([{"text": text, "index": index, "logprobs": logprobs,
                                   "finish_reason": finish_reason}], **extra))

    out: list[bytes] = []
    try:
        if call.body.echo and call.body.logprobs is None and call.tokens:
            for choice in call.choices:
                out.append(chunk(choice.index, call.echo_text()))
        async for event in submission.events():
            if isinstance(event, TokenEvent):
                logprobs = call.choices[event.index].add(call.name, [event.token], [event.logprob], [event.top],
                                                         [event.text])
                if event.text or logprobs:
                    out.append(chunk(event.index, event.text, logprobs))
            elif isinstance(event, ChoiceFinished):
                out.append(chunk(event.index, event.text_tail, None, event.finish_reason))
            elif isinstance(event, PromptLogprobs):
                pieces = call.echo_pieces(event)
                for choice in call.choices:
                    logprobs = choice.add(call.name, event.tokens, event.logprobs, event.top, pieces)
                    out.append(chunk(choice.index, "".join(pieces), logprobs))
            elif isinstance(event, Finished):
                await call.commit(event)
                if extra:
                    out.append(sse(call.envelope([], usage=call.usage(event))))
            if out and submission.queue.empty():
                yield b"".join(out)
                out = []
        out.append(sse("[DONE]"))
        yield b"".join(out)
    except Exception as error:
        call.release()
        call.count_error(error)
        yield b"".join(out) + sse(error_for(error).body()) + sse("[DONE]")
    finally:
        call.release()  # a no-op after a commit; on disconnect the session stays as it was
