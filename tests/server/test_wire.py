"""The messages, framing and error transport between the API process and the engine process."""

import array
import asyncio
import dataclasses
import io
import json
import socket
import threading

from xlserve.server.cache import CacheFull, CorruptState, SessionConflict, SessionLocked, SessionNotFound
from xlserve.server.cache.errors import SessionInfo
from xlserve.server.api.errors import as_api_error
from xlserve.server.engine.errors import (
    Cancelled, EngineGone, InvalidInput, ModelNotFound, QueueFull, ShuttingDown,
)
from xlserve.server.engine.types import Appended, ChoiceFinished, Finished, PromptLogprobs, SamplingParams, TokenEvent
from xlserve.server.engine.wire import (
    REQUESTS, Accepted, Acquire, Acquired, Append, Cancel, CheckIdle, Closed, Commit, ControlMessage, CreateSession,
    DeleteSession, Done, ExportedState, ExportState, ForkSession, FrameWriter, Generate, GetMetrics, GetSession,
    Heartbeat, Idleness, ImportSession, ListSessions, Message, MetricsText, Operation, Ready, Release, ReplaceState,
    Reply,
    Request, SessionChanged, SessionDescription, SessionPage, Shutdown, StartFailed, StartWithSettings, StopAdmitting,
    answer_frame, decode_request, encode_frame, error_from_wire, error_to_wire, event_from_wire, event_to_wire,
    is_last, read_frame, read_frame_async, request_frame,
)

INFO = SessionInfo("sess_a", "m", "alice", tokens=12, version=3, state_bytes=4096, tier="host", created_at=1.5,
                   last_used_at=2.5, in_use=True)
OTHER = dataclasses.replace(INFO, id="sess_b", owner=None, tier="disk", in_use=False)
KEY = {"key": "k1", "fingerprint": "f1"}
REPLAY = {**KEY, "result": dataclasses.asdict(OTHER), "version": 4, "tokens": 12, "at": 9.5}
STATE = b"\x00\x01safetensors bytes\xff"

# one of every message, with its optional fields set (the round trip must carry each)
SAMPLES = [
    Generate(5, "m", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.5, seed=7, stop=["\n"], logprobs=2,
                                               logit_bias={17: -1.5}), lease=9, prefix_scope="ab01"),
    Append(6, lease=9, tokens=[4, 5], score=True),
    Cancel(5),
    Acquire("sess_a", "alice", KEY),
    Commit(9, {**KEY, "result": {"tokens": 2}}),
    Release(9),
    CreateSession("m", None, KEY),
    GetSession("sess_a", "alice"),
    ListSessions("alice", 20, after="sess_b"),
    DeleteSession("sess_a", "alice", KEY),
    ForkSession("sess_a", None, KEY),
    ExportState("sess_a", "alice"),
    ReplaceState("sess_a", "alice", STATE, KEY),
    ImportSession(None, "alice", STATE, KEY),
    StopAdmitting(),
    CheckIdle(),
    GetMetrics(),
    Accepted(),
    Done(),
    Acquired(INFO, lease=9, has_history=True),
    Acquired(INFO, replay=REPLAY),
    SessionDescription(INFO),
    SessionChanged(info=OTHER),
    SessionChanged(replay=REPLAY),
    SessionPage([INFO, OTHER], has_more=True),
    ExportedState(INFO, STATE),
    Idleness(True),
    MetricsText("xlserve_requests_running{model=\"m\"} 0.0\n"),
    StartWithSettings({"engine": {"models": "m", "max_batch_size": 8}, "cache": {"redis_url": ""}}),
    Shutdown(),
    Ready([{"name": "m", "directory": "/w/m", "vocab_size": 256, "checkpoint_config": {"d_model": 16},
            "card": {"id": "m", "object": "model"}, "device": "cpu", "dtype": "float32", "load_seconds": 0.25}],
          pid=4321, threads={"forward": 2, "prompt": 3, "cores": 4}, session_store={"sessions": 2}),
    StartFailed("RuntimeError: no model", "Traceback ..."),
    Closed(),
    Heartbeat(steps_running={"m": 301.5}),
]


