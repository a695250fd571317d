"""A consumer that stops reading holds a bounded amount: a request's events wait in its
Submission up to MAX_UNREAD_LOGPROBS (a token's own log-probability and its alternatives', one
for any other event), past which the request stops with StreamNotRead and what waited is let
go; a batch of prompts shares the bound out and merges into a bounded queue, so its forwarders
pass the waiting back to each prompt's submission instead of holding it themselves."""

from __future__ import annotations

import asyncio
import threading

import pytest

from xlserve.server.api.protocol import MAX_GENERATED_LOGPROBS
from xlserve.server.api.serving.generation import MERGED_EVENTS_WAITING, PromptBatch
from xlserve.server.engine.errors import StreamNotRead
from xlserve.server.engine.types import MAX_UNREAD_LOGPROBS, Finished, Submission, TokenEvent
from xlserve.server.metrics import Metrics

METRICS = Metrics()


def token(i: int, alternatives: int = 4) -> TokenEvent:
    return TokenEvent(token=i % 256, text="x", logprob=-1.0, top=[(j, -2.0) for j in range(alternatives)])


def submission(stops: list | None = None) -> Submission:
    cancelled = threading.Event()
    made = Submission("m", METRICS, cancelled, wake=lambda: (stops.append(True) if stops is not None else None))
    return made


def test_the_bound_is_what_an_answer_that_is_not_streamed_may_hold():
    assert MAX_UNREAD_LOGPROBS == MAX_GENERATED_LOGPROBS


def test_a_consumer_that_reads_is_never_stopped():
    async def run():
        handle = submission()
        handle.unread_limit = 50
        events = handle.events()
        for i in range(1000):  # 5,000 log-probabilities in all, 5 at a time
            handle.put(token(i))
            assert (await anext(events)).token == i % 256
        assert handle.unread == 0 and not handle.overrun and not handle.cancelled.is_set()
        handle.put(Finished(choices=[], prompt_tokens=1, completion_tokens=1000, cached_tokens=0, data=None))
        assert isinstance(await anext(events), Finished)

    asyncio.run(run())


def test_past_the_bound_the_request_stops_and_what_waited_is_let_go():
    async def run():
        stops = []
        handle = submission(stops)
        handle.unread_limit = 100
        for i in range(20):  # 20 x (1 + 4) = 100: at the bound, still held
            handle.put(token(i))
        assert handle.queue.qsize() == 20 and not handle.overrun
        handle.put(token(20))  # one past it
        assert handle.overrun and handle.cancelled.is_set() and stops == [True]  # the engine drops the request
        assert handle.queue.qsize() == 1  # the waiting events let go: only why remains
        for i in range(1000):  # what the engine still sends before it drops the request is not kept
            handle.put(token(i))
        assert handle.queue.qsize() == 1
        with pytest.raises(StreamNotRead, match="more than 100 log-probabilities"):
            await anext(handle.events())

    asyncio.run(run())


