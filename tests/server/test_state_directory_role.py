"""A state directory's role (server/cache/state_directory.py): without Redis its files are the
sessions' only durable copy, with Redis a spill cache of what Redis holds. Turning Redis on over a
directory of last-tier sessions used to let every one of them go (Redis held none, so each read as
deleted elsewhere and its file was swept): they are now moved to Redis first, as they are, and a
start that cannot move one stops with nothing let go of. Turning Redis off over a spill cache,
whose files may be older than Redis's versions, is refused."""

import pytest

import redis

from xlserve.server.cache.session_cache import SessionCache
from xlserve.server.cache.state_directory import (LAST_TIER, REDIS_SPILL, StateDirectoryRefused, check_role,
                                                  directory_role)
from tests.redis_server import redis_url  # noqa: F401  (fixture)
from xlserve.server.cache.codec import SessionData
from tests.server.cache_helpers import MODEL, data, same


def opened(directory, url=None) -> SessionCache:
    cache = SessionCache(directory, None, None, None, redis_url=url or "")
    cache.open({"toy": MODEL})
    return cache


def last_tier_sessions(directory) -> dict[str, int]:
    """Three sessions written without Redis, one committed twice with Idempotency-Keys: id -> the
    data index its state holds."""
    cache = opened(directory)
    held = {cache.create("toy", "alice", data(10, i)).id: i for i in range(3)}
    first = next(iter(held))
    for i, key in ((7, "k1"), (8, "k2")):
        lease = cache.acquire(first, "alice", {"key": key, "fingerprint": "f"})
        cache.commit(lease, data(10, i), {"key": key, "fingerprint": "f", "result": {"text": key}})
        cache.release(lease)
    held[first] = 8
    cache.close()
    assert directory_role(directory) == LAST_TIER
    return held


def test_sessions_written_without_redis_are_moved_to_redis_and_kept(tmp_path, redis_url):  # noqa: F811
    held = last_tier_sessions(tmp_path / "state")
    cache = opened(tmp_path / "state", redis_url)
    assert directory_role(tmp_path / "state") == REDIS_SPILL
    store = redis.Redis.from_url(redis_url)
    assert {sid for sid in held if store.exists(cache.redis.prefix + sid)} == set(held)
    cache.forget_deleted_elsewhere()  # the pass that used to let them all go
    assert set(held) <= {info.id for info in cache.list_sessions("alice")[0]}  # (Redis is the module's)
    first = next(iter(held))
    assert cache.info(first, "alice").version == 2
    for sid, index in held.items():
        lease = cache.acquire(sid, "alice")
        assert same(lease.data, data(10, index)), sid
        cache.release(lease)
    # the remembered Idempotency-Keys came too: a retry is answered as before
    assert cache.acquire(first, "alice", {"key": "k1", "fingerprint": "f"}).replay["result"] == {"text": "k1"}
    cache.close()
    other = opened(tmp_path / "replica", redis_url)  # and another replica reads them from Redis
    lease = other.acquire(first, "alice")
    assert same(lease.data, data(10, 8)) and other.info(first, "alice").version == 2
    other.release(lease)
    other.close()


def test_a_start_that_cannot_move_a_session_stops_and_lets_nothing_go(tmp_path, redis_url):  # noqa: F811
    """Redis holding another session of the same id stops the start, naming it, with the
    directory's role and files as they were; once that is mended a start goes on where the first
    stopped (a session it moved already is not moved twice)."""
    held = last_tier_sessions(tmp_path / "state")
    ids = sorted(held)
    elsewhere = opened(tmp_path / "elsewhere", redis_url)
    clash = elsewhere.create("toy", "bob", data(10, 5)).id
    elsewhere.close()
    store = redis.Redis.from_url(redis_url)
    prefix = "xlserve:session:"
    store.rename(prefix + clash, prefix + ids[1])  # Redis now holds another session under a moved id
    before = sorted(path.name for path in (tmp_path / "state").iterdir())
    with pytest.raises(StateDirectoryRefused, match=f"holds session {ids[1]} .* Redis holds another session"):
        opened(tmp_path / "state", redis_url)
    assert directory_role(tmp_path / "state") == LAST_TIER
    assert sorted(path.name for path in (tmp_path / "state").iterdir()) == before
    store.delete(prefix + ids[1])  # mended
    cache = opened(tmp_path / "state", redis_url)
    cache.forget_deleted_elsewhere()
    assert set(ids) <= {info.id for info in cache.list_sessions("alice")[0]}  # (Redis is the module's)
    cache.close()


def test_a_spill_cache_is_refused_without_redis(tmp_path, redis_url):  # noqa: F811
    cache = opened(tmp_path / "state", redis_url)
    sid = cache.create("toy", None, data(10, 0)).id
    cache.close()
    assert directory_role(tmp_path / "state") == REDIS_SPILL
    if not any((tmp_path / "state").glob("sess_*.safetensors")):
        spill = opened(tmp_path / "state", redis_url)  # a session's spill copy
        spill.durable.disk.write(sid, b"stale")
        spill.close()
    with pytest.raises(StateDirectoryRefused, match="spill cache .* XLSERVE_REDIS_URL"):
        check_role(tmp_path / "state", with_redis=False)
    with pytest.raises(StateDirectoryRefused, match="spill cache"):
        opened(tmp_path / "state")
    check_role(tmp_path / "state", with_redis=True)
    check_role(tmp_path / "empty", with_redis=False)  # no sessions, no role: nothing to refuse


