"""A client's wish to stop its request, and the one rule that decides between a stop and a commit.

A request that changes a session (an append, a session generation) ends in one of two ways:
its effect is committed, or nothing changes. A cancel (the websocket's `cancel` frame) or a
disconnect (the client closed its connection, streamed or not) can come at any moment, and the
two must never both win: a request the client stopped leaves its session as it was, and a
request whose commit has begun is committed whatever comes after.

`Cancellation` is that rule. The request `track`s its engine submission (a cancel reaches the
engine, which drops the request at its next step: between two prefill chunks, or two decode
steps), and calls `begin_commit` just before it commits: a cancel that came first raises
Cancelled there (nothing is committed, the client is gone or asked for it); once the commit has
begun, a cancel does nothing (the client that left can learn the outcome from the session's
version, or by retrying with its Idempotency-Key).

`cancel_on_disconnect` watches a plain (not streamed) HTTP request's connection while it runs
and cancels when the client hangs up. A streamed answer notices a disconnect through its
response (completions.EventStream), a websocket through its receive loop (routers/ws.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Request

from xlserve.server.engine.types import Cancelled, Submission


class Cancellation:
    """A client's wish to stop its request, which may come before the request reaches the engine
    (`requested` is checked before it queues), while it runs in the engine (its tracked
    submissions are cancelled), or after it finished there but before its commit (`begin_commit`
    raises Cancelled). After `begin_commit` returned, a cancel changes nothing."""

    def __init__(self):
        self.requested = False
        self.committing = False
        self.submissions: list[Submission] = []

    def cancel(self) -> None:
        if self.committing:  # the commit won: the request's effect is made permanent
            return
        self.requested = True
        for submission in self.submissions:
            submission.cancel()

    def track(self, submission: Submission) -> Submission:
        """Cancel `submission` with the request (at once, when a cancel came while it queued)."""
        self.submissions.append(submission)
        if self.requested:
            submission.cancel()
        return submission

    def check(self) -> None:
        """Raise Cancelled when a cancel came (before work that a stopped request must not start)."""
        if self.requested:
            raise Cancelled()

    def begin_commit(self) -> None:
        """The request is about to commit: a cancel that came first wins (Cancelled, nothing is
        committed); from here on the commit does."""
        self.check()
        self.committing = True


async def disconnected(request: Request) -> None:
    """Return when the client of this HTTP request hangs up (its body has been read: what the
    connection says next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _watch(request: Request, cancellation: Cancellation) -> None:
    await disconnected(request)
    cancellation.cancel()


@asynccontextmanager
async def cancel_on_disconnect(request: Request, cancellation: Cancellation) -> AsyncIterator[Cancellation]:
    """Cancel `cancellation` when the client of this plain HTTP request hangs up during the
    block (its body has been read: what the connection says next is the disconnect)."""
    watcher = asyncio.create_task(_watch(request, cancellation))
    try:
        yield cancellation
    finally:
        watcher.cancel()
