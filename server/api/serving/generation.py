"""One generation, validated and leased (`Generation`), and several prompts in one request
(OpenAI's batched `prompt`: `PromptBatch`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from xlserve.server.api.deps import AppState
from xlserve.server.api.errors import InvalidRequest, RequestTooLarge, count_error
from xlserve.server.api.protocol import (
    MAX_ECHO_LOGPROBS,
    MAX_ECHOED_TOKENS,
    MAX_GENERATED_LOGPROBS,
    CompletionRequest,
    SamplingFields,
)
from xlserve.server.api.structured import requested_constraint
from xlserve.server.cache.errors import SessionInfo
from xlserve.server.cache.prefix_keys import scope_key
from xlserve.server.engine.client import RemoteLease
from xlserve.server.engine.types import (
    MAX_UNREAD_LOGPROBS,
    Cancelled,
    ChoiceFinished,
    Finished,
    PromptLogprobs,
    SamplingParams,
    Submission,
    TokenEvent,
)
from xlserve.server.api.serving.leases import session_lease
from xlserve.server.api.serving.requests import (
    check_idempotency_key,
    check_logit_bias,
    error_for,
    idempotency,
    prompt_tokens,
    sampling_params,
)


# -- generations ----------------------------------------------------------------------------------


def check_the_batch_fits(engine_settings, prompts: int, n: int, keyed: bool) -> None:
    """A list of prompts is queued one engine request per prompt (PromptBatch), each n rows wide,
    and its own first prompts count against the queue's limits while its last ones wait. One that
    could not be queued even on an idle server (the prompts past those the batch's rows take at
    once, over XLSERVE_MAX_QUEUED_REQUESTS, or XLSERVE_MAX_QUEUED_PER_KEY for a keyed request) is a
    400 naming the limits: a 429, as for a queue full of other requests, would be retried forever."""
    rows, width = engine_settings.max_batch_size, min(n, engine_settings.max_batch_size)
    running = min(prompts, rows // width)  # the prompts an idle server runs at once
    limits = [(engine_settings.max_queued_requests, "XLSERVE_MAX_QUEUED_REQUESTS")]
    if keyed and engine_settings.max_queued_per_key:
        limits.append((engine_settings.max_queued_per_key, "XLSERVE_MAX_QUEUED_PER_KEY"))
    for limit, setting in limits:
        if prompts - running > limit:
            most = running + limit
            raise InvalidRequest(
                f"{prompts} prompts with n={n} are {prompts} requests of {width} rows each; this server decodes "
                f"{rows} rows at once (XLSERVE_MAX_BATCH_SIZE) and queues at most {limit} requests beyond them "
                f"({setting}), so at most {most} such prompts can be taken in one request: send fewer prompts "
                "per request", param="prompt", code="too_many_prompts")


class Generation:
    """One generation (HTTP or websocket), validated: the served model, sampling parameters and
    prompt tokens. `async with leased()` holds its session; within it, `submit()` queues it in the
    engine process and `commit()` makes its effect on the session permanent."""

    def __init__(self, state: AppState, body: SamplingFields, owner: str | None, echo: bool = False, n: int = 1,
                 idempotency_key: str | None = None, kind: str = "generate", field_names: dict[str, str] | None = None):
        self.arrived_at = time.monotonic()  # its latencies count its tokenizing and the wait for its session
        self.state, self.body, self.owner, self.echo = state, body, owner, echo
        # the names the client sent fields under where they are not `body`'s own, so that an error
        # names a field the client sent: a chat request's prompt is its `messages`, rendered
        self.field_names = field_names or {}
        self.served = state.served(body.model)
        self.params = sampling_params(body, echo, n)
        limit = state.settings.server.max_tokens_limit
        if body.max_tokens > limit:
            max_tokens_name = self.field_name("max_tokens")
            raise InvalidRequest(f"{max_tokens_name} is {body.max_tokens}; the limit is {limit} "
                                 "(XLSERVE_MAX_TOKENS_LIMIT)", param=max_tokens_name)
        if n > 1 and body.session_id is not None:
            raise InvalidRequest("n > 1 cannot be combined with session_id: a session keeps one continuation",
                                 param="n")
        check_logit_bias(self.params, self.served)
        # structured output: compiled and enforced per row in the engine (400 there for a bad schema)
        self.set_constraint(requested_constraint(body, state.settings.engine.structured_max_bytes))
        # OpenAI's batched form (completions only): several prompts (at most MAX_PROMPTS, protocol.py),
        # each run with n choices
        batch = body.prompts() if isinstance(body, CompletionRequest) else None
        if batch is not None:
            if body.session_id is not None:
                raise InvalidRequest("a list of prompts cannot be combined with session_id: a session continues "
                                     "one text", param="prompt")
            check_the_batch_fits(state.settings.engine, len(batch), n, keyed=owner is not None)
        raw_prompts = batch or [body.prompt]
        # an answer that is not streamed holds every generated token's log-probabilities until it is
        # sent whole, built as Python objects and written as one JSON text on the event loop, which
        # every other request waits for meanwhile. A stream sends each token's as it comes and keeps
        # none of them (completions.py `_completion_chunks`; the websocket's `token` frames). It needs
        # only the number of prompts: checked before up to MAX_PROMPTS of them are tokenized
        if self.params.logprobs is not None and isinstance(body, CompletionRequest) and not body.stream:
            generated = len(raw_prompts) * n * body.max_tokens * (self.params.logprobs + 1)
            if generated > MAX_GENERATED_LOGPROBS:
                logprobs_name, max_tokens_name = self.field_name("logprobs"), self.field_name("max_tokens")
                raise InvalidRequest(
                    f"{len(raw_prompts)} prompt(s) x n={n} x {max_tokens_name}={body.max_tokens} tokens with "
                    f"{logprobs_name}={self.params.logprobs} return up to {generated:,} log-probabilities; the limit "
                    f"for an answer that is not streamed is {MAX_GENERATED_LOGPROBS:,} (fewer {logprobs_name}, "
                    f"choices, prompts or {max_tokens_name}, which a request that sets none gets at the server's "
                    "limit, XLSERVE_MAX_TOKENS_LIMIT; or stream the answer)", param=logprobs_name,
                    code="generated_logprobs_too_large")
        self.prompts = [prompt_tokens(state, self.served, prompt, param=self.field_name("prompt"))
                        for prompt in raw_prompts]
        self.tokens = self.prompts[0]
        if echo and n * sum(map(len, self.prompts)) > MAX_ECHOED_TOKENS:
            raise InvalidRequest(
                f"echo with n={n} over {sum(map(len, self.prompts)):,} prompt tokens returns "
                f"{n * sum(map(len, self.prompts)):,} tokens of text; the limit is {MAX_ECHOED_TOKENS:,} (fewer choices "
                "or prompt tokens, or no echo)", param="echo", code="echo_too_large")
        if echo and self.params.logprobs is not None:
            echoed = n * sum(map(len, self.prompts)) * (self.params.logprobs + 1)
            if echoed > MAX_ECHO_LOGPROBS:
                raise InvalidRequest(
                    f"echo with logprobs={self.params.logprobs} and n={n} over {sum(map(len, self.prompts))} prompt "
                    f"tokens returns {echoed:,} log-probabilities; the limit is {MAX_ECHO_LOGPROBS:,} (fewer "
                    "logprobs, choices or prompt tokens, or no echo)", param="logprobs", code="echo_logprobs_too_large")
        self.lease: RemoteLease | None = None
        # a key only means something for a request that changes a session; a malformed one is
        # refused all the same, so a client learns of it before it relies on one
        if idempotency_key is not None:
            check_idempotency_key(idempotency_key)
        request = {**body.model_dump(include=set(SamplingFields.model_fields)), "echo": echo, "n": n}
        self.key = idempotency(idempotency_key, kind, request) if body.session_id is not None else None

    def field_name(self, name: str) -> str:
        """The name the client sent `body`'s field `name` under (an error's param and message)."""
        return self.field_names.get(name, name)

    def set_constraint(self, constraint: tuple[str, str, str] | None) -> None:
        """The engine's (kind, text) of what the output must match, and the field it came from."""
        kind, text, param = constraint if constraint is not None else (None, None, None)
        self.params.constraint_kind, self.params.constraint, self.params.constraint_param = kind, text, param

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
                raise InvalidRequest("prompt is empty and there is no session history to continue",
                                     param=self.field_name("prompt"))
            yield self

    async def submit(self) -> Submission:
        """Queue the generation; raises QueueFull / ShuttingDown / ValueError before anything started
        (answered, and counted, as an HTTP error or a websocket error frame)."""
        if len(self.prompts) > 1:
            submission = await PromptBatch.submit(self.state, self.served.name, self.prompts, self.params,
                                                  self.prefix_scope(), self.owner)
        else:
            submission = await self.state.engine.submit(self.served.name, self.tokens, self.params,
                                                        self.lease, self.prefix_scope(), self.owner)
        submission.arrived(self.arrived_at)
        return submission

    def prefix_scope(self) -> bytes | None:
        """Where a request without a session files and finds cached prefix states: its model, its
        API key's owner id and its cache_salt; None for a session's request or one that opts out."""
        if self.lease is not None or self.body.session_id is not None or not self.body.prefix_cache:
            return None
        return scope_key(self.served.name, self.owner, self.body.cache_salt)

    def count_error(self, error: BaseException) -> None:
        """Count an error sent inside a stream that has started (an SSE error event). Outcomes:
        xlserve_requests_total by finish reason (the engine counts stop, length and cancelled),
        xlserve_request_errors_total by error type (server/api/errors.py's count_error, where
        each error is answered: an HTTP error status, a websocket error frame, or here)."""
        if not isinstance(error, (Cancelled, asyncio.CancelledError)):
            count_error(self.state, error_for(error), self.body.model)

    async def commit(self, finished: Finished, result: dict | None = None) -> SessionInfo | None:
        """Make the generation's effect on its session permanent (durable when this returns);
        returns the session's info, or None without a session. On a cache error nothing changed.
        `result`, the answer, is remembered with the request's Idempotency-Key."""
        if self.lease is None:  # a prefix hit's reuse: nothing to commit
            self.state.metrics.memory_reused_tokens.labels(self.body.model).inc(finished.cached_tokens)
            return None
        try:
            info = await self._commit(result)
        except BaseException as error:
            if not isinstance(error, (Cancelled, asyncio.CancelledError)):  # the engine counted it finished
                self.state.metrics.requests_not_committed.labels(self.body.model).inc()
            raise
        # counted once the commit landed: a refused commit (a conflict, a full cache) reused nothing
        self.state.metrics.memory_reused_tokens.labels(self.body.model).inc(finished.cached_tokens)
        self.state.metrics.state_bytes_per_session.labels(self.body.model).observe(info.state_bytes)
        return info

    async def _commit(self, result: dict | None) -> SessionInfo:
        if result is not None and self.lease.idempotency is not None:
            size = len(json.dumps(result, separators=(",", ":")))
            if size > REMEMBERED_ANSWER_BYTES:  # refused before the commit: the session is as it was
                raise RequestTooLarge(
                    f"the answer is {size} bytes as JSON, too large to remember under an Idempotency-Key (at most "
                    f"{REMEMBERED_ANSWER_BYTES}); nothing was committed: send it without the key, or ask for less "
                    "(echo, logprobs, max_tokens)", param="Idempotency-Key", code="remembered_answer_too_large")
        return await self.state.engine.commit(self.lease, result)


