"""The API process's side of the engine process (server/engine/process.py); runs in the API
process and never imports torch.

`EngineClient.start` spawns the engine process with one end of a socketpair and waits until it
has loaded every model and opened the session cache. Then one reader task routes what comes
back: answers to the awaiting call, each step's events to the queues of their requests.

A generation is a `RemoteSubmission`: the same consumer side as an in-process `Submission`
(`events()`, `cancel()`, the queue), so the routers do not care where the engine runs. A session
held by a request is a `RemoteLease`; its state stays in the engine process.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

from xlserve.server.cache import SessionInfo
from xlserve.server.engine.types import Submission
from xlserve.server.engine.errors import EngineGone
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings
from xlserve.server.engine.wire import encode_frame, error_from_wire, event_from_wire, is_last, read_frame_async

log = logging.getLogger("xlserve.engine_client")


@dataclass
class RemoteLease:
    """A request's hold on a session; the state it starts from stays in the engine process."""

    id: int
    session_id: str
    info: SessionInfo  # as of the acquire: info.tokens is what the session's memory holds
    has_history: bool  # it has a next-token distribution to continue from
    released: bool = False


class RemoteSubmission(Submission):
    """A request running in the engine process; its events arrive through the reader task."""

    def __init__(self, client: "EngineClient", model: str, request_id: int):
        super().__init__(model, client.metrics, threading.Event())
        self.client, self.id = client, request_id
        self.ended = False  # the engine sent its last event

    def _stop(self) -> None:
        if not self.ended and not self.cancelled.is_set():
            self.cancelled.set()
            self.client.send({"op": "cancel", "request": self.id})


