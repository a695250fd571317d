"""The session cache without Redis (memory and disk stores, a toy state, no model runs):
Idempotency-Keys remembered in the session's file across restarts, sessions that can never fit,
and the owner's list of sessions. Redis's side of the same is in test_cache_certainty.py."""

from __future__ import annotations

import pytest

from xlserve.server.cache import (
    CacheFull,
    IdempotencyKeyReused,
    SessionConflict,
    SessionLocked,
    SessionUnavailable,
    SessionNotFound,
    SessionTooLarge,
)
from xlserve.server.cache.codec import decode
from xlserve.server.cache.session_cache import IDEMPOTENCY_KEYS_PER_SESSION, Replay, SessionCache
from tests.redis_server import redis_url  # noqa: F401  (fixture)
from tests.server.cache_helpers import MODEL, data, same, size


def make_cache(tmp_path, device=None, host=None, disk=None) -> SessionCache:
    cache = SessionCache(tmp_path / "state", device, host, disk)
    cache.open({"toy": MODEL})
    return cache


def key(name: str, fingerprint: str = "request-a") -> dict:
    return {"key": name, "fingerprint": fingerprint}


def commit_once(cache, sid, new_data, idempotency, result):
    """What the engine process does for a request with a key: acquire (maybe a replay), commit."""
    lease = cache.acquire(sid, None, idempotency)
    if lease.replay is not None:
        return lease.replay
    try:
        return cache.commit(lease, new_data, {**idempotency, "result": result})
    finally:
        cache.release(lease)


def test_the_same_key_replays_the_first_result_and_another_request_with_it_is_refused(tmp_path):
    cache = make_cache(tmp_path)
    sid = cache.create("toy", None, data(10, 0)).id
    first = commit_once(cache, sid, data(10, 1, tokens=8), key("k"), {"answer": "first"})
    assert first.version == 1
    again = commit_once(cache, sid, data(10, 2, tokens=99), key("k"), {"answer": "second"})
    assert again == {**again, "result": {"answer": "first"}, "version": 1, "tokens": 8}
    assert cache.info(sid, None).version == 1  # applied once
    assert not cache.info(sid, None).in_use  # a replay holds nothing
    with pytest.raises(IdempotencyKeyReused):
        cache.acquire(sid, None, key("k", fingerprint="request-b"))
    assert not cache.info(sid, None).in_use
    commit_once(cache, sid, data(10, 3, tokens=11), key("other"), {"answer": "third"})  # a new key applies
    assert cache.info(sid, None).version == 2


def test_keys_live_in_the_sessions_file_survive_a_restart_and_are_bounded(tmp_path):
    cache = make_cache(tmp_path)
    sid = cache.create("toy", None, data(10, 0)).id
    for i in range(IDEMPOTENCY_KEYS_PER_SESSION + 3):
        commit_once(cache, sid, data(10, i, tokens=10 + i), key(f"k{i}"), {"answer": i})
    del cache  # no close(): as after kill -9

    again = make_cache(tmp_path)
    last = IDEMPOTENCY_KEYS_PER_SESSION + 2
    replay = again.acquire(sid, None, key(f"k{last}")).replay
    assert replay["result"] == {"answer": last} and replay["version"] == last + 1
    assert again.acquire(sid, None, key("k3")).replay["result"] == {"answer": 3}  # still among the kept
    lease = again.acquire(sid, None, key("k0"))  # the oldest ones are forgotten: it applies again
    assert lease.replay is None
    again.release(lease)
    _, blob = again.export(sid, None)
    meta, _, _ = decode(blob)
    assert "idempotency" not in meta  # an export carries no remembered answers


