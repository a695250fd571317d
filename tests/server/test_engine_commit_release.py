"""A commit that has begun is not undone by the release behind it (server/engine/process.py).

The API process sends Release when it leaves a session's block, whatever happened in it: a
client that hung up while its commit was on its way (a websocket closed, an SSE stream dropped
during `await commit`) sends Commit and Release one right behind the other. Commits run on the
engine process's session-op pool; releases on its reader thread, at once. The commit must still
land, and the lease go only after it (cancellation.py's rule: once the commit has begun, a cancel
changes nothing)."""

import threading

import pytest
import torch

from tests.server.engine_process_helpers import engine_process
from tests.server.polling import eventually


def test_a_release_right_behind_a_commit_waits_for_it(tmp_path):
    from xlserve.server.engine.process import SESSION_OP_THREADS
    from xlserve.server.engine.wire import (Acquire, Append, Commit, CreateSession, GetSession, Release,
                                           read_frame, request_frame)

    with engine_process(tmp_path) as (process, ours), ours.makefile("rb") as stream:
        info = process.create_session(CreateSession("tiny", None)).info
        lease = process.acquire(Acquire(info.id, None)).lease
        process.dispatch(*request_frame(Append(7, lease, list(b"a chunk of a document")), call_id=1))
        assert eventually(lambda: lease in process.results, seconds=60), "the append did not finish"

        # every session-op thread busy: the commit waits in the pool's queue, as it may behind
        # another session's disk or Redis I/O, while the release behind it is read at once
        busy = threading.Event()
        for _ in range(SESSION_OP_THREADS):
            process.pool.submit(busy.wait, 60)
        process.dispatch(*request_frame(Commit(lease), call_id=2))
        process.dispatch(*request_frame(Release(lease)))
        # the client's retry (another acquire of the session) waits for the commit instead of
        # 409 session_busy: the hold is the commit's now
        retried = {}

        def retry():
            try:
                retried["lease"] = process.acquire(Acquire(info.id, None))
            except Exception as error:  # noqa: BLE001 (reported by the assertion below)
                retried["error"] = error

        retrying = threading.Thread(target=retry)
        retrying.start()
        retrying.join(0.5)
        assert retried == {}, retried  # neither refused nor served while the commit waits
        busy.set()
        retrying.join(60)
        assert "lease" in retried, retried
        assert retried["lease"].info.version == info.version + 1  # it starts from the committed state
        process.release(Release(retried["lease"].lease))

        answer = None
        while answer is None:
            frame = read_frame(stream)
            assert frame is not None, "the engine process closed its end"
            header, _ = frame
            if header.get("id") == 2:
                answer = header
        assert "error" not in answer, answer["error"]
        assert answer["ok"]["info"]["version"] == info.version + 1
        assert process.get_session(GetSession(info.id, None)).info.version == info.version + 1
        assert eventually(lambda: not process.leases, seconds=10)  # every lease released
        again = process.acquire(Acquire(info.id, None))  # nobody holds the session any more
        process.release(Release(again.lease))


@pytest.mark.parametrize("operation", ["generate", "append"])
def test_a_state_kept_in_16_bits_is_converted_off_the_reader_thread(operation):
    """With XLSERVE_STATE_DTYPE bfloat16 a leased state is converted to the model's float32 for
    its request: a copy of the whole state (237 MB at transfo-xl-wt103's shape), made on the
    session-op threads, not the reader thread that must read every cancel meanwhile; a cancel
    sent before it is queued still reaches it. A state already in the model's dtypes is queued
    at once, as before."""
    import threading
    from types import SimpleNamespace

    from tests.server.test_engine import xl_model
    from xlserve.server.cache.codec import SessionData
    from xlserve.server.engine import process
    from xlserve.server.engine.types import SamplingParams
    from xlserve.server.engine.wire import Append, Cancel, Generate

    model = xl_model()
    queued = []
    engine = SimpleNamespace(model=model, check_context=lambda *args: None, prefix_lookup_waits=False,
                             enqueue=queued.append, wake=lambda: None)
    handler = process.EngineProcess.__new__(process.EngineProcess)  # the handler's own state only
    handler.models = {"m": SimpleNamespace(engine=engine)}
    handler.lock, handler.requests, handler.pool = threading.Lock(), {}, object()
    info = SimpleNamespace(owner=None, model="m")
    with torch.inference_mode():
        _, state = model(torch.tensor([[1, 2, 3]]), model.init_state(1))
    data = SessionData(state=state, tokens=3, next_log_probs=None)
    handler.leases = {1: SimpleNamespace(data=data, info=info),
                      2: SimpleNamespace(data=data.cast_state(torch.bfloat16), info=info)}

    def send(request_id: int, lease: int):
        if operation == "generate":
            return handler.generate(Generate(request_id, "m", [4], SamplingParams(max_tokens=1), lease=lease))
        return handler.append(Append(request_id, lease, [4], False))

    assert not isinstance(send(10, 1), process.Deferred) and len(queued) == 1  # float32: at once
    deferred = send(11, 2)
    assert isinstance(deferred, process.Deferred) and deferred.pool is handler.pool and len(queued) == 1
    handler.cancel(Cancel(11))  # sent before the conversion ended
    deferred.work()
    started = queued[-1]
    assert started.cancelled.is_set()
    assert {t.dtype for t in started.start.state.to_tensors().values() if t.is_floating_point()} == {torch.float32}
