"""Websocket /v1/stream: generation and document feeding over one long-lived connection.

The protocol (JSON text frames, one request at a time per connection) is documented in
docs/websocket.md. In short: the client sends `generate`, `append` or `cancel`; the server
answers a request with `token` frames and one `done` frame, or with an `error` frame. A frame
the server cannot use gets an `error` frame and the connection stays open. Closing the
connection cancels the request in flight within one engine step; its session stays as it was.

This router keeps the connection: it reads frames, runs one request at a time and sends what
serving answers. What a request does, and the frames of its answer, are server/api/serving/'s.
"""

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing

import anyio
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from xlserve.server.api.protocol import CancelFrame, GenerateFrame, frame_id, parse_frame
from xlserve.server.api.serving import (
    SESSION_ID_HEADER,
    WEBSOCKET_SUBPROTOCOL,
    APIError,
    AppState,
    Cancellation,
    Conflict,
    app_state,
    append_frames,
    cancelled_generation_frame,
    check_session_header,
    cross_origin_error,
    error_frame,
    generation_frames,
    offered_subprotocols,
    owner_of,
    refuse_unknown_query_parameters,
)

router = APIRouter()
log = logging.getLogger("xlserve.server")


class _RunningRequest:
    """The request running on a connection."""

    def __init__(self, request_id: str | None, model: str | None = None, session_id: str | None = None):
        self.id = request_id
        self.model = model  # the model a generate frame named (errors are counted under it)
        self.session_id = session_id
        self.cancellation = Cancellation()
        self.task: asyncio.Task | None = None
        self.frames: AsyncGenerator | None = None  # its answer, which may hold its session until closed
        self.answering_the_cancel: asyncio.Task | None = None  # a cancel frame that came while it queued


