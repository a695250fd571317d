"""A generation's way into the engine process (server/engine/process.py `generate`, and the API
side's `EngineClient._queue`): what fails or leaves on the way leaves nothing behind, and the
reader thread never compiles a constraint.

- A generation deferred to the session-op pool (a constraint compiled for the first time, a
  prefix lookup that may read a file) stands in the request table until it is queued; if it fails
  before that (its lease gone, its start state not made), the stand-in goes with it.
- A constraint found compiled on the reader thread is handed to the request as it was found: if
  another compile pushed it out of the cache before the request was queued, the scheduler would
  compile it again there, holding up every other frame (a cancel among them) for up to its limit.
- A caller that leaves before the engine answered its Generate (its task cancelled) cancels the
  request in the engine, which may have queued it: nobody would ever read that stream."""

import asyncio
import socket
import threading

import pytest

from tests.server.engine_process_helpers import engine_process


@pytest.fixture
def process(tmp_path):
    with engine_process(tmp_path) as (running, _):
        yield running


def regex_params(pattern: str):
    from xlserve.server.engine.types import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0)
    params.constraint_kind, params.constraint, params.constraint_param = "regex", pattern, "guided_regex"
    return params


def test_a_deferred_generation_that_fails_before_it_is_queued_leaves_no_stand_in(process):
    from xlserve.server.engine.process import Deferred
    from xlserve.server.engine.wire import Generate

    deferred = process.generate(Generate(5, "tiny", list(b"x"), regex_params("a+b"), lease=12345))  # no such lease
    assert isinstance(deferred, Deferred) and 5 in process.requests  # compiled first, off the reader thread
    with pytest.raises(ValueError, match="no lease 12345"):
        deferred.work()
    assert 5 not in process.requests


def test_a_constraint_found_compiled_is_never_compiled_on_the_reader_thread(process):
    from xlserve.server.engine.process import Deferred
    from xlserve.server.engine.wire import Generate

    engine = process.models["tiny"].engine
    constraints = engine.constraints
    constraints.matcher("regex", "(ab)+", "guided_regex")  # compiled and cached
    compiled_on = []
    compile = constraints._compile

    def watched(*args):
        compiled_on.append(threading.current_thread().name)
        return compile(*args)

    constraints._compile = watched
    enqueue = engine.enqueue

    def evicted_first(request):  # another request's compile pushed it out meanwhile
        constraints._cache.clear()
        enqueue(request)

    engine.enqueue = evicted_first
    answer = process.generate(Generate(6, "tiny", list(b"x"), regex_params("(ab)+")))
    assert not isinstance(answer, Deferred)
    assert compiled_on == []


def test_a_caller_that_leaves_before_the_answer_cancels_its_request(tmp_path):
    from xlserve.server.engine.client import EngineClient
    from xlserve.server.engine.types import SamplingParams
    from xlserve.server.engine.wire import read_frame
    from xlserve.server.metrics import Metrics
    from xlserve.server.settings import Settings

    async def scenario(theirs: socket.socket) -> None:
        client = EngineClient(Settings(models=str(tmp_path), state_dir=tmp_path / "state"), Metrics())
        _, client.writer = await asyncio.open_connection(sock=theirs)
        client.status = "ready"
        task = asyncio.create_task(client.submit("tiny", [1, 2], SamplingParams(max_tokens=4), None))
        await asyncio.sleep(0.05)  # sent; the engine's answer never comes
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.submissions == {}
        await client.writer.drain()
        client.writer.close()

    ours, theirs = socket.socketpair()
    with ours:
        asyncio.run(scenario(theirs))
        stream = ours.makefile("rb")
        frames = []
        while (frame := read_frame(stream)) is not None:
            frames.append(frame[0])
    generate, cancel = frames
    assert generate["op"] == "generate" and (cancel["op"], cancel["request_id"]) == ("cancel", generate["request_id"])


def test_a_request_the_queue_refuses_does_no_prefix_lookup(process):
    """The prefix lookup ran before the queue's check: a request about to be refused (429 with a
    full queue, 503 while shutting down) still read, fetched or copied its cached prefix (hundreds
    of MB at real size) and counted its tokens as queried and hit, so clients retrying their 429s
    inflated the hit rate while nothing was reused."""
    from xlserve.server.cache.prefix_cache import scope_key
    from xlserve.server.engine.errors import ShuttingDown
    from xlserve.server.engine.types import SamplingParams
    from xlserve.server.engine.wire import Generate

    engine = process.models["tiny"].engine
    assert engine.prefix_cache is not None
    looked_up = []
    lookup = engine.prefix_cache.lookup
    engine.prefix_cache.lookup = lambda *args, **kwargs: looked_up.append(args) or lookup(*args, **kwargs)
    engine.stop_admitting()
    scope = scope_key("tiny", None, None).hex()
    with pytest.raises(ShuttingDown):
        process.generate(Generate(7, "tiny", list(b"hello"), SamplingParams(max_tokens=2), prefix_scope=scope))
    assert looked_up == [] and 7 not in process.requests
    queried = [sample.value for family in engine.metrics.registry.collect() for sample in family.samples
               if sample.name == "xlserve_prefix_cache_queries_total"]
    assert sum(queried) == 0
