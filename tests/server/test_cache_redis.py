"""Two session caches (two replicas) sharing one real redis-server: compare-and-set on versions."""

import time

import pytest

import redis

from xlserve.server.cache import CacheFull, SessionConflict, SessionNotFound
from xlserve.server.cache.ledger import REMEMBERED_BYTES_PER_SESSION, kept, new_entry
from xlserve.server.cache.session_cache import Replay, SessionCache
from xlserve.server.cache.stores import RedisStore
from xlserve.server.metrics import Metrics
from tests.redis_server import redis_url  # noqa: F401  (fixture)
from tests.server.cache_helpers import MODEL, data, same, size


def replica(tmp_path, name, url, **budgets) -> SessionCache:
    cache = SessionCache(tmp_path / name, budgets.get("device"), budgets.get("host"), budgets.get("disk"), redis_url=url)
    cache.open({"toy": MODEL})
    return cache


def test_cas_refuses_a_stale_version(redis_url):  # noqa: F811
    store = RedisStore(redis_url, prefix="test-cas:")
    assert store.put("s", None, 0, {"v": 0}, b"zero")
    assert not store.put("s", None, 0, {"v": 0}, b"again")  # exists already
    assert store.put("s", 0, 1, {"v": 1}, b"one")
    assert not store.put("s", 0, 1, {"v": 1}, b"stale")
    assert store.get("s") == (1, {"v": 1}, b"one")
    store.delete("s")
    assert store.head("s") is None
    assert not store.put("s", 1, 2, {}, b"resurrect")  # a deleted session stays deleted
    store.close()


def test_a_record_that_does_not_read_fails_its_own_session_only(tmp_path, redis_url):  # noqa: F811
    """A session record in Redis whose version or metadata do not read (written by something
    other than xlserve) is left out of every listing and answers 503 for itself; every other
    session of the same Redis is listed and served as before."""
    from xlserve.server.cache import SessionUnavailable

    a = replica(tmp_path, "a", redis_url)
    sid = a.create("toy", "k", data(10, 0)).id
    server = redis.Redis.from_url(redis_url)
    bad = "sess_" + "0" * 32
    key = a.redis.prefix + bad
    damaged = ('{"owner": "k"}', '{"model": "toy", "owner": "k", "tokens": "x", "nbytes": 1}',
               '{"model": "toy", "owner": "k", "tokens": 1, "nbytes": -5}',
               '{"model": "toy", "owner": ["k"], "tokens": 1, "nbytes": 1}',  # no owner a key has
               '{"model": "toy", "owner": {"k": 1}, "tokens": 1, "nbytes": 1}')
    for version, meta in (("1", "not json"), ("one", "{}"), ("1", "[1, 2]"), *(("1", m) for m in damaged)):
        server.hset(key, mapping={"version": version, "meta": meta, "blob": b"x"})
        listed, more = a.list_sessions("k")
        assert [info.id for info in listed] == [sid] and not more
        with pytest.raises(SessionUnavailable):
            a.info(bad, "k")
        assert a.info(sid, "k").version == 0
    server.delete(key)
    a.close()


def test_remembered_keys_that_do_not_read_fail_their_own_session(tmp_path, redis_url):  # noqa: F811
    """Idempotency-Keys in a Redis record that do not read (written by something else) answer
    503 for that session's keyed requests, not a 500."""
    from xlserve.server.cache import SessionUnavailable

    a = replica(tmp_path, "a", redis_url)
    sid = a.create("toy", "k", data(10, 0)).id
    server = redis.Redis.from_url(redis_url)
    server.hset(a.redis.prefix + sid, "idempotency", b"not json\n\xff")
    with pytest.raises(SessionUnavailable, match="Idempotency-Keys do not read"):
        a.acquire(sid, "k", {"key": "x", "fingerprint": "append"})
    assert a.info(sid, "k").version == 0  # what needs no keys still works
    a.delete(sid, "k")
    a.close()


