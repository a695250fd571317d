"""XLSERVE_MAX_SESSIONS_PER_KEY: how many sessions one owner (API key) may hold, over every replica.

At real size a session is hundreds of MB (a transfo-xl-wt103 session 237 MB, 289 of them fill the
disk tier's default 64 GiB): without a bound, one key could take every place and every other key's
creates would be refused. The real stores (disk; two replicas on one real redis-server) and a toy
state: no model runs."""

import threading
import time

import pytest

from xlserve.server.cache import SessionNotFound
from xlserve.server.cache.errors import SessionQuotaExceeded
from xlserve.server.cache.session_cache import Replay, SessionCache
from tests.redis_server import redis_url  # noqa: F401  (fixture)
from tests.server.cache_helpers import MODEL, data


def cache_at(directory, limit: int, url: str = "") -> SessionCache:
    cache = SessionCache(directory, None, None, None, redis_url=url, max_sessions_per_key=limit)
    cache.open({"toy": MODEL})
    return cache


def refused(make) -> str:
    with pytest.raises(SessionQuotaExceeded) as caught:
        make()
    return str(caught.value)


def test_a_key_at_its_bound_makes_no_session_and_other_keys_still_do(tmp_path):
    cache = cache_at(tmp_path / "state", 2)
    first = cache.create("toy", "a", data(10, 0)).id
    cache.create("toy", "a", data(10, 1))
    files = sorted(p.name for p in (tmp_path / "state").iterdir())
    message = refused(lambda: cache.create("toy", "a", data(10, 2)))
    assert "XLSERVE_MAX_SESSIONS_PER_KEY (2)" in message and "holds 2 sessions" in message
    refused(lambda: cache.import_new("toy", "a", data(10, 3)))
    refused(lambda: cache.fork(first, "a"))
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == files  # nothing was written
    assert cache.manager.owned("a") == 2
    # another key is not held back by the first's sessions, nor is a client without a key
    assert cache.create("toy", "b", data(10, 4)).id
    assert cache.create("toy", None, data(10, 5)).id
    # a delete gives the place back
    cache.delete(first, "a")
    assert cache.fork(cache.list_sessions("a")[0][0].id, "a").id
    refused(lambda: cache.create("toy", "a", data(10, 6)))
    cache.close()


def test_a_keyed_retry_of_a_create_is_answered_at_the_bound(tmp_path):
    """A retry with the Idempotency-Key of a session already made is that session, not a new one:
    the bound never refuses it."""
    cache = cache_at(tmp_path / "state", 1)
    key = {"key": "k1", "fingerprint": "create"}
    made = cache.create("toy", "a", data(10, 0), key)
    again = cache.create("toy", "a", data(10, 0), key)
    assert isinstance(again, Replay) or again.id == made.id
    refused(lambda: cache.create("toy", "a", data(10, 1), {"key": "k2", "fingerprint": "create"}))
    cache.close()


def test_the_bound_counts_the_sessions_found_at_start(tmp_path):
    cache = cache_at(tmp_path / "state", 0)  # no bound
    for seed in range(3):
        cache.create("toy", "a", data(10, seed))
    cache.close()
    cache = cache_at(tmp_path / "state", 3)
    assert cache.manager.owned("a") == 3
    refused(lambda: cache.create("toy", "a", data(10, 9)))
    assert cache.create("toy", "b", data(10, 9)).id
    cache.close()


def test_replicas_on_one_redis_count_each_others_sessions(tmp_path, redis_url):  # noqa: F811
    a, b = cache_at(tmp_path / "a", 2, redis_url), cache_at(tmp_path / "b", 2, redis_url)
    on_a = a.create("toy", "q", data(10, 0)).id
    on_b = b.create("toy", "q", data(10, 1)).id
    refused(lambda: a.create("toy", "q", data(10, 2)))  # b's session counts on a
    refused(lambda: b.fork(on_a, "q"))
    assert a.create("toy", "r", data(10, 3)).id
    b.delete(on_b, "q")  # deleted on the other replica: its place is free on this one
    with pytest.raises(SessionNotFound):
        a.info(on_b, "q")
    assert a.create("toy", "q", data(10, 4)).id
    refused(lambda: b.create("toy", "q", data(10, 5)))
    a.close(), b.close()


def test_one_replica_s_creates_at_once_stay_within_the_bound(tmp_path, redis_url):  # noqa: F811
    """(Its own owner: the module's Redis holds the other tests' sessions.) With Redis the owner's
    sessions are counted by a scan of Redis, which a create running beside
    it could miss: eight creates at once for a key one place short of its bound, each scan slow
    (as among many sessions), made one session, not eight."""
    cache = cache_at(tmp_path / "a", 3, redis_url)
    for seed in range(2):
        cache.create("toy", "burst", data(10, seed))
    scan = cache.durable.heads

    def slow_scan(*args):
        heads = scan(*args)
        time.sleep(0.2)  # the others' writes land meanwhile
        return heads

    cache.durable.heads = slow_scan
    outcomes = []

    def create(seed: int) -> None:
        from xlserve.server.cache.errors import SessionQuotaBusy

        try:
            outcomes.append(cache.create("toy", "burst", data(10, seed)).id)
        except (SessionQuotaExceeded, SessionQuotaBusy):  # past the bound, or not its turn within a second
            outcomes.append(None)

    threads = [threading.Thread(target=create, args=(seed,)) for seed in range(10, 18)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(outcomes) == 8 and sum(o is not None for o in outcomes) == 1
    cache.durable.heads = scan
    assert len(cache.list_sessions("burst", limit=100)[0]) == 3
    cache.close()


def test_a_key_waits_its_turn_a_second_at_most_and_another_key_not_at_all(tmp_path, redis_url):  # noqa: F811
    """A replica makes one key's sessions one at a time (with Redis, their count is a scan): a
    create waiting behind another of its key's longer than OWNER_TURN_SECONDS is 429
    sessions_being_made, so that one key's burst of creates parks no session-op thread for
    long; another key's create never waits for that key's turn."""
    from xlserve.server.cache import session_cache
    from xlserve.server.cache.errors import SessionQuotaBusy

    cache = cache_at(tmp_path / "a", 5, redis_url)
    write, entered, release = cache.durable.write, threading.Event(), threading.Event()

    def slow_write(record, *args, **kwargs):  # a large import, seconds of writing at real size
        if record.owner == "turns":
            entered.set()
            release.wait(10)
        return write(record, *args, **kwargs)

    cache.durable.write = slow_write
    first = threading.Thread(target=lambda: cache.create("toy", "turns", data(10, 0)))
    first.start()
    assert entered.wait(10)
    started = time.monotonic()
    with pytest.raises(SessionQuotaBusy):
        cache.create("toy", "turns", data(10, 1))
    assert session_cache.OWNER_TURN_SECONDS <= time.monotonic() - started < 5
    assert cache.create("toy", "another", data(10, 2)).id  # its own turn: not held up
    release.set()
    first.join(10)
    assert cache.create("toy", "turns", data(10, 3)).id and cache._owner_turns == {}
    cache.close()
