"""Certain commits against a real redis-server that the tests pause (SIGSTOP) and resume
(SIGCONT): a client is never told a commit failed when it landed, nor that it landed when it did
not; a retry with the same Idempotency-Key applies at most once; and while Redis hangs, every
other request waits at most its own store timeout instead of queueing behind the hung one.

Every wait is bounded; the only timing claim is "within the store timeout plus a margin"."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from xlserve.server.cache import (
    CommitOutcomeUnknown,
    SessionConflict,
    SessionUnavailable,
)
from xlserve.server.cache.session_cache import SessionCache
from xlserve.server.cache.stores import RedisStore, StoreUnavailable
from tests.redis_server import RedisServer, redis_server  # noqa: F401 (redis_server: a fixture)
from tests.server.cache_helpers import MODEL, data, same

STORE_TIMEOUT = 0.5  # seconds: each Redis call
MARGIN = 3.0  # seconds of slack on a loaded machine, for the one timing claim



class Paused:
    """Redis stopped (SIGSTOP) for the block, and running again after it, whatever happens."""

    def __init__(self, server: RedisServer):
        self.server = server

    def __enter__(self):
        os.kill(self.server.process.pid, signal.SIGSTOP)
        return self

    def resume(self) -> None:
        os.kill(self.server.process.pid, signal.SIGCONT)

    def __exit__(self, *exc):
        self.resume()


def replica(tmp_path, name: str, url: str, settle_s: float = 10.0, **budgets) -> SessionCache:
    cache = SessionCache(tmp_path / name, budgets.get("device"), budgets.get("host"), budgets.get("disk"),
                         redis_url=url, store_timeout_s=STORE_TIMEOUT, settle_s=settle_s)
    cache.open({"toy": MODEL})
    return cache


def key(name: str, fingerprint: str = "append-once") -> dict:
    return {"key": name, "fingerprint": fingerprint}


def test_a_write_that_timed_out_lands_on_resume_and_settle_says_so(redis_server):
    store = RedisStore(redis_server.url, prefix="certainty-store:", timeout_s=STORE_TIMEOUT)
    session = "sess_" + "1" * 32
    assert store.put(session, None, 0, {"tokens": 0}, b"zero", "first") == 1
    with Paused(redis_server):
        with pytest.raises(StoreUnavailable):  # the command waits in the paused server's socket
            store.put(session, 0, 1, {"tokens": 1}, b"one", "late")
    assert store.settle(session, "late") is True  # it landed when Redis resumed
    assert store.head(session).version == 1
    store.delete(session)
    store.close()


def test_settle_fences_a_write_that_has_not_arrived(redis_server):
    store = RedisStore(redis_server.url, prefix="certainty-fence:", timeout_s=STORE_TIMEOUT)
    session = "sess_" + "2" * 32
    assert store.put(session, None, 0, {"tokens": 0}, b"zero", "first") == 1
    assert store.settle(session, "slow") is False  # not there: and now it never will be
    assert store.put(session, 0, 1, {"tokens": 1}, b"one", "slow") == -1
    assert store.get(session) == (0, {"tokens": 0}, b"zero")
    assert store.put(session, 0, 1, {"tokens": 1}, b"one", "another") == 1  # other writes are not affected
    store.delete(session)
    store.close()


def test_a_commit_paused_then_resumed_is_answered_as_it_landed(tmp_path, redis_server):
    cache = replica(tmp_path, "a", redis_server.url, settle_s=30.0)
    witness = replica(tmp_path, "witness", redis_server.url)  # another replica: sees only what Redis holds
    sid = cache.create("toy", None, data(10, 0, tokens=5)).id
    lease = cache.acquire(sid, None, key("k1"))
    outcome = {}

    def commit():
        try:
            outcome["info"] = cache.commit(lease, data(10, 1, tokens=9), {**key("k1"), "result": {"answer": 1}})
        except Exception as error:  # noqa: BLE001 - the outcome is what the test compares
            outcome["error"] = error

    with Paused(redis_server) as paused:
        committing = threading.Thread(target=commit)
        committing.start()
        committing.join(STORE_TIMEOUT * 3)  # the write has timed out by now; the commit is settling
        assert committing.is_alive(), outcome  # no answer while Redis cannot say whether it landed
        paused.resume()
        committing.join(60)
    assert not committing.is_alive()
    cache.release(lease)

    stored = witness.info(sid, None)
    if "info" in outcome:  # told it landed: it did, exactly once
        assert (outcome["info"].version, stored.version, stored.tokens) == (1, 1, 9)
    else:  # told it did not: it did not, and never will
        assert isinstance(outcome["error"], SessionUnavailable), outcome
        assert not isinstance(outcome["error"], CommitOutcomeUnknown)
        assert (stored.version, stored.tokens) == (0, 5)
    time.sleep(STORE_TIMEOUT)
    assert witness.info(sid, None).version == stored.version  # nothing lands later

    retry = cache.acquire(sid, None, key("k1"))  # the client retries with the same key
    if retry.replay is not None:
        assert "info" in outcome and retry.replay["result"] == {"answer": 1}
    else:
        cache.commit(retry, data(10, 1, tokens=9), {**key("k1"), "result": {"answer": 1}})
        cache.release(retry)
    assert (witness.info(sid, None).version, witness.info(sid, None).tokens) == (1, 9)  # applied once
    assert cache.acquire(sid, None, key("k1")).replay is not None


def test_outcome_unknown_then_a_retry_with_the_key_applies_once_and_others_never_queue(tmp_path, redis_server):
    cache = replica(tmp_path, "b", redis_server.url, settle_s=1.0)
    witness = replica(tmp_path, "witness-b", redis_server.url)
    sid = cache.create("toy", None, data(10, 0, tokens=5)).id
    others = [cache.create("toy", None, data(10, 10 + i)).id for i in range(8)]
    lease = cache.acquire(sid, None, key("k2"))
    outcome = {}

    def commit():
        try:
            outcome["info"] = cache.commit(lease, data(10, 2, tokens=12), {**key("k2"), "result": {"answer": 2}})
        except Exception as error:  # noqa: BLE001
            outcome["error"] = error

    def other_request(session_id: str):
        started = time.monotonic()
        try:
            cache.release(cache.acquire(session_id, None))
            answer = "served"
        except SessionUnavailable:
            answer = "unavailable"
        return answer, time.monotonic() - started

    with Paused(redis_server):
        committing = threading.Thread(target=commit)
        committing.start()
        time.sleep(STORE_TIMEOUT / 2)  # the commit holds its write in the paused server
        with ThreadPoolExecutor(len(others)) as pool:  # every other request at once, while the commit hangs
            answers = list(pool.map(other_request, others))
        committing.join(60)
        assert not committing.is_alive()
        # Redis stayed silent for the whole settle wait: the honest answer is "not known"
        assert isinstance(outcome.get("error"), CommitOutcomeUnknown), outcome
        assert "GET /v1/sessions/" in str(outcome["error"]) and "Idempotency-Key" in str(outcome["error"])
    cache.release(lease)
    for answer, seconds in answers:  # each waited its own timeout, not the others' in turn
        assert answer == "unavailable"
        assert seconds < STORE_TIMEOUT + MARGIN

    for attempt in range(20):  # the client retries with the same key until it gets an answer
        try:
            retry = cache.acquire(sid, None, key("k2"))
        except SessionConflict:  # a write that landed a moment ago: ask again
            continue
        if retry.replay is not None:
            assert retry.replay["result"] == {"answer": 2}
            break
        try:
            cache.commit(retry, data(10, 2, tokens=12), {**key("k2"), "result": {"answer": 2}})
            break
        except SessionConflict:  # the first write landed meanwhile: the next attempt replays it
            continue
        finally:
            cache.release(retry)
    stored = witness.info(sid, None)
    assert (stored.version, stored.tokens) == (1, 12)  # applied exactly once
    lease = witness.acquire(sid, None)
    assert same(lease.data, data(10, 2, tokens=12))
    witness.release(lease)
    for session_id in others:  # and the others are served again
        assert other_request(session_id)[0] == "served"