def test_its_owner_can_delete_a_record_that_does_not_read(tmp_path, redis_url):  # noqa: F811
    """A record that can never be served is deleted by its owner (what still parses names it):
    without that it stayed in Redis for good. Another key, or a record whose owner does not
    read, still gets the 503 and leaves it; a record that reads is deleted as usual."""
    from xlserve.server.cache import SessionUnavailable

    a = replica(tmp_path, "a", redis_url)
    server = redis.Redis.from_url(redis_url)
    bad = "sess_" + "1" * 32
    key = a.redis.prefix + bad
    for version, meta in (("1", '{"owner": "k"}'), ("one", '{"model": "toy", "owner": "k", "tokens": 1, "nbytes": 1}'),
                          ("1", '{"model": "toy", "owner": "k", "tokens": "x", "nbytes": 1}')):
        server.hset(key, mapping={"version": version, "meta": meta, "blob": b"x"})
        with pytest.raises(SessionUnavailable):
            a.delete(bad, "another key")
        assert server.exists(key)
        assert a.delete(bad, "k") is None
        assert not server.exists(key)
        with pytest.raises(SessionNotFound):
            a.info(bad, "k")
    server.hset(key, mapping={"version": "1", "meta": "not json", "blob": b"x"})
    with pytest.raises(SessionUnavailable):  # whose it is cannot be read: left for an operator
        a.delete(bad, "k")
    server.hset(key, mapping={"version": "1", "meta": '{"owner": "k", "tokens": 1}', "blob": b"x"})
    assert a.delete(bad, "k", {"key": "d", "fingerprint": "delete"}) is None  # with a key: a tombstone
    assert isinstance(a.delete(bad, "k", {"key": "d", "fingerprint": "delete"}), Replay)
    server.delete(key)
    a.close()


def test_a_write_to_a_redis_that_forgot_its_scripts_sends_its_blob_once(redis_url):  # noqa: F811
    """A script called by its hash that the server does not know (fresh, restarted, failed over)
    would be refused and sent again with its arguments, the session's whole blob or delta: the
    store sends each call with its script's source instead."""
    server = redis.Redis.from_url(redis_url)
    store = RedisStore(redis_url, prefix="test-first-write:")
    blob = bytes(4 << 20)
    for version in range(2):
        server.script_flush()  # before the store's first write, then after it: a restarted server
        before = int(server.info("stats")["total_net_input_bytes"])
        assert store.put("s", None if version == 0 else 0, version, {"v": version}, blob)
        sent = int(server.info("stats")["total_net_input_bytes"]) - before
        assert len(blob) <= sent < 1.1 * len(blob)
    store.delete("s")
    store.close()


def test_a_delete_that_arrives_after_a_later_commit_changes_nothing(tmp_path, redis_url):  # noqa: F811
    """A delete is the version its replica read: one whose answer was lost (a 503) and that
    reaches Redis after a later commit was acknowledged to another client deletes nothing. A
    replica whose own copy is older than Redis's still deletes the session it reads."""
    a = replica(tmp_path, "a", redis_url)
    b = replica(tmp_path, "b", redis_url)
    sid = a.create("toy", "k", data(10, 0)).id
    head = a.durable.head(sid)
    lease = b.acquire(sid, "k")
    b.commit(lease, data(10, 1))  # acknowledged at version 1
    late = a.redis.delete(sid, "k", holding=(head.version, head.meta.get("commit", "")))  # the delete read version 0
    assert not late
    assert b.info(sid, "k").version == 1
    a.delete(sid, "k")  # a's books say version 0; it reads Redis's version 1 and deletes that
    with pytest.raises(SessionNotFound):
        b.acquire(sid, "k")
    a.close()
    b.close()


def test_a_delete_that_waited_for_a_commit_of_its_own_replica_deletes_what_it_committed(tmp_path, redis_url,
                                                                                         monkeypatch):  # noqa: F811
    """A delete reads Redis's head, then waits for the session (a commit of this replica whose
    client left, `_settled`). That commit lands a version the head does not name: read again once
    held, the delete is of that version, not a 409."""
    a = replica(tmp_path, "a", redis_url)
    sid = a.create("toy", "k", data(10, 0)).id
    stale = a.durable.head(sid)  # read before the commit below landed
    lease = a.acquire(sid, "k")
    a.commit(lease, data(10, 1))
    reads = []
    head = a.durable.head

    def first_stale(session_id, remembered=False):
        reads.append(session_id)
        return stale if len(reads) == 1 else head(session_id, remembered)

    monkeypatch.setattr(a.durable, "head", first_stale)
    a.delete(sid, "k")
    assert len(reads) == 2 and a.redis.head(sid) is None
    a.close()


