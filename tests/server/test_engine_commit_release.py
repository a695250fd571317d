"""A commit that has begun is not undone by the release behind it (server/engine/process.py).

The API process sends Release when it leaves a session's block, whatever happened in it: a
client that hung up while its commit was on its way (a websocket closed, an SSE stream dropped
during `await commit`) sends Commit and Release one right behind the other. Commits run on the
engine process's session-op pool; releases on its reader thread, at once. The commit must still
land, and the lease go only after it (cancellation.py's rule: once the commit has begun, a cancel
changes nothing)."""

import threading

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
