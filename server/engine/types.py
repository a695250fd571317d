"""The engine's vocabulary, free of torch (used in both processes): what a request asks for
(`SamplingParams`), the events its consumer receives, and the consumer's side of a request
(`Submission`).

The engine (server/engine/scheduler.py) and the engine process use them with torch around them;
the API process, which never holds a model, uses them without importing torch at all.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from xlserve.server.engine.errors import Cancelled, StreamNotRead

# The most log-probabilities (a token's own and its alternatives', one for any other event) a
# request's consumer may leave unread in its queue. The engine does not wait for a stream's
# client: one that stops reading (its socket full, its chunks waiting) would otherwise have every
# event the engine makes for it held here. As many as an answer that is not streamed may return
# (server/api/protocol.py MAX_GENERATED_LOGPROBS, the same number); past it the request stops
# with StreamNotRead
MAX_UNREAD_LOGPROBS = 1_000_000
# ... and every request of this process together (about 230 bytes a token event: 460 MB): past
# it, the stream that leaves the most unread stops (StreamNotRead), so that clients that each read
# just fast enough to stay under their own bound cannot pin the process's memory between them.
# Counted over the live submissions when one's own unread has grown by UNREAD_CHECK_STEP since
# its last count, so that the many streams that keep up cost nothing
MAX_UNREAD_IN_PROCESS = 2 * MAX_UNREAD_LOGPROBS
UNREAD_CHECK_STEP = 10_000
_LIVE: "weakref.WeakSet[Submission]" = weakref.WeakSet()


def _weight(event: object) -> int:
    return 1 + len(event.top) if isinstance(event, TokenEvent) else 1


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no limit
    min_p: float = 0.0  # drop tokens less likely than min_p * the most likely one's probability
    repetition_penalty: float = 1.0  # 1 = off; multiplies log-probs of tokens seen in prompt or output
    presence_penalty: float = 0.0  # subtracted once from tokens generated at least once
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated text
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None = none; k = the chosen token's and the k most likely
    echo: bool = False
    n: int = 1  # independent choices sharing one prompt (prefilled once)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (as OpenAI)
    ignore_eos: bool = False  # go on past the model's end-of-text token (vLLM's name), emitted as a token
    # structured output (server/engine/constraints.py): what the output must match, the request
    # field it came from (named by a refusal), e.g. ("json_schema", '{"type": ...}', "response_format")
    constraint_kind: str | None = None
    constraint: str | None = None
    constraint_param: str | None = None

    def __post_init__(self):
        # JSON (the wire, server/engine/process.py) turns the token ids into strings: back to ints
        if self.logit_bias is not None:
            self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0



# -- events a request's consumer receives ---------------------------------------------------


@dataclass
class PromptLogprobs:
    """Log-probabilities of the prompt's own tokens (for echo + logprobs)."""

    tokens: list[int]
    logprobs: list[float | None]  # None for a first token that had no context
    top: list[list[tuple[int, float]]]


@dataclass
class TokenEvent:
    token: int
    text: str  # text released by this token ("" while a character or stop string is incomplete)
    logprob: float  # the model's log-probability of the token (before any sampling transform)
    top: list[tuple[int, float]]
    index: int = 0  # which choice (n > 1)
    # characters this token added to the decoded text, whether released now or held back for a
    # stop string (`text` may be "" while this is not): what completions' text_offset counts.
    # None: as many as `text` has
    width: int | None = None


@dataclass
class ChoiceFinished:
    index: int
    finish_reason: str  # "length", "stop", or "no_allowed_token" (server/engine/constraints.py)
    text_tail: str  # text held back until the end of the stream
    completion_tokens: int


@dataclass
class Finished:
    """The last event of a request; `choices` are in index order."""

    choices: list[ChoiceFinished]
    prompt_tokens: int
    completion_tokens: int  # all choices together
    cached_tokens: int  # context that came from the session's memory
    data: object  # SessionData: the session as it stands after this request (choice 0); None in the API process

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason if self.choices else "length"

    @property
    def text_tail(self) -> str:
        return self.choices[0].text_tail if self.choices else ""


@dataclass
class Appended:
    """The result of feeding a document chunk into a session (an "append" request)."""

    data: object  # SessionData; None in the API process
    logprob: float  # summed natural-log probability of the scored tokens
    scored: int  # how many were scored (a first token with no context is not)