def test_a_delete_without_a_key_keeps_the_tombstone_of_a_keyed_delete_that_landed_first(redis_url):  # noqa: F811
    """Two replicas delete one session at once: a keyed delete lands first and leaves its tombstone
    (its retry is answered with its first answer); a delete without a key that read the session
    before must not remove that tombstone, and another keyed one adds its key to it."""
    store = RedisStore(redis_url, prefix="test-tombstones:")
    meta = {"owner": "k", "commit": "c0"}
    assert store.put("sess_x", None, 0, meta, b"zero")
    first, second = (new_entry({"key": key, "fingerprint": "f"}, {}, -1, 0) for key in ("first", "second"))
    assert store.delete("sess_x", "k", first, holding=(0, "c0"))
    assert store.delete("sess_x", "k", None, holding=(0, "c0"))  # already gone: nothing to do
    assert store.delete("sess_x", "k", second, holding=(0, "c0"))
    owner, remembered = store.tombstone("sess_x")
    assert owner == "k" and [entry["key"] for entry in remembered] == ["second", "first"]
    store.close()


def test_a_redis_that_evicts_keys_is_named_at_start(tmp_path, redis_url, caplog):  # noqa: F811
    """Under any maxmemory-policy but noeviction a full Redis drops committed sessions (or their
    fences and tombstones): the start logs an error that says so and what to set."""
    server = redis.Redis.from_url(redis_url)
    try:
        server.config_set("maxmemory", "1gb")  # without a maxmemory Redis never evicts
        server.config_set("maxmemory-policy", "allkeys-lru")
        with caplog.at_level("ERROR", logger="xlserve.cache"):
            replica(tmp_path, "evicting", redis_url).close()
        assert any("maxmemory-policy allkeys-lru" in r.getMessage() and "noeviction" in r.getMessage()
                   for r in caplog.records if r.levelname == "ERROR")
        for name, settings in (("safe", {"maxmemory-policy": "noeviction"}),
                               ("unbounded", {"maxmemory": "0", "maxmemory-policy": "allkeys-lru"})):
            for setting, value in settings.items():
                server.config_set(setting, value)
            caplog.clear()
            with caplog.at_level("ERROR", logger="xlserve.cache"):
                replica(tmp_path, name, redis_url).close()
            assert not [r for r in caplog.records if "maxmemory-policy" in r.getMessage()], name
    finally:
        server.config_set("maxmemory-policy", "noeviction")
        server.config_set("maxmemory", "0")
        server.close()


def test_a_session_moves_between_replicas_and_a_stale_writer_gets_a_conflict(tmp_path, redis_url):  # noqa: F811
    a = replica(tmp_path, "a", redis_url)
    b = replica(tmp_path, "b", redis_url)
    sid = a.create("toy", "k", data(10, 0)).id
    lease = a.acquire(sid, "k")
    a.commit(lease, data(10, 1))  # v1 on A

    info = b.info(sid, "k")  # B has never seen it
    assert (info.version, info.tier) == (1, "redis")
    with pytest.raises(SessionNotFound):
        b.info(sid, "another-key")
    lease = b.acquire(sid, "k")
    assert same(lease.data, data(10, 1))
    b.commit(lease, data(10, 2))  # v2 on B

    lease = a.acquire(sid, "k")  # A's device copy is v1: stale, reloaded from Redis
    assert lease.version == 2 and same(lease.data, data(10, 2))
    a.commit(lease, data(10, 3))  # v3 on A

    stale = b.acquire(sid, "k")  # B starts from v3 ...
    winner = a.acquire(sid, "k")
    a.commit(winner, data(10, 4))  # ... but A commits v4 first
    with pytest.raises(SessionConflict):
        b.commit(stale, data(10, 99))
    b.release(stale)
    assert b.info(sid, "k").version == 4
    lease = b.acquire(sid, "k")
    assert same(lease.data, data(10, 4))  # the stale write never landed
    b.release(lease)

    a.delete(sid, "k")
    with pytest.raises(SessionNotFound):
        b.acquire(sid, "k")


def test_with_redis_disk_is_a_spill_tier(tmp_path, redis_url):  # noqa: F811
    n = 100
    cache = replica(tmp_path, "c", redis_url, device=size(n), host=size(n), disk=size(n))
    ids = [cache.create("toy", None, data(n, i)).id for i in range(4)]
    assert [cache.info(s, None).tier for s in ids] == ["redis", "disk", "host", "device"]
    assert len(list((tmp_path / "c").glob("*.safetensors"))) == 1
    for i in (0, 1):  # from Redis, from the disk spill
        lease = cache.acquire(ids[i], None)
        assert same(lease.data, data(n, i))
        cache.release(lease)