def message_classes() -> set[type]:
    """Every message class defined: the dataclasses under Message."""
    found, pending = set(), [Message]
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        if "__dataclass_fields__" in vars(cls):
            found.add(cls)
    return found


def through_the_socket(header: dict, blob: bytes | None) -> tuple[dict, bytes | None]:
    """A frame as the other side reads it: encoded to bytes, read back, through JSON."""
    return read_frame(io.BytesIO(encode_frame(header, blob)))


def test_every_message_round_trips_through_a_frame():
    assert {type(sample) for sample in SAMPLES} == message_classes(), "SAMPLES needs one of each message class"
    for sample in SAMPLES:
        if isinstance(sample, Request):
            header, blob = through_the_socket(*request_frame(sample, call_id=11))
            assert header["op"] == sample.operation.value and header["id"] == 11
            back = decode_request(header, blob)
        elif isinstance(sample, Reply):
            header, blob = through_the_socket(*answer_frame(11, sample))
            assert header["op"] == "answer" and header["id"] == 11
            back = type(sample).from_frame(header["ok"], blob)
        else:
            assert isinstance(sample, ControlMessage)
            header, blob = through_the_socket(*sample.frame())
            assert header["op"] == sample.kind.value
            back = type(sample).from_frame(header, blob)
        assert back == sample, type(sample).__name__
        # a session state, and token ids, cross as the frame's blob, never inside the JSON header
        tokens = None
        if isinstance(sample, (Generate, Append)):
            tokens = sample.prompt if isinstance(sample, Generate) else sample.tokens
        assert (blob is not None) == (any(value == STATE for value in vars(sample).values()) or tokens is not None)
        assert STATE.decode("latin-1") not in json.dumps(header)
        if tokens is not None:
            assert blob == array.array("i", tokens).tobytes() and "prompt" not in header and "tokens" not in header
    # the logit bias's token ids come back as ints, though JSON object keys are strings
    assert decode_request(*through_the_socket(*request_frame(SAMPLES[0]))).params.logit_bias == {17: -1.5}
    # a notice carries no id: nobody waits for its answer
    assert "id" not in request_frame(Cancel(5))[0]


def test_a_frame_that_fits_no_request_is_refused_by_name():
    for header, error in (({"op": "op_generate"}, "unknown operation 'op_generate'"),
                          ({"op": "get_session", "owner": None}, "session_id")):
        try:
            decode_request(header, None)
        except (ValueError, TypeError) as refused:
            assert error in str(refused)
        else:
            raise AssertionError(f"{header} was decoded")