class Submission:
    """The consumer's side of a request: an event queue filled by an engine in this process
    (server/engine/local.py) or, for an engine in the engine process, by the reader of
    server/engine/client.py (`RemoteSubmission`)."""

    def __init__(self, name: str, metrics, cancelled: threading.Event, wake=None):
        self.name, self.metrics = name, metrics  # the model, and where its latencies are recorded
        self.cancelled = cancelled
        self.wake = wake  # tells the in-process engine to look at its requests now
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        # when the request arrived: its submission, or earlier (`arrived`): the API process counts the wait
        # for the request's session, a restore from disk or Redis, in its time to first token and latency
        self.arrived_at = time.monotonic()
        # what the events in `queue` weigh (`_weight`), and the most they may (a batch of prompts
        # shares MAX_UNREAD_LOGPROBS out among its requests, server/api/serving/generation.py)
        self.unread, self.unread_limit = 0, MAX_UNREAD_LOGPROBS
        self.overrun = False  # stopped for leaving too much unread: later events are dropped
        self._counted_at = 0  # its unread when the process's last was counted (`_check_process`)
        _LIVE.add(self)

    def arrived(self, at: float) -> None:
        """Count the request's time to first token and latency from `at` (time.monotonic()), when
        its HTTP request or websocket frame was read, if that was before its submission."""
        self.arrived_at = min(self.arrived_at, at)

    def put(self, event: object) -> None:
        """Hand the consumer an event (on its event loop). Past `unread_limit` unread, the request
        stops: the engine drops it, what waits is let go, and the consumer's next event is
        StreamNotRead."""
        if self.overrun:
            return
        self.unread += _weight(event)
        if self.unread > self.unread_limit:
            self._overrun(f"the client left more than {self.unread_limit:,} log-probabilities of this stream unread")
            return
        self.queue.put_nowait(event)
        if self.unread - self._counted_at >= UNREAD_CHECK_STEP:
            self._check_process()

    def _check_process(self) -> None:
        """Past MAX_UNREAD_IN_PROCESS unread in every live submission together, stop the one
        that leaves the most (perhaps this one)."""
        self._counted_at = self.unread
        live = [submission for submission in _LIVE if not submission.overrun]
        if sum(submission.unread for submission in live) > MAX_UNREAD_IN_PROCESS:
            largest = max(live, key=lambda submission: submission.unread)
            largest._overrun(f"the streams of this server left more than {MAX_UNREAD_IN_PROCESS:,} log-probabilities "
                             f"unread together, this one the most ({largest.unread:,})")

    def _overrun(self, why: str) -> None:
        """Stop the request for leaving too much unread: what waits is let go, and the consumer's
        next event is StreamNotRead."""
        self.overrun = True
        self._stop()
        while not self.queue.empty():
            self.queue.get_nowait()
        error = StreamNotRead(f"{why} (its chunks waiting for its socket): the request was stopped and nothing was "
                              "committed", code="stream_not_read")
        self.unread = _weight(error)
        self.queue.put_nowait(error)

    def cancel(self) -> None:
        """Stop the request: the engine drops it at its next step; `events()` raises Cancelled
        at once. Nothing is committed."""
        if not self.cancelled.is_set():
            self._stop()
            self.put(Cancelled())

    def _stop(self) -> None:
        """Tell the engine to drop the request (a no-op for one that has finished)."""
        self.cancelled.set()
        self.wake()

    async def events(self) -> AsyncIterator[object]:
        name, metrics = self.name, self.metrics
        inter_token = metrics.inter_token_latency.labels(name)  # looked up once: observed at every token
        first_token_at, last_token_at = None, {}
        try:
            while True:
                event = await self.queue.get()
                self.unread -= _weight(event)
                self._counted_at = min(self._counted_at, self.unread)
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, TokenEvent):
                    now = time.monotonic()
                    if first_token_at is None:
                        first_token_at = now
                        metrics.time_to_first_token.labels(name).observe(now - self.arrived_at)
                    previous = last_token_at.get(event.index)
                    if previous is not None:
                        inter_token.observe(now - previous)
                    last_token_at[event.index] = now
                if isinstance(event, (Finished, Appended)):
                    # before the yield: a consumer that stops at its last event (`appended`) closes
                    # this generator there, and a stream commits before it asks for more
                    metrics.e2e_latency.labels(name).observe(time.monotonic() - self.arrived_at)
                    yield event
                    return
                yield event
        finally:
            self._stop()  # no-op when finished; the engine drops the request when the consumer left


async def appended(submission: Submission) -> Appended:
    """Wait for an append (in process or in the engine process) and return its `Appended`
    event. Raises Cancelled if it was cancelled, or what the append raised."""
    events = submission.events()
    try:
        async for event in events:
            if isinstance(event, Appended):
                return event
    finally:
        await events.aclose()
    raise Cancelled()
