"""Websocket /v1/stream: generation and document feeding over one long-lived connection.

The protocol (JSON text frames, one request at a time per connection) is documented in
docs/websocket.md. In short: the client sends `generate`, `append` or `cancel`; the server
answers a request with `token` frames and one `done` frame, or with an `error` frame. A frame
the server cannot use gets an `error` frame and the connection stays open. Closing the
connection cancels the request in flight within one engine step; its session stays as it was.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from typing import Annotated, Literal, Union

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from xlserve.server.api.completions import Generation, SamplingFields, acquire_lease, error_for, prompt_tokens
from xlserve.server.api.deps import AppState, app_state, owner_of
from xlserve.server.cache import CacheError
from xlserve.server.engine.types import Cancelled, ChoiceFinished, Finished, Submission, TokenEvent
from xlserve.server.engine.types import appended
from xlserve.server.api.errors import APIError, Conflict, InvalidRequest, as_api_error

router = APIRouter()


class GenerateFrame(SamplingFields):
    model_config = ConfigDict(extra="forbid")
    type: Literal["generate"]
    id: str | None = None  # echoed in every frame of the answer


class AppendFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["append"]
    id: str | None = None
    session_id: str
    text: str | list[int]
    score: bool = False


class CancelFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["cancel"]
    id: str | None = None  # the request to cancel; None = whatever is running


ClientFrame = TypeAdapter(Annotated[Union[GenerateFrame, AppendFrame, CancelFrame], Field(discriminator="type")])


def parse_frame(text: str):
    """A client frame, or an InvalidRequest that says what is wrong with it."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"frame is not valid JSON: {error.msg} at position {error.pos}", code="malformed_frame")
    if not isinstance(raw, dict):
        raise InvalidRequest("frame must be a JSON object with a 'type'", code="malformed_frame")
    if raw.get("type") not in ("generate", "append", "cancel"):
        raise InvalidRequest(f"unknown frame type {raw.get('type')!r}; expected 'generate', 'append' or 'cancel'",
                             param="type", code="malformed_frame")
    try:
        return ClientFrame.validate_python(raw)
    except ValidationError as error:
        first = error.errors()[0]
        location = [str(part) for part in first.get("loc", ())[1:]]  # [0] is the frame type
        param = ".".join(location) or None
        raise InvalidRequest(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param,
                             code="malformed_frame") from None


class _Operation:
    """The request running on a connection."""

    def __init__(self, request_id: str | None):
        self.id = request_id
        self.submission: Submission | None = None  # the generation or append in the engine
        self.cancelled = threading.Event()
        self.task: asyncio.Task | None = None

    def cancel(self) -> None:
        self.cancelled.set()
        if self.submission is not None:
            self.submission.cancel()