def test_every_operation_has_a_request_class_a_handler_and_a_caller():
    from xlserve.server.engine.client import EngineClient
    from xlserve.server.engine.process import EngineProcess
    from xlserve.server.metrics import Metrics
    from xlserve.server.settings import Settings

    assert set(REQUESTS) == set(Operation)
    assert all(REQUESTS[operation].operation is operation for operation in Operation)
    assert set(EngineProcess.handlers.handlers) == set(REQUESTS.values())
    EngineProcess.handlers.check_complete()
    # each handler is a method of EngineProcess, registered for the class it is annotated with
    for request_class, handler in EngineProcess.handlers.handlers.items():
        assert getattr(EngineProcess, handler.method.__name__) is handler.method
        assert handler.method.__annotations__["request"] == request_class.__name__

    # the caller: every EngineClient method that talks to the engine process, against a stand-in
    # for it on a real socket that answers each request with a sample reply of its class
    replies = {}
    for sample in SAMPLES:  # the first of each class: a lease held, a change made (no replays)
        if isinstance(sample, Reply):
            replies.setdefault(type(sample), sample)
    ours, theirs = socket.socketpair()
    received: list[Request] = []

    def engine_process():
        stream, writer = theirs.makefile("rb"), FrameWriter(theirs)
        while (frame := read_frame(stream)) is not None:
            request = decode_request(*frame)
            received.append(request)
            if request.reply is not None:
                writer.send(*answer_frame(frame[0]["id"], replies[request.reply]))

    stand_in = threading.Thread(target=engine_process, daemon=True)
    stand_in.start()

    async def use_every_call():
        client = EngineClient(Settings(models="m"), Metrics())
        reader, writer = await asyncio.open_connection(sock=ours)
        client._attach(reader, writer, Ready([{"name": "m"}], pid=1))
        client._ready(restarted=False)
        submission = await client.submit("m", [1, 2], SamplingParams(max_tokens=2, logit_bias={3: 1.0}), None, b"\x0f")
        submission.cancel()
        lease = await client.acquire("sess_a", "alice", KEY)
        assert (lease.id, lease.info, lease.has_history) == (9, INFO, True)
        await client.append(lease, [3, 4], score=True)
        assert await client.commit(lease, {"tokens": 2}) == INFO
        client.release(lease)
        assert await client.create_session("m", None, KEY) == (OTHER, False)
        assert await client.session_info("sess_a", "alice") == INFO
        assert await client.import_session("m", "alice", STATE, KEY) == (OTHER, False)
        assert await client.fork_session("sess_a", "alice", KEY) == (OTHER, False)
        assert await client.replace_state("sess_a", "alice", STATE, KEY) == (OTHER, False)
        assert await client.delete_session("sess_a", "alice", KEY) is False
        assert await client.list_sessions("alice", 20, None) == ([INFO, OTHER], True)
        assert await client.export("sess_a", "alice") == (INFO, STATE)
        await client.stop_admitting()
        assert await client.idle() is True
        assert await client.metrics_text() == b'xlserve_requests_running{model="m"} 0.0\n'
        client.closing = True  # the connection's end is no engine process dying
        writer.close()
        await asyncio.gather(client.reader_task, return_exceptions=True)

    asyncio.run(use_every_call())
    stand_in.join(timeout=10)
    assert {request.operation for request in received} == set(Operation)
    generate = next(request for request in received if isinstance(request, Generate))
    assert generate.prefix_scope == "0f" and generate.params == SamplingParams(max_tokens=2, logit_bias={3: 1.0})
    cancel = next(request for request in received if isinstance(request, Cancel))
    assert cancel.request_id == generate.request_id


def test_a_replayed_change_answers_what_the_first_request_was_answered():
    from xlserve.server.engine.client import _info_or_replay

    assert _info_or_replay(SessionChanged(replay=REPLAY)) == (OTHER, True)
    assert _info_or_replay(SessionChanged(info=INFO)) == (INFO, False)


def test_frames_round_trip_with_and_without_a_blob():
    frames = [({"op": "events", "events": [[1, "t", 65, "A", -0.5, [[65, -0.5]], 0]]}, None),
              ({"op": "answer", "id": 7, "ok": {"id": "sess_x"}}, b"\x00\x01safetensors bytes\xff"),
              ({"op": "answer", "id": 8, "ok": {}}, b"")]
    stream = io.BytesIO(b"".join(encode_frame(header, blob) for header, blob in frames))
    for header, blob in frames:
        got_header, got_blob = read_frame(stream)
        assert {k: v for k, v in got_header.items() if k != "blob"} == header
        assert got_blob == blob
    assert read_frame(stream) is None  # end of stream


def test_async_reader_reads_the_same_frames_and_sees_the_end():
    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(encode_frame({"op": "ready"}) + encode_frame({"op": "x"}, b"abc"))
        reader.feed_data(encode_frame({"op": "cut"})[:-2])  # a frame cut short by the process dying
        reader.feed_eof()
        return [await read_frame_async(reader) for _ in range(3)]

    first, second, third = asyncio.run(main())
    assert first == ({"op": "ready"}, None)
    assert second == ({"op": "x", "blob": 3}, b"abc")
    assert third is None


