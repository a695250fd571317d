"""A disconnect against a commit: exactly one of them wins (server/api/serving/cancellation.py).

The app `build_app` makes is driven as an ASGI application, with a stand-in for the engine
process whose append / generation finish when the test says, so that the client's disconnect
can be placed exactly: before the engine's last event, in the same instant as it (the race a
real server meets when a client gives up at the end of a long prefill), or while the commit
runs. A disconnect that comes before the commit begins leaves the session as it was (nothing
committed, the lease released, the request counted as a 499); one that comes while the commit
runs changes nothing (committed once). The same against a real server, mid-prefill, is
tests/e2e/test_cancellation.py."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from xlserve.models.tokenizer import ByteTokenizer
from xlserve.server.api.deps import AppState, ServedModel
from xlserve.server.api.errors import ERROR_TYPES
from xlserve.server.api.serving import Cancellation
from xlserve.server.app import build_app
from xlserve.server.cache.errors import SessionInfo
from xlserve.server.engine.client import RemoteLease
from xlserve.server.engine.types import Appended, Cancelled, ChoiceFinished, Finished, Submission
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings

from tests.server.scripted_engine import ScriptedEngine

MODEL = "m"
SESSION = "s1"


def session_info(version: int = 0, tokens: int = 0) -> SessionInfo:
    return SessionInfo(SESSION, MODEL, None, tokens, version, 10, "device", 0.0, 0.0)


class SessionEngine(ScriptedEngine):
    """Holds one session; each append or generation is a submission the test finishes by hand
    (`submitted` is set when it is queued); `commit` waits for `commit_may_end`."""

    def __init__(self, metrics: Metrics):
        super().__init__(metrics)
        self.submitted = asyncio.Event()
        self.submission: Submission | None = None
        self.commits: list[dict | None] = []
        self.commit_started = asyncio.Event()
        self.commit_may_end = asyncio.Event()
        self.commit_may_end.set()
        self.released = 0

    async def acquire(self, session_id, owner, key):
        return RemoteLease(1, session_id, session_info(), False)

    def _queue(self) -> Submission:
        self.submission = Submission(MODEL, self.metrics, threading.Event(), wake=lambda: None)
        self.submitted.set()
        return self.submission

    async def append(self, lease, tokens, score, **_):
        return self._queue()

    async def submit(self, model, tokens, params, lease, scope, owner=None):
        return self._queue()

    async def commit(self, lease, result=None):
        self.commits.append(result)
        self.commit_started.set()
        await self.commit_may_end.wait()
        return session_info(version=1, tokens=3)

    def release(self, lease):
        self.released += 1


@pytest.fixture
def app_and_engine():
    settings = Settings(models="none-loaded")
    app = build_app(settings)
    metrics = Metrics()
    state = AppState(settings=settings, metrics=metrics, api_keys=[], ready=True)
    card = {"id": MODEL, "object": "model", "created": 0, "owned_by": "xlserve", "architecture": "transformer-xl",
            "state_kind": "segment-recurrence", "state_grows_with_context": False, "max_context": None,
            "parameters": 0, "config": {},
            "quantize": "none", "weight_bytes": 0,
            "state_bytes_per_session": 9216}
    state.models = {MODEL: ServedModel(MODEL, ByteTokenizer(), 256, card)}
    metrics.declare_api_series(list(state.models), ERROR_TYPES)
    app.state.xlserve = state
    return app, state


class Client:
    """One plain HTTP request to the app, whose client hangs up when `hang_up` is called."""

    def __init__(self, app, path: str, body: dict):
        self.app, self.path = app, path
        self.body = json.dumps(body).encode()
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.incoming.put_nowait({"type": "http.request", "body": self.body, "more_body": False})
        self.status: int | None = None

    def hang_up(self) -> None:
        self.incoming.put_nowait({"type": "http.disconnect"})

    async def run(self) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
                 "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(self.body)).encode())]}

        async def send(message):
            if message["type"] == "http.response.start":
                self.status = message["status"]

        await self.app(scope, self.incoming.get, send)


def append_request(app) -> Client:
    return Client(app, f"/v1/sessions/{SESSION}/append", {"text": "abc"})


def completion_request(app) -> Client:
    return Client(app, "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 1, "session_id": SESSION})


def last_event(kind: str):
    if kind == "append":
        return Appended(None, -1.0, 2)
    choice = ChoiceFinished(0, "length", "", 1)
    return Finished([choice], 3, 1, 0, None)


REQUESTS = {"append": append_request, "completion": completion_request}


def drive(app, engine: SessionEngine, kind: str, once_queued) -> Client:
    """Run one request of `kind` to its end; once the engine has it, `once_queued(client)` (a
    coroutine function) plays the client's and the engine's parts."""

    async def scenario():
        client = REQUESTS[kind](app)
        running = asyncio.create_task(client.run())
        await asyncio.wait_for(engine.submitted.wait(), 5)
        await once_queued(client)
        await asyncio.wait_for(running, 5)
        return client

    return asyncio.run(scenario())


@pytest.mark.parametrize("kind", REQUESTS)
def test_a_disconnect_during_the_work_commits_nothing(app_and_engine, kind):
    app, state = app_and_engine
    engine = state.engine = SessionEngine(state.metrics)

    async def hang_up(client):
        client.hang_up()

    client = drive(app, engine, kind, hang_up)
    assert engine.submission.cancelled.is_set()  # the cancel went to the engine, which drops it at its next step
    assert engine.commits == [] and engine.released == 1
    assert client.status == 499


@pytest.mark.parametrize("kind", REQUESTS)
def test_a_disconnect_in_the_same_instant_as_the_result_commits_nothing(app_and_engine, kind):
    """The engine's last event and the disconnect arrive together (the watcher hears the
    disconnect first): the request has its whole result, and still commits nothing."""
    app, state = app_and_engine
    engine = state.engine = SessionEngine(state.metrics)

    async def hang_up_as_the_result_comes(client):
        client.hang_up()
        engine.submission.queue.put_nowait(last_event(kind))

    client = drive(app, engine, kind, hang_up_as_the_result_comes)
    assert engine.commits == [] and engine.released == 1
    assert client.status == 499


@pytest.mark.parametrize("kind", REQUESTS)
def test_a_disconnect_while_the_commit_runs_changes_nothing(app_and_engine, kind):
    app, state = app_and_engine
    engine = state.engine = SessionEngine(state.metrics)
    engine.commit_may_end.clear()

    async def hang_up_during_the_commit(client):
        engine.submission.queue.put_nowait(last_event(kind))
        await asyncio.wait_for(engine.commit_started.wait(), 5)
        client.hang_up()
        await asyncio.sleep(0.05)  # the watcher hears it while the commit is under way
        engine.commit_may_end.set()

    client = drive(app, engine, kind, hang_up_during_the_commit)
    assert len(engine.commits) == 1 and engine.released == 1
    assert client.status == 200  # answered (to nobody): the commit won


def test_a_cancellation_decides_once():
    cancellation = Cancellation()
    cancellation.begin_commit()
    cancellation.cancel()  # too late: the commit has begun
    assert not cancellation.requested
    stopped = Cancellation()
    stopped.cancel()
    with pytest.raises(Cancelled):
        stopped.begin_commit()
    assert not stopped.committing


def test_a_stream_whose_client_leaves_before_it_is_queued_is_cancelled():
    """Queuing a streamed generation can take seconds (a constraint's first compile, a prefix
    lookup in Redis) before any response exists to notice a disconnect: the client's hang-up then
    cancels the queuing (client.py `_queue` sends the engine a Cancel on that), lets its session
    go, and the request ends Cancelled (499) instead of running for nobody."""
    from xlserve.server.api.serving.completions import _queued_while_connected
    from xlserve.server.api.serving.leases import QUEUED

    class Hangs:
        def __init__(self):
            self.messages = asyncio.Queue()

        async def receive(self):
            return await self.messages.get()

    cleaned = []

    async def answer():
        try:
            await asyncio.sleep(3600)  # queuing: the constraint compiles
            yield QUEUED
        finally:
            cleaned.append(True)  # its session's lease goes back here

    async def run():
        request = Hangs()
        asyncio.get_running_loop().call_later(0.1, request.messages.put_nowait, {"type": "http.disconnect"})
        with pytest.raises(Cancelled):
            await asyncio.wait_for(_queued_while_connected(request, answer()), 10)
        assert cleaned == [True]

        # a client that stays: the answer, queued, streams on
        async def quick():
            yield QUEUED
            yield b"chunk"

        stays = Hangs()
        chunks = await _queued_while_connected(stays, quick())
        assert [chunk async for chunk in chunks] == [b"chunk"]

    asyncio.run(run())


class QueuingForever(ScriptedEngine):
    """An engine whose submit never returns (a generate being queued: a constraint's first
    compile, a prefix lookup); it says when it was cancelled."""

    def __init__(self, metrics):
        super().__init__(metrics)
        self.queuing, self.cancelled = asyncio.Event(), asyncio.Event()

    async def submit(self, model, tokens, params, lease, scope, owner=None):
        self.queuing.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


GENERATE = {"type": "generate", "model": MODEL, "prompt": "abc", "max_tokens": 4}


class WebsocketConnection:
    """A websocket connection to the app, driven by hand: `receive` a message from the client,
    `frames` the frames the server sent."""

    def __init__(self, app):
        self.incoming, self.sent = asyncio.Queue(), []
        scope = {"type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "ws",
                 "path": "/v1/stream", "raw_path": b"/v1/stream", "query_string": b"", "root_path": "",
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "headers": [(b"host", b"test")],
                 "subprotocols": []}
        self.incoming.put_nowait({"type": "websocket.connect"})
        self.task = asyncio.create_task(app(scope, self.incoming.get, self._send))

    async def _send(self, message):
        self.sent.append(message)

    def receive(self, frame: dict) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(frame)})

    def frames(self) -> list[dict]:
        return [json.loads(m["text"]) for m in self.sent if m["type"] == "websocket.send"]

    async def until_frames(self) -> list[dict]:
        for _ in range(500):
            if self.frames():
                return self.frames()
            await asyncio.sleep(0.01)
        raise AssertionError("no frame came")

    async def close(self) -> None:
        self.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
        await asyncio.wait_for(self.task, 5)


async def first_generate_queuing(app, engine: QueuingForever) -> WebsocketConnection:
    """A connection whose generate "first" is being queued (and stays so)."""
    connection = WebsocketConnection(app)
    connection.receive({**GENERATE, "id": "first"})
    await asyncio.wait_for(engine.queuing.wait(), 5)
    return connection


def test_a_websocket_generate_being_queued_leaves_the_connection_reading(app_and_engine):
    """A websocket generate is queued in its own task: while it waits (a constraint's first
    compile, a prefix lookup) the connection goes on reading, so a second request is answered
    request_in_progress at once and a close cancels the queuing, where the engine process is told
    (client.py `_queue` sends Cancel on that), instead of compiling and running for nobody."""
    app, state = app_and_engine
    engine = state.engine = QueuingForever(state.metrics)

    async def scenario():
        connection = await first_generate_queuing(app, engine)
        connection.receive({**GENERATE, "id": "second"})  # answered while the first is still being queued
        frames = await connection.until_frames()
        assert [(frame["id"], frame["error"]["code"]) for frame in frames] == [("second", "request_in_progress")]
        # one with the running request's own id: its refusal does not carry that id, where it would
        # read as the running request's end
        connection.receive({**GENERATE, "id": "first"})
        for _ in range(500):
            if len(connection.frames()) > 1:
                break
            await asyncio.sleep(0.01)
        (_, refused) = connection.frames()
        assert (refused["id"], refused["error"]["code"]) == (None, "request_in_progress")
        assert "'first' is still running" in refused["error"]["message"]
        assert not engine.cancelled.is_set()
        await connection.close()
        assert engine.cancelled.is_set()  # the close reached the queuing
        assert state.inflight == 0

    asyncio.run(scenario())


def test_a_cancel_frame_stops_a_websocket_generate_being_queued(app_and_engine):
    """A `cancel` for a generate still being queued (a constraint's first compile, a prefix
    lookup) stops the queuing there, as a close does (the engine process is told), and is
    answered `done` cancelled at once, with nothing run; the connection then takes its next
    request. Before, the cancel waited for the queuing to end (a compile of up to
    XLSERVE_STRUCTURED_COMPILE_SECONDS), and the client with it."""
    app, state = app_and_engine
    engine = state.engine = QueuingForever(state.metrics)

    async def scenario():
        connection = await first_generate_queuing(app, engine)
        connection.receive({"type": "cancel", "id": "first"})
        await asyncio.wait_for(engine.cancelled.wait(), 5)  # the cancel reached the queuing
        [done] = await connection.until_frames()
        assert (done["type"], done["id"], done["finish_reason"]) == ("done", "first", "cancelled"), done
        assert done["usage"]["completion_tokens"] == 0
        assert state.inflight == 0
        # the connection is free: its next request is taken (and queued, not request_in_progress)
        engine.queuing.clear()
        connection.receive({**GENERATE, "id": "second"})
        await asyncio.wait_for(engine.queuing.wait(), 5)
        assert len(connection.frames()) == 1 and state.inflight == 1
        await connection.close()
        assert state.inflight == 0

    asyncio.run(scenario())


def test_a_cancel_while_the_session_is_taken_is_answered_after_its_release(app_and_engine):
    """A `cancel` for a generate whose session the engine process is still taking (its state
    coming back from disk or Redis) is answered once the lease has been let go, so that the
    client's next request for the session, sent on that answer, is not refused 409 by the lease
    of the one it cancelled (the release used to follow whenever the lease arrived)."""
    app, state = app_and_engine

    class SlowToTake(SessionEngine):
        def __init__(self, metrics):
            super().__init__(metrics)
            self.taking, self.taken = asyncio.Event(), asyncio.Event()
            self.order: list[str] = []

        async def acquire(self, session_id, owner, key):
            self.taking.set()
            await self.taken.wait()
            return await super().acquire(session_id, owner, key)

        def release(self, lease):
            super().release(lease)
            self.order.append("released")

    engine = state.engine = SlowToTake(state.metrics)

    async def scenario():
        connection = WebsocketConnection(app)
        connection.receive({**GENERATE, "id": "first", "session_id": SESSION})
        await asyncio.wait_for(engine.taking.wait(), 5)
        connection.receive({"type": "cancel", "id": "first"})
        await asyncio.sleep(0.2)
        assert connection.frames() == [] and engine.order == []  # the lease is still on its way
        engine.taken.set()
        [done] = await connection.until_frames()
        engine.order.append("answered")
        assert (done["id"], done["finish_reason"]) == ("first", "cancelled"), done
        assert engine.order == ["released", "answered"] and engine.released == 1
        assert state.inflight == 0
        await connection.close()

    asyncio.run(scenario())