# The largest answer a session remembers under an Idempotency-Key, as JSON. It travels to the
# engine process in a frame's header and is kept in the session's metadata with up to 31 others
# (IDEMPOTENCY_KEYS_PER_SESSION), both bounded at 64 MB: an answer with echo and logprobs over a
# long prompt passes that (once it stopped the engine process for every session).
REMEMBERED_ANSWER_BYTES = 1 << 20


# -- several prompts in one request (OpenAI's batched `prompt`) -----------------------------------


@dataclasses.dataclass
class BatchedPromptLogprobs(PromptLogprobs):
    """PromptLogprobs of one prompt of a PromptBatch, saying which."""

    prompt: int = 0


# events of a batch of prompts merged and waiting for the consumer (PromptBatch.queue)
MERGED_EVENTS_WAITING = 1024


class PromptBatch:
    """The prompts of one batched completion, each run as its own engine request and seen as one
    submission: their events merged into one stream whose choice indexes are OpenAI's
    (prompt_index * n + choice_index), ending with one Finished that adds up their counts. A
    failure of any prompt fails the request (the others are dropped); a cancel cancels all."""

    def __init__(self, submissions: list[Submission], n: int):
        self.submissions, self.n = submissions, n
        # (prompt index, event or exception), bounded: a consumer that does not read (a stream's
        # client that stopped) holds the forwarders back, so what waits stays in each prompt's
        # submission, whose bound (a share of MAX_UNREAD_LOGPROBS each) stops the request
        self.queue: asyncio.Queue = asyncio.Queue(MERGED_EVENTS_WAITING)
        for submission in submissions:
            submission.unread_limit = MAX_UNREAD_LOGPROBS // len(submissions)
        self.forwarders = [asyncio.ensure_future(self._forward(prompt, submission))
                           for prompt, submission in enumerate(submissions)]

    @classmethod
    async def submit(cls, state: AppState, model: str, prompts: list[list[int]],
                     params: SamplingParams, prefix_scope: bytes | None = None,
                     owner: str | None = None) -> "PromptBatch":
        """Queue every prompt; if one is refused (QueueFull, ...), those queued already are dropped."""
        submissions: list[Submission] = []
        try:
            for tokens in prompts:
                submissions.append(await state.engine.submit(model, tokens, params, None,
                                                             prefix_scope, owner))
        except BaseException:
            for submission in submissions:
                submission.cancel()
            raise
        return cls(submissions, params.n)

    async def _forward(self, prompt: int, submission: Submission) -> None:
        try:
            async for event in submission.events():
                await self.queue.put((prompt, event))
        except Exception as error:  # Cancelled, or the prompt's failure: the merged stream raises it
            await self.queue.put((prompt, error))

    def cancel(self) -> None:
        for submission in self.submissions:
            submission.cancel()

    def arrived(self, at: float) -> None:
        for submission in self.submissions:
            submission.arrived(at)

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
            # and its engine request too: a forwarder cancelled before its first step never entered
            # its submission's events(), whose own cleanup would have stopped the request, which
            # would then run to its end for nobody (a no-op for a prompt that finished)
            self.cancel()