def test_a_role_file_that_does_not_read_is_refused_and_kept(tmp_path, redis_url):  # noqa: F811
    """Taken as no role, a damaged role file let a last-tier directory's sessions go under Redis
    (nothing moved, the role overwritten) and made a spill cache the truth without it."""
    last_tier_sessions(tmp_path / "state")
    for damaged in (b"", b"last-tie\n", b"\xff\xfe"):
        (tmp_path / "state" / ".role").write_bytes(damaged)
        for url in (redis_url, None):
            with pytest.raises(StateDirectoryRefused, match="role"):
                opened(tmp_path / "state", url)
        assert (tmp_path / "state" / ".role").read_bytes() == damaged


def test_a_session_file_unreadable_at_the_moving_start_stops_it(tmp_path, redis_url, monkeypatch):  # noqa: F811
    """The scan leaves a file it cannot read (an I/O error) for a later start: moving to Redis
    went on without it and recorded the spill role, so the next start let it go as a spill of a
    session Redis never held. The start stops instead, the role unchanged."""
    from xlserve.server.cache.stores import DiskStore

    held = last_tier_sessions(tmp_path / "state")
    read_head, failing = DiskStore._read_head, sorted(held)[0]

    def once_unreadable(store, path):
        if path.name.startswith(failing):
            raise OSError(24, "Too many open files")
        return read_head(store, path)

    monkeypatch.setattr(DiskStore, "_read_head", once_unreadable)
    with pytest.raises(StateDirectoryRefused, match="could not be read"):
        opened(tmp_path / "state", redis_url)
    assert directory_role(tmp_path / "state") == LAST_TIER
    monkeypatch.setattr(DiskStore, "_read_head", read_head)
    cache = opened(tmp_path / "state", redis_url)
    cache.forget_deleted_elsewhere()
    assert cache.info(failing, "alice").version >= 0
    cache.close()


def test_a_moving_start_stopped_before_the_keys_went_adds_them_when_it_goes_on(tmp_path, redis_url, monkeypatch):  # noqa: F811
    """A session is written to Redis, then its remembered Idempotency-Keys one by one: a start that
    stopped in between found the session moved at the next start and skipped it, keys and all, so
    a retried keyed commit would have applied twice."""
    from xlserve.server.cache.durable import DurableStore

    held = last_tier_sessions(tmp_path / "state")
    first = next(iter(held))

    def stopped(*args, **kwargs):
        raise StateDirectoryRefused("stopped here")

    monkeypatch.setattr(DurableStore, "remember", stopped)
    with pytest.raises(StateDirectoryRefused):
        opened(tmp_path / "state", redis_url)
    monkeypatch.undo()
    cache = opened(tmp_path / "state", redis_url)
    assert cache.acquire(first, "alice", {"key": "k1", "fingerprint": "f"}).replay["result"] == {"text": "k1"}
    cache.close()


def test_a_moved_session_s_log_counts_against_the_disk(tmp_path, redis_url):  # noqa: F811
    """A session moved to Redis keeps the log of delta commits it had on disk until its spill copy
    is written whole: the books counted only its base, so the disk could pass its budget."""
    from tests.server.test_cache_architectures import tiny_model
    from tests.server.test_cache_deltas import step

    model = tiny_model("transformer-xl")
    cache = SessionCache(tmp_path / "state", None, None, None)
    cache.open({"txl": model})
    sid = cache.create("txl", None, SessionData(model.init_state(1), 0, None)).id
    for chunk in ([1, 2, 3], [4, 5]):
        step(model, cache, sid, chunk)  # delta commits: a log beside the base
    cache.close()
    moved = SessionCache(tmp_path / "state", None, None, None, redis_url=redis_url)
    moved.open({"txl": model})
    log = moved.durable.disk.log_bytes(sid)
    assert log > 0 and moved.manager.get(sid).disk_log_bytes == log
    assert moved.manager.used("disk") == moved.manager.get(sid).nbytes + log
    moved.close()


def test_a_keyed_delete_made_without_redis_is_answered_again_after_the_switch(tmp_path, redis_url):  # noqa: F811
    """The tombstones of keyed deletes stayed on the disk, which a server with Redis does not read
    for them: a retried keyed delete after the switch got 404 instead of its first answer."""
    from xlserve.server.cache.session_cache import Replay

    cache = opened(tmp_path / "state")
    sid = cache.create("toy", "erin", data(10, 0)).id
    assert cache.delete(sid, "erin", {"key": "d1", "fingerprint": "f"}) is None
    cache.close()
    moved = opened(tmp_path / "state", redis_url)
    assert isinstance(moved.delete(sid, "erin", {"key": "d1", "fingerprint": "f"}), Replay)
    moved.close()
    again = opened(tmp_path / "state", redis_url)  # a later start moves nothing twice
    assert isinstance(again.delete(sid, "erin", {"key": "d1", "fingerprint": "f"}), Replay)
    assert len(again.redis.tombstone(sid)[1]) == 1
    again.close()