def test_fork_replace_and_delete_with_a_key_answer_their_retry_the_same(tmp_path):
    cache = make_cache(tmp_path)
    sid = cache.create("toy", "owner", data(10, 0)).id
    fork = cache.fork(sid, "owner", key("f", "fork"))
    again = cache.fork(sid, "owner", key("f", "fork"))
    assert isinstance(again, Replay) and again.entry["result"]["id"] == fork.id
    assert len(cache.sessions()) == 2  # forked once

    replaced = cache.replace(fork.id, "owner", data(12, 5, tokens=7), key("r", "replace"))
    assert replaced.version == 1
    again = cache.replace(fork.id, "owner", data(12, 5, tokens=7), key("r", "replace"))
    assert isinstance(again, Replay) and again.entry["result"]["version"] == 1
    assert cache.info(fork.id, "owner").version == 1

    assert cache.delete(fork.id, "owner", key("d", "delete")) is None
    replay = cache.delete(fork.id, "owner", key("d", "delete"))
    assert isinstance(replay, Replay)
    with pytest.raises(SessionNotFound):
        cache.delete(fork.id, "another-owner", key("d", "delete"))  # another key sees nothing
    with pytest.raises(SessionNotFound):
        cache.delete(fork.id, "owner")  # without the key: it is gone
    del cache
    restarted = make_cache(tmp_path)  # the tombstone is a file too
    assert isinstance(restarted.delete(fork.id, "owner", key("d", "delete")), Replay)
    assert [s.id for s in restarted.sessions()] == [sid]


def test_a_create_or_import_with_a_key_makes_one_session_across_retries_and_restarts(tmp_path):
    cache = make_cache(tmp_path)
    made = cache.create("toy", "owner", data(10, 0), key("c", "create"))
    assert not isinstance(made, Replay) and made.version == 0
    again = cache.create("toy", "owner", data(10, 0), key("c", "create"))
    assert isinstance(again, Replay) and again.entry["result"]["id"] == made.id
    theirs = cache.create("toy", "another-owner", data(10, 0), key("c", "create"))
    assert not isinstance(theirs, Replay) and theirs.id != made.id  # the key is the owner's own
    with pytest.raises(IdempotencyKeyReused):
        cache.create("toy", "owner", data(10, 0), key("c", "import"))  # the key with another request
    assert len(cache.sessions()) == 2

    lease = cache.acquire(made.id, "owner")
    cache.commit(lease, data(10, 1, tokens=9))
    del cache  # no close(): as after kill -9
    restarted = make_cache(tmp_path)
    retry = restarted.import_new("toy", "owner", data(10, 5), key("c", "create"))
    # the session the key made, as it is now; the retry's state was not taken
    assert isinstance(retry, Replay) and retry.entry["result"]["id"] == made.id
    assert (retry.entry["result"]["version"], retry.entry["result"]["tokens"]) == (1, 9)
    lease = restarted.acquire(made.id, "owner")
    assert same(lease.data, data(10, 1, tokens=9))
    restarted.release(lease)
    assert len(restarted.sessions()) == 2

    restarted.delete(made.id, "owner")
    with pytest.raises(IdempotencyKeyReused, match="deleted since"):  # the key is spent
        restarted.create("toy", "owner", data(10, 0), key("c", "create"))
    assert cache_ids(restarted) == {theirs.id}