class _Connection:
    def __init__(self, websocket: WebSocket, state: AppState, owner: str | None):
        self.websocket, self.state, self.owner = websocket, state, owner
        self.send_lock = asyncio.Lock()
        self.current: _Operation | None = None

    async def send(self, frame: dict) -> None:
        """Send a frame; a connection that is gone is noticed by the receive loop, which cancels."""
        async with self.send_lock:
            try:
                await self.websocket.send_text(json.dumps(frame))
            except (WebSocketDisconnect, RuntimeError, OSError):
                pass

    async def send_error(self, request_id: str | None, error: BaseException) -> None:
        api_error = error_for(error)
        frame = {"type": "error", "id": request_id, **api_error.body()}
        if "Retry-After" in api_error.headers:
            frame["retry_after"] = int(api_error.headers["Retry-After"])
        await self.send(frame)

    async def run(self) -> None:
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    await self.send_error(None, InvalidRequest("frames must be JSON text, not binary",
                                                               code="malformed_frame"))
                    continue
                await self.handle(text)
        finally:  # the client left (or the server is stopping): cancel what runs, nothing is committed
            operation = self.current
            if operation is not None:
                operation.cancel()
                if operation.task is not None:
                    operation.task.cancel()
                    await asyncio.gather(operation.task, return_exceptions=True)

    async def handle(self, text: str) -> None:
        request_id = None
        try:
            try:
                request_id = json.loads(text).get("id")
                request_id = request_id if isinstance(request_id, str) else None
            except (ValueError, AttributeError):
                pass
            frame = parse_frame(text)
            if isinstance(frame, CancelFrame):
                operation = self.current
                if operation is None or (frame.id is not None and frame.id != operation.id):
                    raise Conflict("nothing to cancel: no request with that id is running", code="nothing_to_cancel")
                operation.cancel()
                return
            if self.current is not None:
                raise Conflict(f"request {self.current.id!r} is still running; send one request at a time "
                               "(or cancel it first)", code="request_in_progress")
            operation = _Operation(frame.id)
            if isinstance(frame, GenerateFrame):
                call = await Generation(self.state, frame, self.owner).start()
                operation.submission = await call.submit()
                work = self._generate(operation, call)
            else:
                work = self._append(operation, frame)
            self.current = operation
            self.state.inflight += 1
            operation.task = asyncio.create_task(work)
        except Exception as error:  # refused before it started: an error frame, the connection stays
            await self.send_error(request_id, error)

    def _finished_with(self, operation: _Operation) -> None:
        if self.current is operation:
            self.current = None
            self.state.inflight -= 1

    async def _generate(self, operation: _Operation, call: Generation) -> None:
        choice_end: ChoiceFinished | None = None
        generated = 0
        want_top = call.body.logprobs is not None and call.body.logprobs > 0
        name = call.served.tokenizer.token_text
        try:
            async for event in operation.submission.events():
                if isinstance(event, TokenEvent):
                    generated += 1
                    frame = {"type": "token", "id": operation.id, "text": event.text, "token": event.token,
                             "logprob": event.logprob}
                    if want_top:
                        frame["top_logprobs"] = {name(t): v for t, v in event.top}
                    await self.send(frame)
                elif isinstance(event, ChoiceFinished):
                    choice_end = event
                elif isinstance(event, Finished):
                    info = await call.commit(event)
                    self._finished_with(operation)
                    done = {"type": "done", "id": operation.id, "finish_reason": event.finish_reason,
                            "text": choice_end.text_tail if choice_end else "", "usage": call.usage(event),
                            "session_id": call.body.session_id}
                    if info is not None:
                        done.update(session_tokens=info.tokens, version=info.version)
                    await self.send(done)
        except Cancelled:
            call.release()
            self._finished_with(operation)
            await self.send({"type": "done", "id": operation.id, "finish_reason": "cancelled", "text": "",
                             "usage": {"prompt_tokens": len(call.tokens), "completion_tokens": generated,
                                       "total_tokens": len(call.tokens) + generated},
                             "session_id": call.body.session_id})
        except Exception as error:
            call.release()
            call.count_error(error)
            self._finished_with(operation)
            await self.send_error(operation.id, error)
        finally:
            call.release()  # no-op after a commit
            self._finished_with(operation)

    async def _append(self, operation: _Operation, frame: AppendFrame) -> None:
        state = self.state
        lease = None
        try:
            lease = await acquire_lease(state, frame.session_id, self.owner)
            served = state.served(lease.info.model)
            tokens = prompt_tokens(state, served, frame.text)
            if not tokens:
                raise InvalidRequest("text is empty", param="text")
            cached = lease.info.tokens
            if operation.cancelled.is_set():  # cancelled while the session was being fetched
                raise Cancelled()
            operation.submission = await state.engine.append(lease, tokens, frame.score)
            if operation.cancelled.is_set():  # cancelled while the append was being queued
                operation.submission.cancel()
            fed = await appended(operation.submission)
            logprob, scored = fed.logprob, fed.scored
            try:
                info = await state.engine.commit(lease)
            except CacheError as error:
                raise as_api_error(error) from None
            state.metrics.memory_reused_tokens.labels(info.model).inc(cached)
            state.metrics.state_bytes_per_session.labels(info.model).observe(info.state_bytes)
            self._finished_with(operation)
            done = {"type": "done", "id": operation.id, "finish_reason": None, "session_id": frame.session_id,
                    "usage": {"prompt_tokens": len(tokens), "completion_tokens": 0, "total_tokens": len(tokens),
                              "prompt_tokens_details": {"cached_tokens": cached}},
                    "session_tokens": info.tokens, "version": info.version}
            if frame.score:
                text_bytes = len(tokens) if isinstance(frame.text, list) else len(frame.text.encode("utf-8"))
                scored_bytes = text_bytes - (len(tokens) - scored)
                done.update(logprob=logprob, scored_tokens=scored,
                            bits_per_byte=(-logprob / math.log(2) / scored_bytes) if scored_bytes else None)
            await self.send(done)
        except Cancelled:
            self._finished_with(operation)
            await self.send({"type": "done", "id": operation.id, "finish_reason": "cancelled",
                             "session_id": frame.session_id})
        except Exception as error:
            self._finished_with(operation)
            await self.send_error(operation.id, error)
        finally:
            if lease is not None:
                state.engine.release(lease)  # no-op after the commit
            self._finished_with(operation)


@router.websocket("/v1/stream")
async def stream(websocket: WebSocket):
    state = app_state(websocket)
    await websocket.accept()
    try:
        owner = owner_of(websocket)
    except APIError as error:
        await websocket.send_text(json.dumps({"type": "error", "id": None, **error.body()}))
        await websocket.close(code=1008, reason="authentication failed")
        return
    await _Connection(websocket, state, owner).run()