class _Connection:
    """One client's connection: reads its frames, runs one request at a time, sends the answers."""

    def __init__(self, websocket: WebSocket, state: AppState, owner: str | None):
        self.websocket, self.state, self.owner = websocket, state, owner
        # a connection routed by X-Session-Id (deploy/nginx/) serves that session's frames only
        self.session_header = websocket.headers.get(SESSION_ID_HEADER.lower())
        self.send_lock = asyncio.Lock()
        self.current: _RunningRequest | None = None
        # the client took no write for XLSERVE_STREAM_SEND_TIMEOUT_SECONDS: it counts as gone
        # (nothing more is sent; what runs is cancelled, its session let go) although its
        # connection is open, and the receive loop ends it when it reads or closes
        self.stalled = False

    async def send(self, frame: dict) -> None:
        """Send a frame; a connection that is gone is noticed by the receive loop, which cancels.
        A client that stops reading fills its socket and the write waits: past the send timeout
        the connection is stalled and its running request cancelled."""
        timeout = self.state.settings.server.stream_send_timeout_seconds
        async with self.send_lock:
            if self.stalled:
                return
            try:
                with anyio.fail_after(timeout):
                    await self.websocket.send_text(json.dumps(frame))
            except TimeoutError:  # first: TimeoutError is an OSError
                self.stalled = True
                log.warning("websocket: the client took no write for %gs (XLSERVE_STREAM_SEND_TIMEOUT_SECONDS): "
                            "its running request is cancelled and nothing more is sent", timeout)
                if self.current is not None:
                    self.current.cancellation.cancel()
            except (WebSocketDisconnect, RuntimeError, OSError):
                pass

    async def run(self) -> None:
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect" or self.stalled:  # stalled: answers were lost
                    return
                await self.handle(message.get("text"))  # None: a binary frame
        finally:  # the client left (or the server is stopping): cancel what runs, nothing is committed
            running = self.current
            if running is not None:
                running.cancellation.cancel()
                try:
                    if running.task is not None:
                        running.task.cancel()
                        await asyncio.gather(running.task, return_exceptions=True)
                finally:
                    # a task cancelled before its first step (the client's close was already queued
                    # behind its request) never entered `_answer`, whose own cleanup would have let
                    # the request go and closed its frames: without this, the request would count
                    # as in flight forever (shutdown's drain would wait out its whole grace period)
                    # and a generation's frames would hold its session until garbage collected.
                    # Both steps do nothing when `_answer` did them already; a task still running
                    # (this loop was cancelled while waiting for it) closes its frames itself.
                    self._finished_with(running)
                    if running.frames is not None and (running.task is None or running.task.done()):
                        try:
                            await running.frames.aclose()
                        except Exception:  # noqa: BLE001 (the client is gone: nobody to answer)
                            log.exception("websocket: closing a request's answer after its client left failed")

    async def handle(self, text: str | None) -> None:
        request_id = frame = None
        try:
            max_bytes = self.state.settings.server.max_request_body_bytes
            try:
                frame = parse_frame(text, max_bytes=max_bytes)
            except Exception:
                request_id = frame_id(text, max_bytes)  # read apart only for a refused frame's answer
                raise
            request_id = frame.id
            if isinstance(frame, CancelFrame):
                running = self.current
                if running is None or (frame.id is not None and frame.id != running.id):
                    raise Conflict("nothing to cancel: no request with that id is running", code="nothing_to_cancel")
                running.cancellation.cancel()
                if running.frames is None and running.task is not None and not running.task.done():
                    # a generate still being queued (a constraint's first compile, a prefix lookup)
                    # stops waiting there, as on a close, and is answered at once. Cancelled in
                    # this turn of the loop, while it is known to wait inside the queuing: a task
                    # that got as far as its answer is stopped by the cancel above, as any other.
                    running.task.cancel()
                    running.answering_the_cancel = asyncio.create_task(self._answer_cancelled_queuing(running))
                return
            if self.current is not None:
                if frame.id is not None and frame.id == self.current.id:
                    # its error frame, under the running request's id, would read as that request's end
                    request_id = None
                raise Conflict(f"request {self.current.id!r} is still running; send one request at a time "
                               "(or cancel it first)", code="request_in_progress")
            check_session_header(self.session_header, frame.session_id)
            request = _RunningRequest(frame.id, getattr(frame, "model", None), frame.session_id)
            self.current = request
            self.state.inflight += 1
            if isinstance(frame, GenerateFrame):
                # queued in its own task, as it is answered: queuing can take seconds (a constraint's
                # first compile, a prefix lookup in Redis), and meanwhile this loop goes on reading,
                # so that a close cancels it there (the engine is told) and a `cancel` is taken
                request.task = asyncio.create_task(self._queue_then_answer(request, frame))
            else:
                request.frames = append_frames(self.state, frame, self.owner, request.cancellation)
                request.task = asyncio.create_task(self._answer(request, request.frames))
        except Exception as error:  # refused before it started: an error frame, the connection stays
            await self.send(error_frame(request_id, error, self.state, getattr(frame, "model", None)))

    async def _queue_then_answer(self, request: _RunningRequest, frame: GenerateFrame) -> None:
        """Validate a generate, hold its session and queue it (a refusal is its error frame, and
        the connection takes its next request), then answer it."""
        try:
            frames = await generation_frames(self.state, frame, self.owner, request.cancellation)
        except Exception as error:
            self._finished_with(request)
            await self.send(error_frame(request.id, error, self.state, request.model))
            return
        request.frames = frames
        await self._answer(request, frames)

    async def _answer_cancelled_queuing(self, request: _RunningRequest) -> None:
        """Once a generate whose queuing a `cancel` stopped has let go of what it held, answer it
        cancelled (nothing ran), unless its queuing had finished all the same and it answers itself."""
        await asyncio.gather(request.task, return_exceptions=True)
        if self.current is request and request.frames is None:
            self._finished_with(request)
            await self.send(cancelled_generation_frame(request.id, request.session_id))

    def _finished_with(self, request: _RunningRequest) -> None:
        """Let the connection take its next request (at once when the client can see the answer's end)."""
        if self.current is request:
            self.current = None
            self.state.inflight -= 1

    async def _answer(self, request: _RunningRequest, frames: AsyncGenerator) -> None:
        try:
            async with aclosing(frames):
                async for frame in frames:
                    if frame["type"] == "done":
                        self._finished_with(request)
                    await self.send(frame)
        except Exception as error:
            self._finished_with(request)
            await self.send(error_frame(request.id, error, self.state, request.model))
        finally:
            self._finished_with(request)


@router.websocket("/v1/stream")
async def stream(websocket: WebSocket):
    state = app_state(websocket)
    # a browser's page offers "xlserve" (and its key as a second subprotocol, never echoed)
    offered = WEBSOCKET_SUBPROTOCOL in offered_subprotocols(websocket)
    await websocket.accept(subprotocol=WEBSOCKET_SUBPROTOCOL if offered else None)
    # refused once accepted, with an error frame a client can read (a refused handshake tells it
    # nothing): a query parameter (the route takes none), then a missing or malformed key
    try:
        refused = cross_origin_error(websocket, state.settings.security.allowed_origin_list())
        if refused is not None:
            raise refused
        refuse_unknown_query_parameters(websocket)
        owner = owner_of(websocket)
    except APIError as error:
        await websocket.send_text(json.dumps(error_frame(None, error, state)))
        reason = {401: "authentication failed", 403: "cross-origin page"}.get(error.status, "invalid request")
        await websocket.close(code=1008, reason=reason)
        return
    await _Connection(websocket, state, owner).run()
