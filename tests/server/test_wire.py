"""The framing and error transport between the API process and the engine process."""

import asyncio
import io

from xlserve.server.cache import CacheFull, CorruptState, SessionConflict, SessionLocked, SessionNotFound
from xlserve.server.api.errors import as_api_error
from xlserve.server.engine.errors import (
    Cancelled, EngineGone, InvalidInput, ModelNotFound, QueueFull, ShuttingDown,
)
from xlserve.server.engine.types import Appended, ChoiceFinished, Finished, PromptLogprobs, TokenEvent
from xlserve.server.engine.wire import (
    encode_frame, error_from_wire, error_to_wire, event_from_wire, event_to_wire, is_last, read_frame,
    read_frame_async,
)


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