def test_a_keyed_create_whose_write_may_have_landed_is_made_by_its_retry(tmp_path, monkeypatch):
    """A keyed create whose file was renamed in but whose directory sync failed is answered 503
    (the session was not made, its file goes): the client's retry with the key makes it, and is
    not told the key was spent on a deleted session."""
    from xlserve.server.cache.stores import DiskStore

    cache = make_cache(tmp_path)
    sync = DiskStore._sync_directory
    monkeypatch.setattr(DiskStore, "_sync_directory", lambda self: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(SessionUnavailable):
        cache.create("toy", "owner", data(10, 0), key("c", "create"))
    monkeypatch.setattr(DiskStore, "_sync_directory", sync)
    assert cache_ids(cache) == set()
    made = cache.create("toy", "owner", data(10, 0), key("c", "create"))
    assert not isinstance(made, Replay)
    del cache
    restarted = make_cache(tmp_path)  # its file is the retry's, not swept with the failed one's
    assert cache_ids(restarted) == {made.id}


def test_a_keyed_session_remembers_its_request_past_32_later_keys(tmp_path):
    """The fingerprint of the create that made a keyed session is kept for its life, not among
    its 32 latest keys: another request with the key is refused however many keys came since."""
    cache = make_cache(tmp_path)
    made = cache.create("toy", None, data(10, 0), key("c", "create"))
    for i in range(IDEMPOTENCY_KEYS_PER_SESSION + 2):
        commit_once(cache, made.id, data(10, i, tokens=10 + i), key(f"k{i}"), {"answer": i})
    with pytest.raises(IdempotencyKeyReused):
        cache.import_new("toy", None, data(10, 0), key("c", "import of other bytes"))
    del cache
    restarted = make_cache(tmp_path)
    assert isinstance(restarted.create("toy", None, data(10, 0), key("c", "create")), Replay)
    with pytest.raises(IdempotencyKeyReused):
        restarted.create("toy", None, data(10, 0), key("c", "import of other bytes"))
    _, blob = restarted.export(made.id, None)
    assert "made_by" not in decode(blob)[0]  # an export carries nothing of the requests


def replicas(tmp_path, redis_url, *names: str) -> list[SessionCache]:
    """Replicas on one Redis, each with its own state directory."""
    caches = [SessionCache(tmp_path / name, None, None, None, redis_url=redis_url) for name in names]
    for cache in caches:
        cache.open({"toy": MODEL})
    return caches


def cache_ids(cache) -> set[str]:
    return {s.id for s in cache.sessions()}


def test_a_create_with_a_key_is_made_once_by_two_replicas_on_one_redis(tmp_path, redis_url):  # noqa: F811
    a, b = replicas(tmp_path, redis_url, "a", "b")
    owner = "creator-" + tmp_path.name  # the module's Redis is shared with other tests
    made = a.create("toy", owner, data(10, 0), key("c", "create"))
    on_b = b.create("toy", owner, data(10, 0), key("c", "create"))  # the retry went to another replica
    assert isinstance(on_b, Replay) and on_b.entry["result"]["id"] == made.id
    with pytest.raises(IdempotencyKeyReused):
        b.create("toy", owner, data(10, 0), key("c", "other request"))
    assert [s.id for s in b.list_sessions(owner, limit=10)[0]] == [made.id]
    # two replicas racing with one key both find nothing and both write: the first write of a
    # session is compare-and-set on Redis holding nothing, so the second is refused and `create`
    # answers it as a replay. A third replica whose look finds nothing, as the racer's did:
    racer, = replicas(tmp_path, redis_url, "c")
    with pytest.raises(SessionConflict):
        racer._admit_new("toy", owner, data(10, 0), session_id=made.id)
    look = racer._made_before
    looks = []
    racer._made_before = lambda *args: looks.append(args) or (None if len(looks) == 1 else look(*args))
    raced = racer.create("toy", owner, data(10, 0), key("c", "create"))
    assert isinstance(raced, Replay) and raced.entry["result"]["id"] == made.id and len(looks) == 2
    a.delete(made.id, owner, key("d", "delete"))
    fresh, = replicas(tmp_path, redis_url, "d")  # never saw it
    with pytest.raises(IdempotencyKeyReused):  # deleted on a replica, with a key: its tombstone tells
        fresh.create("toy", owner, data(10, 0), key("c", "create"))
    with pytest.raises(SessionConflict):  # and a first write never lands on a tombstone
        fresh._admit_new("toy", owner, data(10, 0), session_id=made.id)

    # deleted without a key, on a replica the retry does not reach: the retry makes it anew, and
    # the replica that deleted it serves the new session (another creation time), not a 404
    again = b.create("toy", owner, data(10, 0), key("e", "create"))
    b.delete(again.id, owner)
    anew = a.create("toy", owner, data(10, 3), key("e", "create"))
    assert not isinstance(anew, Replay) and anew.id == again.id
    assert b.info(again.id, owner).created_at == anew.created_at
    assert [s.id for s in b.list_sessions(owner, limit=10)[0]] == [again.id]


def test_a_session_larger_than_the_device_budget_is_served_from_host_ram(tmp_path):
    n = 100
    cache = make_cache(tmp_path, device=2 * size(n), disk=10 * size(n))  # host RAM: the default, unbounded
    sid = cache.create("toy", None, data(n, 0)).id
    lease = cache.acquire(sid, None)
    committed = cache.commit(lease, data(3 * n, 1))  # more than the whole device budget: no error
    assert committed.version == 1 and committed.tier == "host"
    assert cache.manager.used("device") == 0 and cache.manager.used("host") == size(3 * n)
    for _ in range(2):  # served from host RAM, and kept there between requests
        lease = cache.acquire(sid, None)
        assert same(lease.data, data(3 * n, 1))
        cache.release(lease)
        assert cache.info(sid, None).tier == "host" and cache.manager.used("device") == 0
    other = cache.create("toy", None, data(n, 2)).id  # sessions that fit the device still go there
    assert cache.info(other, None).tier == "device"
    del cache
    restarted = make_cache(tmp_path, device=2 * size(n), disk=10 * size(n))
    lease = restarted.acquire(sid, None)  # from disk after a restart, to host RAM
    assert same(lease.data, data(3 * n, 1)) and restarted.info(sid, None).tier == "host"
    restarted.release(lease)


def test_a_session_that_can_never_fit_is_too_large_not_full(tmp_path):
    n = 100
    cache = make_cache(tmp_path, device=2 * size(n), host=2 * size(n), disk=10 * size(n))
    sid = cache.create("toy", None, data(n, 0)).id
    lease = cache.acquire(sid, None)
    with pytest.raises(SessionTooLarge, match="XLSERVE_HOST_STATE_BYTES"):
        cache.commit(lease, data(3 * n, 1))  # more than the whole device budget and the whole host budget
    cache.release(lease)
    assert cache.info(sid, None).version == 0  # nothing changed
    with pytest.raises(SessionTooLarge, match="XLSERVE_DISK_STATE_BYTES"):
        make_cache(tmp_path / "disk-bound", disk=10 * size(n)).create("toy", None, data(20 * n, 2))
    small = make_cache(tmp_path / "other", device=size(n) // 2, host=size(n) // 2)
    with pytest.raises(SessionTooLarge):
        small.create("toy", None, data(n, 3))
    del cache

    shrunk = make_cache(tmp_path, device=size(n) // 2, host=size(n) // 2)  # restarted with smaller budgets
    with pytest.raises(SessionTooLarge, match="never be served"):
        shrunk.acquire(sid, None)
    assert not shrunk.info(sid, None).in_use

    busy = make_cache(tmp_path / "busy", device=2 * size(n))  # merely full: the retryable refusal
    a, b, c = (busy.create("toy", None, data(n, i)).id for i in range(3))
    held = [busy.acquire(a, None), busy.acquire(b, None)]
    with pytest.raises(CacheFull) as refused:
        busy.acquire(c, None)
    assert not isinstance(refused.value, SessionTooLarge)
    for lease in held:
        busy.release(lease)


def test_listing_is_the_owners_newest_first_in_pages(tmp_path):
    cache = make_cache(tmp_path, device=size(10), host=size(10))  # the sessions spread over the tiers
    theirs = cache.create("toy", "them", data(10, 9)).id
    mine = [cache.create("toy", "me", data(10, i)).id for i in range(5)]
    newest_first = list(reversed(mine))

    page, more = cache.list_sessions("me", limit=2)
    assert [s.id for s in page] == newest_first[:2] and more
    page, more = cache.list_sessions("me", limit=2, after=page[-1].id)
    assert [s.id for s in page] == newest_first[2:4] and more
    page, more = cache.list_sessions("me", limit=2, after=page[-1].id)
    assert [s.id for s in page] == newest_first[4:] and not more
    assert {s.tier for s in cache.list_sessions("me", limit=100)[0]} == {"device", "host", "disk"}
    assert [s.id for s in cache.list_sessions("them", limit=100)[0]] == [theirs]
    with pytest.raises(ValueError):
        cache.list_sessions("me", limit=2, after=theirs)  # another owner's id is no cursor


def test_a_listing_goes_on_after_a_session_deleted_since_its_page(tmp_path):
    """A client that deletes the sessions it lists, a page at a time, names a deleted session as
    its cursor: the listing goes on from that session's place, not 400. Another owner's deleted
    session is still no cursor."""
    cache = make_cache(tmp_path)
    theirs = cache.create("toy", "them", data(10, 9)).id
    mine = [cache.create("toy", "me", data(10, i)).id for i in range(5)]
    seen = []
    page, more = cache.list_sessions("me", limit=2)
    while True:
        seen += [s.id for s in page]
        for session in page:
            cache.delete(session.id, "me")
        if not more:
            break
        page, more = cache.list_sessions("me", limit=2, after=page[-1].id)
    assert seen == list(reversed(mine)) and cache.list_sessions("me")[0] == []
    cache.delete(theirs, "them")
    with pytest.raises(ValueError):
        cache.list_sessions("me", limit=2, after=theirs)


def test_listing_with_redis_shows_every_replicas_sessions(tmp_path, redis_url):  # noqa: F811
    a, b = replicas(tmp_path, redis_url, "a", "b")
    owner = "lister-" + tmp_path.name  # the module's Redis is shared with other tests
    on_a = a.create("toy", owner, data(10, 0)).id
    on_b = b.create("toy", owner, data(10, 1)).id
    lease = a.acquire(on_a, owner)
    a.commit(lease, data(10, 2, tokens=9))
    listed, more = b.list_sessions(owner, limit=10)
    assert [s.id for s in listed] == [on_b, on_a] and not more
    assert (listed[1].version, listed[1].tokens, listed[1].tier) == (1, 9, "redis")
    a.delete(on_b, owner)
    assert [s.id for s in b.list_sessions(owner, limit=10)[0]] == [on_a]
    assert same(b.acquire(on_a, owner).data, data(10, 2, tokens=9))


def test_the_new_refusals_cross_the_wire_and_map_to_their_own_statuses():
    from xlserve.server.api.errors import as_api_error
    from xlserve.server.cache import CommitOutcomeUnknown
    from xlserve.server.engine.wire import error_from_wire, error_to_wire

    expected = {SessionTooLarge: (413, "session_too_large"), CommitOutcomeUnknown: (503, "commit_outcome_unknown"),
                IdempotencyKeyReused: (422, "idempotency_key_reused")}
    for cls, (status, code) in expected.items():
        back = error_from_wire(error_to_wire(cls("what happened", "sess_a")))
        assert type(back) is cls and back.session_id == "sess_a"
        api_error = as_api_error(back)
        assert (api_error.status, api_error.code, api_error.message) == (status, code, "what happened")
        assert "Retry-After" not in api_error.headers  # none of them is helped by a blind retry
    assert as_api_error(CacheFull("full", "sess_a")).headers == {"Retry-After": "1"}  # unlike merely full


def test_a_delete_of_a_session_in_use_is_busy_before_its_key_is_checked(tmp_path):
    cache = make_cache(tmp_path)
    sid = cache.create("toy", "owner", data(10, 0)).id
    lease = cache.acquire(sid, "owner", key("k"))
    cache.commit(lease, data(10, 1), {**key("k"), "result": None})
    lease = cache.acquire(sid, "owner")  # a request holds the session
    with pytest.raises(SessionLocked):  # 409 session_busy, as ever: the busy session is the answer first
        cache.delete(sid, "owner", key("k", "another-request"))
    cache.release(lease)
    with pytest.raises(IdempotencyKeyReused):  # 422 once it is free: the key was used for another request
        cache.delete(sid, "owner", key("k", "another-request"))
    assert cache.info(sid, "owner").version == 1  # nothing deleted, and nothing left holding it
    cache.release(cache.acquire(sid, "owner"))


def test_a_file_whose_removal_failed_is_never_removed_under_a_session_made_anew(tmp_path):
    """A forgotten session's file whose removal fails is tried again at a later sweep as a
    forgotten one: skipped once its id is a new session's (a keyed create retried: the NEW hold,
    then its own file), not deleted without a look as a file left over, which removed the new
    session's only copy."""
    from xlserve.server.cache.leases import NEW

    cache = make_cache(tmp_path)
    sid = cache.create("toy", "alice", data(10, 0)).id
    with cache._lock:
        cache.placement.forget(cache.manager.get(sid))
    real_delete = cache.disk.delete

    def failing_delete(session_id):
        raise PermissionError("injected: the file could not be removed")

    cache.disk.delete = failing_delete
    cache.placement.sweep()  # fails: the id is tried again at a later sweep
    cache.disk.delete = real_delete
    with cache._lock:
        hold = cache.holds.take(sid, NEW)  # the keyed create's retry makes the session anew ...
    assert cache.disk.exists(sid)  # (its file, written under that hold, stands for the old one here)
    cache.placement.sweep()
    assert cache.disk.exists(sid)  # ... and the sweep leaves its file alone
    with cache._lock:
        cache.holds.give_back(sid, hold)


def test_a_disk_tombstone_past_its_lifetime_is_not_honoured_and_goes_while_the_server_runs(tmp_path):
    """A keyed delete's tombstone (a file of up to 2 MiB of answers, outside the disk budget) was
    pruned only at start: a server that ran for weeks kept every one, and honoured a key past the
    day Redis remembers it. Past TOMBSTONE_SECONDS it is not read, and the housekeeping thread
    removes it without a restart."""
    import json
    import os
    import time

    from xlserve.server.cache.session_cache import TOMBSTONE_SECONDS

    cache = SessionCache(tmp_path / "state", None, None, None, forget_deleted_every_s=0.05)
    cache.open({"toy": MODEL})
    try:
        made = cache.create("toy", "owner", data(10, 0), key("c", "create"))
        assert cache.delete(made.id, "owner", key("d", "delete")) is None
        path = cache.durable.disk.tombstone_path(made.id)
        assert isinstance(cache.delete(made.id, "owner", key("d", "delete")), Replay)  # within its lifetime
        body = json.loads(path.read_text())
        old = time.time() - TOMBSTONE_SECONDS - 60
        path.write_text(json.dumps({**body, "deleted_at": old}))
        with pytest.raises(SessionNotFound):  # read, but past its lifetime: as if none
            cache.delete(made.id, "owner", key("d", "delete"))
        os.utime(path, (old, old))
        deadline = time.monotonic() + 10
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not path.exists()
    finally:
        cache.close()


def test_a_keyed_delete_on_a_full_disk_deletes_and_remembers_its_key_in_the_room_it_freed(tmp_path, monkeypatch):
    """Without Redis a keyed delete writes its tombstone before the session's file goes (so that
    a crash between them never loses the key); on a disk too full for the tombstone it answered
    503 "delete sessions", which the client was trying to do. The session's file goes first then,
    and the tombstone is written in the room it freed: the delete's retry is still a replay."""
    from xlserve.server.cache.stores import DiskStore, StoreFull

    cache = make_cache(tmp_path)
    made = cache.create("toy", "owner", data(10, 0))
    write_tombstone, calls = DiskStore.write_tombstone, []

    def full_until_the_session_goes(store, session_id, owner, remembered):
        calls.append(store.exists(session_id))
        if store.exists(session_id):
            raise StoreFull("No space left on device")
        return write_tombstone(store, session_id, owner, remembered)

    monkeypatch.setattr(DiskStore, "write_tombstone", full_until_the_session_goes)
    assert cache.delete(made.id, "owner", key("d", "delete")) is None
    assert calls == [True, False] and not cache.durable.disk.exists(made.id)
    assert isinstance(cache.delete(made.id, "owner", key("d", "delete")), Replay)


def test_a_session_too_large_is_not_counted_as_a_tier_without_room(tmp_path):
    """xlserve_session_refusals_total counts 503s for lack of room (its alert says "the tier is
    full"); a state larger than a whole budget is the client's 413 and was counted there too, so
    one client retrying an oversized import fired the operator's alert."""
    from xlserve.server.metrics import Metrics

    metrics = Metrics()
    n = 100
    cache = SessionCache(tmp_path / "state", 2 * size(n), 2 * size(n), 10 * size(n), metrics=metrics)
    cache.open({"toy": MODEL})
    refusals = lambda: sum(value for sample_name, value in (  # noqa: E731
        (sample.name, sample.value) for family in metrics.registry.collect() for sample in family.samples)
        if sample_name == "xlserve_session_refusals_total")
    sid = cache.create("toy", None, data(n, 0)).id
    lease = cache.acquire(sid, None)
    with pytest.raises(SessionTooLarge):
        cache.commit(lease, data(3 * n, 1))
    cache.release(lease)
    with pytest.raises(SessionTooLarge):
        cache.create("toy", None, data(20 * n, 2))
    assert refusals() == 0
    held = [cache.acquire(cache.create("toy", None, data(n, i)).id, None) for i in (3, 4)]
    with pytest.raises(CacheFull):  # merely full: counted
        cache.acquire(sid, None)
    assert refusals() == 1
    for lease in held:
        cache.release(lease)