class EngineClient:
    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings, self.metrics = settings, metrics
        self.process: subprocess.Popen | None = None
        self.models: list[dict] = []
        self.alive = False
        self.ids = itertools.count(1)
        self.calls: dict[int, asyncio.Future] = {}
        self.submissions: dict[int, RemoteSubmission] = {}
        self.reader_task: asyncio.Task | None = None
        self.exit_reason = "the engine process has not started"

    # -- life --------------------------------------------------------------------------------

    async def start(self) -> "EngineClient":
        """Spawn the engine process and wait until it has loaded the models (from the running
        event loop's thread: on Linux the engine process dies with the thread that spawned it)."""
        ours, theirs = socket.socketpair()
        settings = self.settings.model_dump(mode="json", exclude={"api_keys"})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "xlserve.server.engine.process", str(theirs.fileno()), json.dumps(settings)],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.reader, self.writer = await asyncio.open_connection(sock=ours)
        first = await read_frame_async(self.reader)
        if first is None or first[0].get("op") != "ready":
            reason = first[0].get("error") if first else None
            code = await asyncio.to_thread(self.process.wait, 60)
            raise RuntimeError(f"the engine process failed to start (exit code {code})"
                               + (f": {reason}" if reason else ""))
        self.models = first[0]["models"]
        self.alive = True
        self.reader_task = asyncio.create_task(self._read())
        return self

    async def close(self, timeout: float = 120) -> int | None:
        """Stop the engines, let the cache write its sessions down, wait for the process."""
        if self.process is None:
            return None
        if self.alive:
            self.send({"op": "shutdown"})
        try:
            code = await asyncio.to_thread(self.process.wait, timeout)
        except subprocess.TimeoutExpired:
            log.error("the engine process did not stop within %ss; killing it", timeout)
            self.process.kill()
            code = await asyncio.to_thread(self.process.wait)
        if self.reader_task is not None:
            self.reader_task.cancel()
            await asyncio.gather(self.reader_task, return_exceptions=True)
        self.writer.close()
        return code

    async def _read(self) -> None:
        try:
            while True:
                frame = await read_frame_async(self.reader)
                if frame is None:
                    break
                header, blob = frame
                op = header["op"]
                if op == "events":
                    self._route(header["events"])
                elif op == "answer":
                    future = self.calls.pop(header["id"], None)
                    if future is not None and not future.done():
                        if "error" in header:
                            future.set_exception(error_from_wire(header["error"]))
                        else:
                            future.set_result((header["ok"], blob))
        finally:
            self._gone("the engine process exited")

    def _gone(self, reason: str) -> None:
        self.alive = False
        self.exit_reason = reason
        error = self._gone_error()
        for future in self.calls.values():
            if not future.done():
                future.set_exception(error)
        self.calls.clear()
        for submission in self.submissions.values():
            submission.ended = True
            submission.queue.put_nowait(error)
        self.submissions.clear()

    def _gone_error(self) -> EngineGone:
        return EngineGone(f"{self.exit_reason}; the server cannot serve requests", code="engine_gone")

    def _route(self, events: list) -> None:
        """One engine step's events into their requests' queues."""
        submissions = self.submissions
        for item in events:
            submission = submissions.get(item[0])
            if submission is None:  # a request this side already gave up on
                continue
            request_id, event = event_from_wire(item)
            if is_last(event):
                submission.ended = True
                del submissions[request_id]
            submission.queue.put_nowait(event)

    # -- calls -------------------------------------------------------------------------------

    def send(self, header: dict, blob: bytes | None = None) -> None:
        """Fire and forget (cancel, release): order with other frames is kept."""
        if self.alive:
            self.writer.write(encode_frame(header, blob))

    async def call(self, op: str, blob: bytes | None = None, request_id: int | None = None, **fields):
        """Send an operation, wait for its answer: (result, blob). Raises what the engine process
        raised (the same exception classes, through server/engine/wire.py)."""
        if not self.alive:
            raise self._gone_error()
        call_id = next(self.ids) if request_id is None else request_id
        future = asyncio.get_running_loop().create_future()
        self.calls[call_id] = future
        self.writer.write(encode_frame({"op": op, "id": call_id, **fields}, blob))
        if self.writer.transport.get_write_buffer_size() > (1 << 20):
            await self.writer.drain()
        return await future

    async def submit(self, model: str, prompt: list[int], params: dict, lease: RemoteLease | None) -> RemoteSubmission:
        """Queue a generation; raises QueueFull / ShuttingDown / ValueError before anything started."""
        return await self._queue("generate", model, model=model, prompt=prompt, params=params,
                                 lease=None if lease is None else lease.id)

    async def append(self, lease: RemoteLease, tokens: list[int], score: bool) -> RemoteSubmission:
        """Queue a document chunk for a leased session (its new state waits for `commit`); the
        submission's last event is an `Appended` (see `types.appended`)."""
        return await self._queue("append", lease.info.model, lease=lease.id, tokens=tokens, score=score)

    async def _queue(self, op: str, served_model: str, **fields) -> RemoteSubmission:
        """Register the request's submission before asking: its events may arrive before the answer."""
        submission = RemoteSubmission(self, served_model, next(self.ids))
        self.submissions[submission.id] = submission
        try:
            await self.call(op, request_id=submission.id, **fields)
        except BaseException:
            self.submissions.pop(submission.id, None)
            raise
        return submission

    async def acquire(self, session_id: str, owner: str | None) -> RemoteLease:
        result, _ = await self.call("acquire", session_id=session_id, owner=owner)
        return RemoteLease(result["lease"], session_id, SessionInfo(**result["info"]), result["has_history"])

    async def commit(self, lease: RemoteLease) -> SessionInfo:
        result, _ = await self.call("commit", lease=lease.id)
        return SessionInfo(**result)

    def release(self, lease: RemoteLease) -> None:
        if not lease.released:
            lease.released = True
            self.send({"op": "release", "lease": lease.id})

    async def session_call(self, op: str, blob: bytes | None = None, **fields) -> SessionInfo:
        result, _ = await self.call(op, blob, **fields)
        return SessionInfo(**result)

    async def export(self, session_id: str, owner: str | None) -> tuple[SessionInfo, bytes]:
        result, blob = await self.call("export", session_id=session_id, owner=owner)
        return SessionInfo(**result), blob

    async def stop_admitting(self) -> None:
        await self.call("stop_admitting")

    async def idle(self) -> bool:
        result, _ = await self.call("idle")
        return result["idle"]

    async def metrics_text(self) -> bytes:
        result, _ = await self.call("metrics")
        return result["text"].encode()