def test_a_spill_file_that_could_not_be_removed_goes_at_a_later_sweep(tmp_path, redis_url):  # noqa: F811
    """A file whose removal fails is tried again at every later sweep, also when it fails inside a
    sweep (it was tried once and forgotten: after a restart the session was back)."""
    n = 100
    cache = replica(tmp_path, "e", redis_url, device=size(n), host=size(n), disk=size(n))
    first = cache.create("toy", None, data(n, 0)).id
    for i in (1, 2):
        cache.create("toy", None, data(n, i))
    assert cache.info(first, None).tier == "disk"
    real_delete, failed = cache.disk.delete, []

    def delete_failing_twice(session_id):
        if session_id == first and len(failed) < 2:
            failed.append(session_id)
            raise PermissionError("injected: the file could not be removed")
        real_delete(session_id)

    cache.disk.delete = delete_failing_twice
    cache.create("toy", None, data(n, 3))  # the disk spill is full: `first` leaves it (Redis has it)
    assert failed == [first] and cache.disk.exists(first)  # left over: the books say Redis holds it only
    assert cache.info(first, None).tier == "redis"  # the next operation's sweep fails to remove it too ...
    assert failed == [first, first] and cache.disk.exists(first) and cache.holds.kind(first) is None
    assert cache.info(first, None).tier == "redis"  # ... and the one after removes it
    assert not cache.disk.exists(first) and cache.holds.kind(first) is None
    lease = cache.acquire(first, None)  # ... and the session is served from Redis, as before
    assert same(lease.data, data(n, 0))
    cache.release(lease)

def test_an_unusable_disk_spill_is_read_from_redis_and_goes(tmp_path, redis_url):  # noqa: F811
    """With Redis the disk only spills what Redis holds: a spill file that cannot be read (or
    fails its checks) does not fail the session on this replica until another one commits; it is
    read from Redis, and the spill leaves the books and the disk."""
    n = 100
    cache = replica(tmp_path, "s", redis_url, device=size(n), host=size(n), disk=size(n))
    ids = [cache.create("toy", None, data(n, i)).id for i in range(3)]
    spilled = ids[0]
    assert cache.info(spilled, None).tier == "disk"
    path = cache.disk.path(spilled)
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF  # the last byte of the state: its checksum no longer matches
    path.write_bytes(bytes(damaged))
    lease = cache.acquire(spilled, None)
    assert same(lease.data, data(n, 0))
    cache.release(lease)
    assert "disk" not in cache.manager.get(spilled).copies
    cache.info(ids[1], None)  # the next operation's sweep removes the file
    assert not cache.disk.exists(spilled)
    cache.close()


def test_a_disk_spill_read_without_memory_stays_and_the_acquire_is_retried(tmp_path, redis_url, monkeypatch):  # noqa: F811
    """Memory that runs out while a disk spill is read (host RAM: the CPU allocator's refusal) says
    nothing about the spill: the acquire fails alone with a retryable 503, the spill keeps its
    place in the books and on disk, and a retry with memory reads it."""
    from tests.models.helpers import allocator_refusal
    from xlserve.server.cache import durable
    from xlserve.server.cache.errors import SessionReadOutOfMemory

    n = 100
    cache = replica(tmp_path, "m", redis_url, device=size(n), host=size(n), disk=size(n))
    ids = [cache.create("toy", None, data(n, i)).id for i in range(3)]
    spilled = ids[0]
    assert cache.info(spilled, None).tier == "disk"
    materialise = durable.materialise

    def without_memory(*args):  # the spill's read only: Redis's would have the memory
        monkeypatch.setattr(durable, "materialise", materialise)
        raise allocator_refusal()

    monkeypatch.setattr(durable, "materialise", without_memory)
    with pytest.raises(SessionReadOutOfMemory):
        cache.acquire(spilled, None)
    monkeypatch.setattr(durable, "materialise", materialise)
    assert "disk" in cache.manager.get(spilled).copies
    cache.info(ids[1], None)  # a sweep
    assert cache.disk.exists(spilled)
    lease = cache.acquire(spilled, None)
    assert same(lease.data, data(n, 0))
    cache.release(lease)
    cache.close()


