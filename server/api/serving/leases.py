"""A request's hold on its session: `session_lease`, the one place a lease is released, and
`queued()`, which runs a streamed answer up to the point where its request holds its session
and is queued in the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager

from xlserve.server.api.deps import AppState
from xlserve.server.engine.client import RemoteLease


# -- a request's hold on its session --------------------------------------------------------------

# how long a request that was cancelled while its session was being taken waits for the lease to
# let it go at once (beyond, it is let go whenever it arrives)
RELEASE_WAIT_SECONDS = 30.0


@asynccontextmanager
async def session_lease(state: AppState, session_id: str | None, owner: str | None,
                        key: dict | None = None) -> AsyncIterator[RemoteLease | None]:
    """Hold a session for the duration of the block (None without a session id). Taking it may
    bring the state back from host RAM, disk or Redis in the engine process. Leaving the block
    releases it: after a commit that changes nothing, otherwise the session stays as it was.
    With `key` (see `idempotency`) seen before on the session, the lease holds nothing and its
    `replay` is the first request's remembered answer."""
    if session_id is None:
        yield None
        return
    acquiring = asyncio.ensure_future(state.engine.acquire(session_id, owner, key))
    try:
        lease = await asyncio.shield(acquiring)
    except asyncio.CancelledError:
        # the caller is gone (a client that left, a websocket's cancel) but the lease is on its
        # way: it is let go once it arrives, so the session never stays pinned; waited for here
        # (at most RELEASE_WAIT_SECONDS), so that the answer to a cancel goes out after the
        # release, and the client's next request for the session is not refused 409 by this one
        try:
            lease = await asyncio.wait_for(asyncio.shield(acquiring), RELEASE_WAIT_SECONDS)
        except BaseException:  # noqa: BLE001 (its own failure, the wait's end, a second cancel)
            acquiring.add_done_callback(
                lambda done: done.cancelled() or done.exception() is not None or state.engine.release(done.result()))
        else:
            state.engine.release(lease)
        raise
    try:
        yield lease
    except Exception as error:
        # what fails once the session is held is counted under its model (api/errors.py
        # `count_error`): a session route's request names none, and its errors fell out of the
        # per-model error ratio and its alert
        if getattr(error, "session_model", None) is None:
            try:
                error.session_model = lease.info.model
            except AttributeError:  # an exception class that takes no attributes
                pass
        raise
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
