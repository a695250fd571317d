"""Session states moving through the API process (import, PUT state, export) hold one of
MAX_STATES_IN_FLIGHT places: a client that stalls must not keep one. An upload must keep coming
after its grace (read_body: 408 state_body_too_slow), an export whose client stops reading ends
after the stream send timeout (StateResponse), and admission never buffers a state's body, even
one labelled JSON, before the route has a place for it. A stand-in engine; no model."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from xlserve.models.tokenizer import ByteTokenizer
from xlserve.server.api.deps import ServedModel
from xlserve.server.api.protocol import frame_id
from xlserve.server.api.serving import requests as serving_requests
from xlserve.server.api.serving.requests import MAX_STATES_IN_FLIGHT, StateResponse
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings

from tests.server.scripted_engine import RecordingEngine, scripted_app

MODEL = "m"
CARD = {"id": MODEL, "object": "model", "created": 0, "owned_by": "xlserve", "architecture": "transformer-xl",
        "state_kind": "segment-recurrence", "state_grows_with_context": False, "max_context": None,
        "parameters": 0, "config": {}, "quantize": "none", "weight_bytes": 0, "state_bytes_per_session": 9216}


@pytest.fixture
def app_and_state():
    return scripted_app(Settings(models="none-loaded", max_request_body_bytes=1_000_000), RecordingEngine(Metrics()),
                        {MODEL: ServedModel(MODEL, ByteTokenizer(), 256, CARD, None)})


def run(coroutine):
    return asyncio.run(coroutine)


async def post_import(app, body) -> httpx.Response:
    """POST /v1/sessions/import of `body` (an async iterator of parts, as a client sends them)."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        return await asyncio.wait_for(client.post("/v1/sessions/import", content=body,
                                                  headers={"content-type": "application/octet-stream"}), 10)


def test_an_upload_that_stalls_is_408_and_gives_its_place_back(app_and_state, monkeypatch):
    app, state = app_and_state
    monkeypatch.setattr(serving_requests, "STATE_BODY_GRACE_SECONDS", 0.3)
    sent = []

    async def trickle():
        yield b"x" * 10
        sent.append(10)
        await asyncio.sleep(30)  # then nothing: a stalled client
        yield b"never"

    response = run(post_import(app, trickle()))
    assert response.status_code == 408, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "state_body_too_slow")
    assert "bytes/s" in error["message"] and sent == [10]
    assert state.states_in_flight == 0


def test_a_json_body_that_stalls_is_408_and_its_bytes_let_go(app_and_state, monkeypatch):
    """Admission reads a JSON body (or one without a length) whole before the route: a client that
    sent most of 8 MB and stopped held it for as long as its connection stayed open. It keeps the
    state bodies' pace, and the two are the same numbers."""
    from xlserve.server.api import admission

    assert (admission.BODY_GRACE_SECONDS, admission.BODY_BYTES_PER_SECOND) == (
        serving_requests.STATE_BODY_GRACE_SECONDS, serving_requests.STATE_BODY_BYTES_PER_SECOND)
    app, _ = app_and_state
    monkeypatch.setattr(admission, "BODY_GRACE_SECONDS", 0.3)

    async def trickle():
        yield b'{"model": "m", "prompt": "'
        await asyncio.sleep(30)  # then nothing: a stalled client
        yield b'"}'

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            return await asyncio.wait_for(client.post("/v1/completions", content=trickle(),
                                                      headers={"content-type": "application/json"}), 10)

    response = run(post())
    assert response.status_code == 408, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "body_too_slow") and "bytes/s" in error["message"]


def test_a_state_upload_labelled_json_is_not_read_before_it_has_a_place(app_and_state):
    """A state labelled application/json was buffered whole by admission (up to the state body
    limit, hundreds of MB at real size) before the route found every place taken."""
    app, state = app_and_state
    pulled = []

    async def body():
        for i in range(100):
            pulled.append(i)
            yield b"x" * 1000

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            return await client.post("/v1/sessions/import", content=body(), headers={"content-type": "application/json"})

    state.states_in_flight = MAX_STATES_IN_FLIGHT
    response = run(main())
    assert response.status_code == 429 and response.json()["error"]["code"] == "states_in_flight"
    assert len(pulled) <= 1, f"{len(pulled)} chunks were read before the 429"