def test_a_full_redis_refuses_with_cache_full_and_keeps_what_it_has(tmp_path, redis_url):  # noqa: F811
    """Redis at its maxmemory refuses a write: CacheFull (503), what it holds stays, and the refusal
    is counted as the last tier's (xlserve_session_refusals_total{tier="redis"}), as a full
    budget of a faster tier is, so the refusal alert fires for a full Redis too."""
    from xlserve.server.metrics import Metrics

    admin = redis.Redis.from_url(redis_url)
    metrics = Metrics()
    cache = SessionCache(tmp_path / "d", None, None, None, redis_url=redis_url, metrics=metrics)
    cache.open({"toy": MODEL})
    kept = cache.create("toy", None, data(10, 0)).id
    admin.config_set("maxmemory", str(admin.info("memory")["used_memory"] + 2_000_000))  # noeviction by default
    try:
        with pytest.raises(CacheFull, match="full"):
            for i in range(100):  # 400 kB each: the limit is reached within a handful
                cache.create("toy", None, data(100_000, i))
        assert metrics.session_refusals.labels("toy", "redis")._value.get() == 1
        lease = cache.acquire(kept, None)
        assert same(lease.data, data(10, 0))
        cache.release(lease)
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()


def test_a_redis_that_lost_an_acknowledged_commit_is_taken_as_the_truth(tmp_path, redis_url):  # noqa: F811
    """Redis acknowledged version 1 and then lost it (a failover with asynchronous replication,
    a restore from a snapshot): once the session is held, an older head is no read that a local
    commit overtook but what Redis holds. The replica takes it (the session is served at version
    0 and commits on from it) instead of answering 409 to every request until a restart."""
    a = replica(tmp_path, "a", redis_url)
    server = redis.Redis.from_url(redis_url)
    sid = a.create("toy", "k", data(10, 0)).id
    snapshot = {key: server.dump(key) for key in server.keys(a.redis.prefix + "*")}
    lease = a.acquire(sid, "k")
    a.commit(lease, data(10, 1))  # acknowledged at version 1 ...
    for key in server.keys(a.redis.prefix + "*"):  # ... and lost: Redis is back at version 0
        server.delete(key)
    for key, dumped in snapshot.items():
        server.restore(key, 0, dumped)
    assert a.info(sid, "k").version == 1  # (not held: a read that a commit may have overtaken)
    for _ in range(2):  # the device copy (version 1) goes, then Redis's version 0 is read
        lease = a.acquire(sid, "k")
        assert lease.version == 0 and same(lease.data, data(10, 0))
        a.release(lease)
    lease = a.acquire(sid, "k")
    a.commit(lease, data(10, 2))  # and the session goes on from there
    assert a.info(sid, "k").version == 1
    b = replica(tmp_path, "b", redis_url)
    lease = b.acquire(sid, "k")
    assert lease.version == 1 and same(lease.data, data(10, 2))
    b.release(lease)
    a.delete(sid, "k")
    a.close()
    b.close()


def test_a_head_read_before_a_delete_never_brings_the_session_back(tmp_path, redis_url, monkeypatch):  # noqa: F811
    """`info` reads Redis's head outside the lock; a delete on this replica may land between that
    read and the lookup. The stale head must not put the deleted session back into the books
    (answered 200, listed, counted) until its next lookup."""
    a = replica(tmp_path, "a", redis_url)
    sid = a.create("toy", "k", data(10, 0)).id
    stale = a.durable.head(sid)
    a.delete(sid, "k")
    monkeypatch.setattr(a.durable, "head", lambda session_id, remembered=False: stale)  # read before the delete
    with pytest.raises(SessionNotFound):
        a.info(sid, "k")
    with pytest.raises(SessionNotFound):
        a.acquire(sid, "k")
    assert sid not in {info.id for info in a.sessions()}
    a.close()