def test_a_batch_of_prompts_shares_the_bound_and_its_merged_queue_is_bounded():
    async def run():
        handles = [submission() for _ in range(4)]
        batch = PromptBatch(handles, n=1)
        assert [handle.unread_limit for handle in handles] == [MAX_UNREAD_LOGPROBS // 4] * 4
        for handle in handles:
            handle.unread_limit = 2_000  # small enough to pass here: 400 events of weight 5
        events = batch.events()
        for i in range(1000):  # nobody reads the batch: 4,000 events, more than the merged queue takes
            for handle in handles:
                handle.put(token(i))
            await asyncio.sleep(0)  # the forwarders run
        assert batch.queue.qsize() <= MERGED_EVENTS_WAITING
        assert all(handle.overrun for handle in handles)  # each prompt's waiting events hit its share
        with pytest.raises(StreamNotRead):
            async for _ in events:  # what was merged first, then why it stopped
                pass

    asyncio.run(run())


def test_a_batch_that_fails_stops_every_prompt_even_one_whose_forwarder_never_ran():
    """A prompt whose forwarder was cancelled before its first step never entered its
    submission's events(), whose cleanup stops the engine request: it ran to its end for nobody."""
    async def run():
        stops = [[] for _ in range(2)]
        handles = [submission(stops[i]) for i in range(2)]
        batch = PromptBatch(handles, n=1)
        batch.forwarders[1].cancel()  # cancelled before it first ran
        handles[0].put(RuntimeError("the first prompt failed"))
        with pytest.raises(RuntimeError, match="the first prompt failed"):
            async for _ in batch.events():
                pass
        assert handles[1].cancelled.is_set() and stops[1]

    asyncio.run(run())


def test_a_backlog_is_written_in_turns_of_at_most_write_chunks():
    """Chunks ready together go out in one write, but a backlog (2,000 tokens waiting when the
    stream starts, as after a client that read slowly) goes out WRITE_CHUNKS at a time, each
    write giving the event loop back, never as one join of everything."""
    from xlserve.models.tokenizer import ByteTokenizer
    from xlserve.server.api.deps import ServedModel
    from xlserve.server.api.serving.completions import WRITE_CHUNKS
    from xlserve.server.engine.types import ChoiceFinished
    from xlserve.server.settings import Settings
    from tests.server.scripted_engine import ScriptedEngine, scripted_app

    engine = ScriptedEngine(Metrics())
    engine.events = [token(i) for i in range(2000)]
    end = ChoiceFinished(0, "length", "", 2000)
    engine.events += [end, Finished(choices=[end], prompt_tokens=1, completion_tokens=2000, cached_tokens=0, data=None)]
    app, _ = scripted_app(Settings(models="none-loaded"), engine, {"m": ServedModel("m", ByteTokenizer(), 256, {})})
    body = b'{"model": "m", "prompt": "a", "max_tokens": 2000, "stream": true}'
    writes = []

    async def run():
        sent_body = False

        async def receive():
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)  # the client stays

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                writes.append(message["body"].count(b"data: "))

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                                  (b"content-length", str(len(body)).encode())],
                 "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1),
                 "root_path": "", "app": app}
        await asyncio.wait_for(app(scope, receive, send), 60)

    asyncio.run(run())
    assert sum(writes) == 2000 + 2  # every token's chunk, the finish chunk and [DONE]
    assert max(writes) <= WRITE_CHUNKS and len(writes) >= 2000 // WRITE_CHUNKS


def test_streams_that_each_stay_under_their_bound_are_bounded_together(monkeypatch):
    """Each stream's bound alone lets clients that read just fast enough to stay under it pin
    MAX_UNREAD_LOGPROBS each (about 230 MB of events): past MAX_UNREAD_IN_PROCESS together, the
    stream that leaves the most unread stops with StreamNotRead, and the others go on."""
    from xlserve.server.engine import types

    monkeypatch.setattr(types, "MAX_UNREAD_IN_PROCESS", 200)
    monkeypatch.setattr(types, "UNREAD_CHECK_STEP", 10)

    async def run():
        stops = []
        slow, slower, reader = submission(stops), submission(stops), submission()
        events = reader.events()
        for i in range(16):  # 80 each, 160 in all: under the bound
            slow.put(token(i))
            slower.put(token(i))
        for i in range(100):  # a stream that reads as it goes adds nothing
            reader.put(token(i))
            await anext(events)
        assert not slow.overrun and not slower.overrun and stops == []
        for i in range(10):  # slower goes on to 130, 210 in all: the largest stops
            slower.put(token(i))
        assert slower.overrun and not slow.overrun and not reader.overrun and stops == [True]
        with pytest.raises(StreamNotRead, match="unread together, this one the most"):
            async for _ in slower.events():
                pass
        slow.put(token(0))  # the other stream goes on
        assert not slow.overrun

    asyncio.run(run())
