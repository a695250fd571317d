"""Using an engine from asyncio code in the same process: tests, benchmarks, code that embeds the
engine (the server itself runs its engines in the engine process, server/engine/process.py).

`submit` queues an `EngineRequest` with a `Submission` as its handle and returns the Submission,
whose `events()` the caller iterates; `generate` and `append` wrap it for the two kinds of
request. Events reach a Submission through `SubmissionDelivery`, the sink to build such an
`Engine` with (`Engine(..., sink=SubmissionDelivery())`): the worker thread hands each step's
events to the event loop of each Submission.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from xlserve.server.engine.errors import InvalidInput
from xlserve.server.engine.request import EngineRequest
from xlserve.server.engine.types import Appended, SamplingParams, Submission, appended

if TYPE_CHECKING:
    from xlserve.server.cache.codec import SessionData
    from xlserve.server.engine.scheduler import Engine


def submit(engine: Engine, request: EngineRequest) -> Submission:
    """Queue `request`; its events go to the returned Submission, on the running event loop.
    Raises QueueFull, ShuttingDown or InvalidInput at once, before anything has started."""
    if request.kind == "generate" and request.params.max_tokens > 0 and not request.prompt \
            and request.start.next_log_probs is None:
        raise InvalidInput("nothing to continue from: give a prompt", param="prompt")
    submission = Submission(engine.name, engine.metrics, request.cancelled, engine.wake)
    request.handle = submission
    engine.enqueue(request)
    return submission


async def generate(engine: Engine, request: EngineRequest) -> AsyncIterator[object]:
    """Submit and iterate: yields PromptLogprobs?, (TokenEvent | ChoiceFinished)*, then
    Finished; raises on error. Leaving the iteration early cancels the request within one step."""
    events = submit(engine, request).events()
    try:
        async for event in events:
            yield event
    finally:
        await events.aclose()


async def append(engine: Engine, start: SessionData, tokens: list[int], score: bool = False,
                 cancelled: threading.Event | None = None) -> Appended:
    """Feed a document chunk into a session (batched with everything else): its `Appended` has
    the new data, the summed log-probability of the scored tokens and how many were scored."""
    request = EngineRequest("append", tokens, start, SamplingParams(max_tokens=0), score=score,
                            cancelled=cancelled or threading.Event())
    return await appended(submit(engine, request))


class SubmissionDelivery:
    """A sink that hands each step's (Submission, event) pairs to the Submissions' event loops.

    A loop is woken (a write to its self-pipe) only when it has nothing pending from us: while it
    is busy, events pile up and it takes them all in one go, so a loaded loop costs the worker
    thread no system calls."""

    def __init__(self):
        self.pending: dict[asyncio.AbstractEventLoop, list] = {}  # handed over, not yet delivered
        self.lock = threading.Lock()

    def __call__(self, items: list[tuple[Submission, object]]) -> None:  # the engine's worker thread
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for submission, event in items:
            by_loop.setdefault(submission.loop, []).append((submission, event))
        for loop, loop_items in by_loop.items():
            if loop.is_closed():  # nobody is listening; what a closed loop had pending goes too
                with self.lock:
                    self.pending.pop(loop, None)
                continue
            with self.lock:
                pending = self.pending.setdefault(loop, [])
                wake = not pending
                pending.extend(loop_items)
            if wake:
                try:
                    loop.call_soon_threadsafe(self._deliver, loop)
                except RuntimeError:  # that loop is closed: nobody is listening
                    with self.lock:
                        self.pending.pop(loop, None)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:  # on the event loop
        with self.lock:
            items = self.pending.pop(loop, [])
        for submission, event in items:
            submission.put(event)