def test_errors_come_back_as_the_classes_the_status_table_knows():
    queue_full = QueueFull("3 waiting, limit 2", code="queue_full")
    back = error_from_wire(error_to_wire(queue_full))
    assert type(back) is QueueFull and back.message == queue_full.message and back.code == "queue_full"
    mapped = as_api_error(back)
    assert mapped.status == 429 and mapped.headers == {"Retry-After": "1"} and mapped.type == "rate_limit_error"

    back = error_from_wire(error_to_wire(ShuttingDown("draining", code="shutting_down")))
    assert type(back) is ShuttingDown and as_api_error(back).status == 503
    back = error_from_wire(error_to_wire(EngineGone("the engine process exited", code="engine_gone")))
    assert type(back) is EngineGone and as_api_error(back).code == "engine_gone"

    back = error_from_wire(error_to_wire(InvalidInput("bad state", param="body", code="invalid_state")))
    assert type(back) is InvalidInput and back.param == "body"
    assert as_api_error(back).status == 400 and as_api_error(back).param == "body"
    back = error_from_wire(error_to_wire(ModelNotFound.named("gpt", ["a", "b"])))
    assert type(back) is ModelNotFound and as_api_error(back).status == 404
    assert as_api_error(back).code == "model_not_found" and "gpt" in as_api_error(back).message

    for error in (SessionNotFound("sess_a"), SessionLocked("sess_a"), SessionConflict("sess_a")):
        back = error_from_wire(error_to_wire(error))
        assert type(back) is type(error) and back.session_id == "sess_a"
        assert as_api_error(back).body() == as_api_error(error).body()
        assert "sess_a" in as_api_error(back).message
    assert [as_api_error(e).status for e in (SessionNotFound("s"), SessionLocked("s"), SessionConflict("s"))] == \
        [404, 409, 409]
    back = error_from_wire(error_to_wire(CacheFull("device tier full", "sess_b")))
    assert type(back) is CacheFull and as_api_error(back).status == 503
    assert as_api_error(back).headers == {"Retry-After": "1"}

    assert type(error_from_wire(error_to_wire(Cancelled()))) is Cancelled
    assert isinstance(error_from_wire(error_to_wire(CorruptState("checksum"))), CorruptState)
    # a class outside the registry is an internal error: a 500 that does not leak the message
    for error in (ZeroDivisionError("secret detail"), ValueError("secret detail")):
        back = error_from_wire(error_to_wire(error))
        assert type(back) is RuntimeError
        assert as_api_error(back).status == 500 and "secret" not in as_api_error(back).message


def test_events_round_trip_through_json_and_the_last_one_is_known():
    import json

    events = [
        PromptLogprobs([97, 98], [None, -1.5], [[], [(98, -1.5), (99, -2.0)]]),
        TokenEvent(65, "A", -0.25, [(65, -0.25)], 1),
        TokenEvent(0xE2, "", float("-inf"), [], 0),  # part of a character: no text yet
        TokenEvent(120, "", -1.0, [], 0, 1),  # its character held back for a stop string
        ChoiceFinished(1, "stop", "", 3),
        Finished([ChoiceFinished(0, "length", "x", 2), ChoiceFinished(1, "stop", "", 3)], 5, 5, 40, data="state"),
        Appended(data="state", logprob=-12.5, scored=7),
    ]
    for event in events:
        request_id, back = event_from_wire(json.loads(json.dumps(event_to_wire(9, event))))
        assert request_id == 9
        if isinstance(event, (Finished, Appended)):  # the session state stays in the engine process
            assert back.data is None and back == type(event)(**{**event.__dict__, "data": None})
        else:
            assert back == type(event)(*[json.loads(json.dumps(v)) for v in event.__dict__.values()])
        assert is_last(back) == isinstance(event, (Finished, Appended))
    _, back = event_from_wire(event_to_wire(3, QueueFull("full", code="queue_full")))
    assert isinstance(back, QueueFull) and is_last(back)
    _, back = event_from_wire(event_to_wire(3, Cancelled()))
    assert isinstance(back, Cancelled) and is_last(back)