def test_an_export_whose_client_stops_reading_ends_and_gives_its_place_back():
    """A real uvicorn and a client that reads 100 bytes of a 64 MB state, then stops. Sent as one
    message, the state went into the server's write buffer at once, its place came back at once and
    the process held the bytes for as long as the client kept the connection open; sent in parts,
    a part waits for the full socket, the send times out, and the connection is closed."""
    import socket
    import time

    import uvicorn

    events = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        started = time.monotonic()
        response = StateResponse(content=b"x" * (64 << 20), send_timeout=1.0, media_type="application/octet-stream",
                                 give_back=lambda: events.append(("given back", time.monotonic() - started)))
        await response(scope, receive, send)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def main():
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)

        def stalled_client():
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", port))
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            client.recv(100)  # a little, then nothing
            return client

        client = await asyncio.to_thread(stalled_client)
        deadline = time.monotonic() + 15
        while not events and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        client.close()
        server.should_exit = True
        await serving

    asyncio.run(main())
    assert len(events) == 1
    assert 0.9 <= events[0][1] < 10, events  # held while the client could still read, then let go


def test_an_oversized_frame_is_not_parsed_for_its_id():
    frame = '{"id": "r1", "type": "generate", "prompt": "' + "x" * 2000 + '"}'
    assert frame_id(frame) == "r1"
    assert frame_id(frame, max_bytes=100) is None


def test_one_api_key_holds_at_most_its_share_of_the_state_places():
    """Four places for states in flight, two of them at most one key's: one key's slow transfers
    cannot make every other key's import, export and PUT state 429."""
    from types import SimpleNamespace

    from xlserve.server.api.errors import TooManyRequests
    from xlserve.server.api.serving.requests import MAX_STATES_IN_FLIGHT_PER_KEY, take_state_place

    state = SimpleNamespace(states_in_flight=0, states_in_flight_by_owner={})
    alice = [take_state_place(state, "alice") for _ in range(MAX_STATES_IN_FLIGHT_PER_KEY)]
    with pytest.raises(TooManyRequests) as refused:
        take_state_place(state, "alice")
    assert refused.value.code == "states_in_flight" and "API key" in refused.value.message
    bob = take_state_place(state, "bob")
    alice[0]()
    alice[0]()  # once only
    alice.append(take_state_place(state, "alice"))
    for give_back in (*alice[1:], bob):
        give_back()
    assert state.states_in_flight == 0 and state.states_in_flight_by_owner == {}


def test_an_export_read_slower_than_the_state_rate_ends_and_gives_its_place_back(monkeypatch):
    """An export whose client reads each part just within the send timeout, but slower than
    STATE_BODY_BYTES_PER_SECOND after the grace, is ended and its place given back (it held the
    place, and 237 MB, for hours at 17 kB/s)."""
    monkeypatch.setattr(serving_requests, "STATE_BODY_GRACE_SECONDS", 0.2)
    monkeypatch.setattr(serving_requests, "STATE_BODY_BYTES_PER_SECOND", 8 << 20)  # 1 MiB parts: 0.125 s each
    sent, given_back = [], []

    async def slow_reader(message):
        if message["type"] == "http.response.body":
            await asyncio.sleep(0.15)  # each part within the 5 s send timeout, the whole far under the rate
            sent.append(len(message["body"]))

    response = StateResponse(content=b"x" * (16 << 20), send_timeout=5.0, media_type="application/octet-stream",
                             give_back=lambda: given_back.append(True))
    run(response({"type": "http", "method": "GET"}, None, slow_reader))
    assert given_back == [True]
    assert 0 < len(sent) < 16