def test_redis_remembers_the_keys_the_ledger_keeps(tmp_path, redis_url):  # noqa: F811
    """Redis's scripts keep the same Idempotency-Keys as ledger.kept does without Redis: the 32
    newest, at most REMEMBERED_BYTES_PER_SESSION bytes of them, in a commit and in a delete's
    tombstone."""
    cache = replica(tmp_path, "k", redis_url)
    sid = cache.create("toy", None, data(10, 0)).id
    big = "x" * (REMEMBERED_BYTES_PER_SESSION // 3)
    expected = []
    for i in range(5):
        lease = cache.acquire(sid, None, {"key": f"k{i}", "fingerprint": "f"})
        info = cache.commit(lease, data(10, i + 1), {"key": f"k{i}", "fingerprint": "f", "result": {"text": big}})
        cache.release(lease)
        stored = cache.redis.head(sid, remembered=True).remembered
        expected = kept(stored[0], expected)
        assert stored == expected and info.version == i + 1
    assert [entry["key"] for entry in stored] == ["k4", "k3"]
    cache.delete(sid, None, {"key": "gone", "fingerprint": "d"})
    tombstone = cache.durable.tombstone(sid)
    assert tombstone[1][0]["key"] == "gone" and tombstone[1] == kept(tombstone[1][0], stored)
    cache.close()


def test_a_listing_lets_go_of_idle_sessions_another_replica_deleted(tmp_path, redis_url):  # noqa: F811
    """With Redis, sessions another replica deleted left this replica's books only when asked for
    here: their records and copies (device, host, disk spill) piled up with every session deleted
    elsewhere. A listing lets go of those Redis no longer holds, idle and older than a write takes
    to land (hold_wait_s); a session in use, or one whose Redis record does not read, stays."""
    n = 100
    here = SessionCache(tmp_path / "a", size(n), size(n), size(4 * n), redis_url=redis_url, hold_wait_s=0.2)
    here.open({"toy": MODEL})
    elsewhere = replica(tmp_path, "b", redis_url)
    ids = [here.create("toy", "alice", data(n, i)).id for i in range(4)]  # the first spilled to disk
    assert here.info(ids[0], "alice").tier == "disk" and here.disk.exists(ids[0])
    damaged = here.create("toy", "alice", data(n, 5)).id  # its Redis record will not read: not gone
    redis.Redis.from_url(redis_url).hset(here.redis.prefix + damaged, "version", "one")
    held = here.acquire(ids[3], "alice")  # in use here while the other replica deletes it
    for session_id in ids:
        elsewhere.delete(session_id, "alice")
    time.sleep(0.3)  # older than hold_wait_s
    young = here.create("toy", "alice", data(n, 9)).id
    assert [info.id for info in here.list_sessions("alice")[0]] == [young]
    assert {record.id for record in here.manager.records.values()} == {young, ids[3], damaged}
    assert not here.disk.exists(ids[0])  # its spill file went with it
    here.release(held)
    here.close()
    elsewhere.close()


def test_sessions_another_replica_deleted_leave_the_books_without_a_listing(tmp_path, redis_url):  # noqa: F811
    """A replica whose clients never list kept the sessions other replicas deleted, and their
    copies, until evicted: the cache lets go of them every `forget_deleted_every_s` by itself."""
    n = 100
    here = SessionCache(tmp_path / "a", size(n), size(n), size(4 * n), redis_url=redis_url, hold_wait_s=0.2,
                        forget_deleted_every_s=0.1)
    here.open({"toy": MODEL})
    elsewhere = replica(tmp_path, "b", redis_url)
    ids = [here.create("toy", "alice", data(n, i)).id for i in range(3)]  # the first spilled to disk
    kept_id = here.create("toy", "alice", data(n, 7)).id
    assert here.disk.exists(ids[0])
    for session_id in ids:
        elsewhere.delete(session_id, "alice")
    deadline = time.monotonic() + 10  # a pass lets go of each once it is older than hold_wait_s
    while set(here.manager.records) != {kept_id} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {record.id for record in here.manager.records.values()} == {kept_id}
    assert not here.disk.exists(ids[0])
    here.close()
    assert not here._forgetting.is_alive()
    elsewhere.close()


def test_a_session_a_scan_missed_is_read_from_redis_again(tmp_path, redis_url, monkeypatch):  # noqa: F811
    """A Redis scan may miss a key it holds (a cluster's slot moving, a failover in the middle of
    it). The pass that lets go of sessions deleted elsewhere let go of such a session too, and
    remembered it as deleted here: this replica then answered 404 for it, and left it out of its
    listings, while Redis and every other replica served it. It now leaves only the books: its
    next request reads it from Redis."""
    here = SessionCache(tmp_path / "a", None, None, None, redis_url=redis_url, hold_wait_s=0.0)
    here.open({"toy": MODEL})
    missed = here.create("toy", "dave", data(10, 3)).id
    seen = here.create("toy", "dave", data(10, 4)).id
    time.sleep(0.01)
    scan = here.durable.heads
    monkeypatch.setattr(here.durable, "heads", lambda unreadable=None: {k: v for k, v in scan(unreadable).items()
                                                                         if k != missed})
    assert here.forget_deleted_elsewhere() == 1
    monkeypatch.setattr(here.durable, "heads", scan)
    assert here.info(missed, "dave").version == 0
    assert {info.id for info in here.list_sessions("dave")[0]} == {missed, seen}
    lease = here.acquire(missed, "dave")
    assert same(lease.data, data(10, 3))
    here.release(lease)
    here.close()


def test_a_listing_goes_on_after_a_session_another_replica_deleted(tmp_path, redis_url):  # noqa: F811
    """A client paging its sessions through a fleet, deleting as it goes: the page's last session,
    deleted on another replica, was `after` that this replica had never seen deleted (400). Redis
    remembers a deleted session's place for an hour, and the listing goes on from it."""
    here = replica(tmp_path, "a", redis_url)
    elsewhere = replica(tmp_path, "b", redis_url)
    ids = []
    for i in range(5):
        ids.append(here.create("toy", "pager", data(10, i)).id)
        time.sleep(0.01)  # distinct creation times
    page, more = here.list_sessions("pager", limit=2)
    assert [info.id for info in page] == ids[:-3:-1] and more
    elsewhere.delete(page[-1].id, "pager")
    rest, more = here.list_sessions("pager", limit=5, after=page[-1].id)
    assert [info.id for info in rest] == ids[2::-1] and not more
    with pytest.raises(ValueError, match="not one of your sessions"):  # another owner's place tells nothing
        here.list_sessions("another-pager", after=page[-1].id)
    here.close()
    elsewhere.close()


@pytest.mark.parametrize("unlink", ["works", "fails"])
def test_a_plan_that_moves_one_session_twice_carries_both_changes(tmp_path, redis_url, unlink, monkeypatch):  # noqa: F811
    """With Redis the disk is a spill, and a session brought back to the device keeps its spill
    file. Making room for a large session can then move it twice in one plan: its spill dropped
    to make room on the disk for another session, then its device copy moved to host RAM. Both
    changes are carried out: its device copy leaves the device (it stayed there, unbooked, and
    the move to host RAM failed), its host copy is made, its spill file goes; every copy the books
    list holds the session's state, and the device holds nothing the books do not list."""
    n = 100
    cache = replica(tmp_path, "c", redis_url, device=2 * size(n), host=size(n), disk=size(n))
    older, spilled, twice = (cache.create("toy", "k", data(n, seed)).id for seed in (1, 2, 3))
    large = cache.create("toy", "k", data(3 * n // 2, 4)).id  # more than one session's room
    for sid in (large, older, spilled, twice):
        cache.move(sid, "redis")
    cache.move(twice, "disk")
    cache.move(spilled, "host")
    cache.move(older, "device")
    cache.release(cache.acquire(twice, "k"))  # back on the device, its spill kept: the most recent
    copies = {sid: set(cache.manager.get(sid).copies) for sid in (older, spilled, twice)}
    assert copies == {older: {"device", "redis"}, spilled: {"host", "redis"}, twice: {"device", "disk", "redis"}}

    if unlink == "fails":  # the spill file stays: the host copy made beside it stands, the file goes later
        delete = cache.placement.disk.delete
        failed = []

        def failing_once(session_id):
            if session_id == twice and not failed:
                failed.append(session_id)
                raise OSError("read-only file system")
            return delete(session_id)

        monkeypatch.setattr(cache.placement.disk, "delete", failing_once)
    lease = cache.acquire(large, "k")  # room for 1.5 sessions on the device: both leave it
    assert same(lease.data, data(3 * n // 2, 4))
    cache.release(lease)
    expected = {older: data(n, 1), spilled: data(n, 2), twice: data(n, 3)}
    assert set(cache.placement.device._data) == {sid for sid, r in cache.manager.records.items() if "device" in r.copies}
    assert set(cache.placement.host._data) == {sid for sid, r in cache.manager.records.items() if "host" in r.copies}
    state = tmp_path / "c"
    for sid, want in expected.items():
        record = cache.manager.get(sid)
        if not (unlink == "fails" and sid == twice):
            assert ("disk" in record.copies) == (state / f"{sid}.safetensors").exists(), (sid, record.copies)
        for tier in record.copies & {"device", "host"}:
            assert same((cache.placement.device if tier == "device" else cache.placement.host).get(sid), want), (sid, tier)
    assert cache.manager.get(twice).copies == {"host", "redis"}
    if unlink == "fails":
        assert (state / f"{twice}.safetensors").exists() and twice in cache.placement._left_files
    for sid, want in expected.items():  # and each is served as it was
        lease = cache.acquire(sid, "k")
        assert same(lease.data, want), sid
        cache.release(lease)
    cache.close()


def test_a_pass_that_lets_go_of_many_sessions_publishes_once(tmp_path, redis_url):  # noqa: F811
    """Letting go of the sessions other replicas deleted is one pass under the cache's lock; each
    publish of the metrics is a pass over every record, so the pass publishes once, not once per
    session (20,000 records and thousands deleted elsewhere held the lock for minutes)."""
    here = SessionCache(tmp_path / "a", None, None, None, redis_url=redis_url, hold_wait_s=0.0,
                        forget_deleted_every_s=3600, metrics=Metrics())
    here.open({"toy": MODEL})
    elsewhere = replica(tmp_path, "b", redis_url)
    ids = [here.create("toy", "alice", data(10, i)).id for i in range(6)]
    for session_id in ids:
        elsewhere.delete(session_id, "alice")
    published = []
    publish = here.placement.publish
    here.placement.publish = lambda: (published.append(1), publish())[1]
    time.sleep(0.01)  # last used before the listing by more than hold_wait_s
    assert here.forget_deleted_elsewhere() == 6
    assert len(published) == 1
    here.close()
    elsewhere.close()


def test_a_stale_spill_left_by_a_commit_goes_even_when_a_sweep_runs_before_the_books_change(tmp_path,
                                                                                           redis_url, monkeypatch):  # noqa: F811
    """After a commit to Redis the old version's disk spill is removed; when that fails, a later
    sweep removes it. A sweep that ran between the failed removal and the commit's change of the
    books saw the spill still listed, took the file for a newer copy, and forgot it for good."""
    n = 100
    cache = replica(tmp_path, "c", redis_url)
    sid = cache.create("toy", "k", data(n, 0)).id
    cache.move(sid, "disk")
    lease = cache.acquire(sid, "k")  # back on the device, its spill kept
    assert cache.manager.get(sid).copies == {"device", "disk", "redis"}
    delete = cache.placement.disk.delete
    failing = [True]

    def fails_once(session_id):
        if failing:
            failing.clear()
            raise OSError("device busy")
        return delete(session_id)

    drop = cache.placement.drop_stale_file

    def then_a_sweep(record):
        drop(record)
        cache.placement.sweep()  # before `committed` drops the spill from the books

    monkeypatch.setattr(cache.placement.disk, "delete", fails_once)
    monkeypatch.setattr(cache.placement, "drop_stale_file", then_a_sweep)
    cache.commit(lease, data(n, 1))
    cache.placement.sweep()
    assert not (tmp_path / "c" / f"{sid}.safetensors").exists()
    cache.close()


def _throttled_proxy(port: int, bytes_per_s: float):
    """A TCP relay to 127.0.0.1:`port` whose client-to-server direction moves at most
    `bytes_per_s` (a slow link to Redis); (its port, stop)."""
    import socket
    import threading

    listen = socket.socket()
    listen.bind(("127.0.0.1", 0))
    listen.listen(8)
    sockets = [listen]

    def pipe(source, target, rate):
        try:
            while chunk := source.recv(65536):
                target.sendall(chunk)
                if rate:
                    time.sleep(len(chunk) / rate)
        except OSError:
            pass
        for end in (source, target):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def accept():
        while True:
            try:
                client, _ = listen.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            sockets.extend([client, upstream])
            threading.Thread(target=pipe, args=(client, upstream, bytes_per_s), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, client, 0), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()

    def stop():
        for end in sockets:
            end.close()

    return listen.getsockname()[1], stop


def test_a_large_value_is_sent_within_a_timeout_that_counts_its_bytes(redis_url):  # noqa: F811
    """A socket's timeout bounds a whole send, so with the store's timeout alone a large state
    needed a fast link: a 32 MB write over a 32 MB/s link with a 0.5 s timeout could never land,
    Redis healthy (now its timeout is 4 s, against about 1 s of sending). A value past SLOW_SEND_BYTES has the timeout plus its bytes at 16 MB/s; a call
    that sends nothing large keeps the store's own timeout."""
    from urllib.parse import urlparse

    port, stop = _throttled_proxy(urlparse(redis_url).port, 32e6)
    store = RedisStore(f"redis://127.0.0.1:{port}/0", prefix="test-slow-link:", timeout_s=0.5)
    try:
        blob = bytes(32 << 20)
        assert store.put("s", None, 0, {"v": 0}, blob) == 1
        assert store.get("s")[2] == blob
        assert store._client_for(100) is store.client
        assert store._client_for(32 << 20).get_connection_kwargs()["socket_timeout"] == 4.0  # 0.5 + 2, up to 2^k
        store.delete("s")
    finally:
        store.close()
        stop()