def test_a_change_in_flight_when_the_engine_process_dies_may_have_landed():
    """The engine process dies (its socket closes) while a commit, a create and a read await
    their answers: the read is told nothing happened and to send it again (engine_restarting),
    but the changes may have been written before the answer could be sent, so they are
    commit_outcome_unknown (no Retry-After): a blind resend without a key could apply twice."""
    from xlserve.server.cache.errors import CommitOutcomeUnknown
    from xlserve.server.engine.client import EngineClient, RemoteLease
    from xlserve.server.engine.errors import EngineRestarting
    from xlserve.server.metrics import Metrics
    from xlserve.server.settings import Settings

    ours, theirs = socket.socketpair()
    arrived = threading.Semaphore(0)

    def engine_process():  # reads three calls, answers none, dies
        stream = theirs.makefile("rb")
        for _ in range(3):
            read_frame(stream)
            arrived.release()
        for _ in range(3):
            arrived.acquire()
        theirs.close()

    stand_in = threading.Thread(target=engine_process, daemon=True)
    stand_in.start()

    async def calls_then_death():
        client = EngineClient(Settings(models="m"), Metrics())
        client._restart = lambda cause=None: asyncio.sleep(0)  # no real engine process is started
        reader, writer = await asyncio.open_connection(sock=ours)
        client._attach(reader, writer, Ready([{"name": "m"}], pid=1))
        client._ready(restarted=False)
        lease = RemoteLease(9, "sess_a", INFO, has_history=True, generation=client.generation)
        results = await asyncio.gather(client.commit(lease, {"tokens": 2}), client.create_session("m", None),
                                       client.session_info("sess_a", None), return_exceptions=True)
        writer.close()
        return results

    commit, create, read = asyncio.run(calls_then_death())
    stand_in.join(timeout=10)
    assert isinstance(commit, CommitOutcomeUnknown) and isinstance(create, CommitOutcomeUnknown)
    assert "may have landed" in str(commit) and "Idempotency-Key" in str(commit)
    assert isinstance(read, EngineRestarting)


def test_a_request_over_the_frame_the_engine_reads_fails_alone_before_it_is_sent(monkeypatch, tmp_path):
    """The engine process stops at a frame header over MAX_HEADER_BYTES (it cannot skip it without
    losing the stream), taking every request with it: a constraint's text under a raised
    XLSERVE_STRUCTURED_MAX_BYTES, say (a prompt's token ids cross as the blob). The API process
    refuses that request alone (413), sends nothing, and keeps no call waiting for it."""
    import asyncio

    import pytest

    from xlserve.server.engine import wire
    from xlserve.server.engine.client import EngineClient
    from xlserve.server.engine.errors import MessageTooLarge
    from xlserve.server.metrics import Metrics
    from xlserve.server.settings import Settings

    class Writer:
        written: list = []

        def write(self, data):
            self.written.append(data)

    monkeypatch.setattr(wire, "MAX_HEADER_BYTES", 1_000)
    client = EngineClient(Settings(models="none-loaded"), Metrics())
    client.status, client.writer = "ready", Writer()
    with pytest.raises(MessageTooLarge, match="over the 1,000 it reads"):
        asyncio.run(client.call(Generate(5, "m", [65] * 1_000, SamplingParams(
            max_tokens=4, constraint_kind="regex", constraint="a" * 2_000, constraint_param="guided_regex"))))
    assert client.writer.written == [] and client.calls == {} and client.changing_calls == set()
    assert (MessageTooLarge.http_status, MessageTooLarge.default_code) == (413, "message_too_large")