def test_a_large_answer_that_is_not_streamed_is_sent_in_parts_within_the_send_timeout():
    """A non-streamed completion can be about 20 MB (every token's log-probabilities): sent as one
    message it went into the server's write buffer at once, with no deadline, and a client that
    never read held it in the process. It goes in parts of 1 MiB, each within the stream send
    timeout: a client that stops reading ends its answer."""
    import json
    from types import SimpleNamespace

    from xlserve.server.api.serving.requests import PartedJSONResponse

    answer = {"choices": [{"text": "x" * (3 << 20)}]}
    settings = SimpleNamespace(server=SimpleNamespace(stream_send_timeout_seconds=0.2))
    scope = {"type": "http", "method": "POST", "app": SimpleNamespace(state=SimpleNamespace(
        xlserve=SimpleNamespace(settings=settings)))}
    parts = []

    async def reader(message):
        if message["type"] == "http.response.body":
            parts.append(message["body"])

    run(PartedJSONResponse(answer)(scope, None, reader))
    assert len(parts) == 4 and json.loads(b"".join(parts)) == answer  # the same bytes, in 1 MiB parts

    stalled = []

    async def stops_reading(message):
        if message["type"] == "http.response.body":
            stalled.append(len(message["body"]))
            if len(stalled) > 1:
                await asyncio.sleep(30)

    async def timed():
        started = asyncio.get_running_loop().time()
        await PartedJSONResponse(answer)(scope, None, stops_reading)
        return asyncio.get_running_loop().time() - started

    assert run(timed()) < 5 and len(stalled) == 2


def test_a_large_answer_goes_in_parts_with_the_steps_events_between_them():
    """An exported session (237 MB at real size) went to the API process as one frame, written
    with the engine's socket held: every stream of every model waited for it, about a second. Its
    blob now goes in parts of PART_BYTES, each written on its own, so events sent meanwhile go
    between them; the API process joins the parts into the answer's blob, byte for byte."""
    import os
    import threading

    from xlserve.server.engine import wire
    from xlserve.server.engine.client import EngineClient

    class Recording:  # a socket that keeps what is written, in order
        def __init__(self):
            self.written, self.parts_sent = bytearray(), 0

        def sendall(self, data):
            if data[wire.HEADER.size:].startswith(b'{"op":"part"'):
                self.parts_sent += 1
                if self.parts_sent == 2:  # a step's events, sent while the answer is under way
                    writer.send(*wire.events_frame([]))
            self.written += data

    sock = Recording()
    writer = wire.FrameWriter(sock)
    writer.lock = threading.RLock()  # the events above are sent from inside a part's write
    blob = os.urandom(3 * wire.PART_BYTES + 17)
    writer.send_in_parts({"op": wire.FrameKind.ANSWER.value, "id": 7, "ok": {"x": 1}}, blob)
    assert sock.parts_sent == 4

    async def read() -> tuple[dict, bytes]:
        client = EngineClient.__new__(EngineClient)  # its reading alone
        client.calls, client.changing_calls, client.parts, client.closing = {}, set(), {}, True
        routed = []
        client._route = routed.append
        future = asyncio.get_running_loop().create_future()
        client.calls[7] = future
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(sock.written))
        reader.feed_eof()
        await client._read(reader, 0)
        assert routed == [[]] and client.parts == {}
        return await future

    fields, parts = asyncio.run(read())
    assert fields == {"x": 1} and b"".join(parts) == blob  # joined by the call, off the event loop


def test_an_upload_still_arriving_when_the_grace_is_over_is_answered_503(app_and_state):
    """Past the shutdown's grace the server cut generations with server_shutting_down, but a state
    upload still arriving was dropped with its connection when the server stopped, unanswered."""
    app, state = app_and_state
    sent = []

    async def slow():
        yield b"x" * 10
        sent.append(10)
        state.cutting = True  # the grace ends while it arrives (app.py `drain`)
        yield b"y" * 10
        sent.append(20)
        yield b"z" * 10

    response = run(post_import(app, slow()))
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "server_shutting_down"
    assert state.states_in_flight == 0