def test_a_large_request_goes_in_slices_with_the_loop_free_and_other_frames_after_it():
    """A state to import (237 MB at real size), written as one frame, was copied twice more by
    the transport on the event loop (every client held about 0.3 s) and held twice the state's
    memory meanwhile. Its blob now goes in PART_BYTES slices with the loop free between them;
    frames sent meanwhile follow it whole, and a request cancelled mid-way leaves the stream whole."""
    import time

    from xlserve.server.engine.client import EngineClient
    from xlserve.server.engine.wire import PART_BYTES, read_frame
    from xlserve.server.metrics import Metrics
    from xlserve.server.settings import Settings

    ours, theirs = socket.socketpair()
    state = bytes(range(256)) * (6 * PART_BYTES // 256)  # 6 slices
    received = bytearray()

    def slow_engine():  # takes the bytes slowly, so that the state's slices wait for it
        while chunk := theirs.recv(1 << 16):
            received.extend(chunk)
            time.sleep(0.002)

    reader = threading.Thread(target=slow_engine, daemon=True)

    async def write():
        client = EngineClient(Settings(models="m"), Metrics())
        _, writer = await asyncio.open_connection(sock=ours)
        client.status, client.writer = "ready", writer
        call = asyncio.create_task(client.call(ImportSession(model="m", owner=None, state=state, idempotency=None)))
        ticks = 0
        while client.frames_behind is None:  # until the state's frame is going out
            await asyncio.sleep(0)
        client.send(Cancel(7))  # a whole frame written meanwhile: it follows the state's
        while client.frames_behind is not None and ticks < 3:
            await asyncio.sleep(0.001)  # the loop is free while the slices go
            ticks += 1
        assert ticks == 3 and client.frames_behind is not None  # cancelled mid-way:
        call.cancel()
        while client.frames_behind is not None:  # the frame goes on to its end all the same
            await asyncio.sleep(0.001)
        client.send(Cancel(8))
        writer.close()
        await writer.wait_closed()  # everything written has gone
        assert call.cancelled()

    reader.start()
    asyncio.run(write())
    reader.join(timeout=10)
    stream = io.BytesIO(bytes(received))
    (first, blob), second, third = read_frame(stream), read_frame(stream), read_frame(stream)
    assert first["op"] == "import_session" and blob == state
    assert decode_request(*second) == Cancel(7) and decode_request(*third) == Cancel(8)
    assert read_frame(stream) is None


def test_a_large_request_cancelled_while_it_waits_its_turn_leaves_nothing_behind():
    """A state to import waits for the large frame before it; cancelled meanwhile, it has
    registered no call (whose failure, at the engine's end, nobody would read) and written
    nothing; one whose engine process was replaced meanwhile is refused, never sent to the new one."""
    from xlserve.server.engine.client import EngineClient
    from xlserve.server.engine.wire import PART_BYTES
    from xlserve.server.metrics import Metrics
    from xlserve.server.settings import Settings

    ours, theirs = socket.socketpair()
    state = bytes(2 * PART_BYTES)

    async def wait_then_cancel():
        client = EngineClient(Settings(models="m"), Metrics())
        _, writer = await asyncio.open_connection(sock=ours)
        client.status, client.writer = "ready", writer
        await client.large_write.acquire()  # another large frame is going out
        call = asyncio.create_task(client.call(ImportSession(model="m", owner=None, state=state, idempotency=None)))
        await asyncio.sleep(0.01)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        assert call.cancelled() and client.calls == {} and not client.changing_calls
        replaced = asyncio.create_task(client.call(ImportSession(model="m", owner=None, state=state,
                                                                 idempotency=None)))
        await asyncio.sleep(0.01)
        client.generation += 1  # the engine process was replaced while it waited
        client.large_write.release()
        assert isinstance((await asyncio.gather(replaced, return_exceptions=True))[0], Exception)
        assert client.calls == {} and not client.large_write.locked()
        writer.close()
        await writer.wait_closed()

    asyncio.run(wait_then_cancel())
    theirs.settimeout(5)
    assert theirs.recv(1) == b""  # the connection's end, and nothing written before it
