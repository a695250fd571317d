"""The session cache's locking rule (server/cache/session_cache.py): the lock guards the books and
is never held during I/O. Bookkeeping is taken under it, files and Redis are written and read
without it, and the result is recorded under it again, the session's hold (leases.py) keeping
everything else off the session meanwhile.

Every store call is watched: none may run while the calling thread holds the cache's lock."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from xlserve.server.cache.errors import SessionLocked, SessionUnavailable
from xlserve.server.cache.leases import MOVE
from xlserve.server.cache.session_cache import WAITERS_PER_SESSION, SessionCache
from tests.redis_server import redis_url  # noqa: F401  (fixture)
from tests.server.cache_helpers import MODEL, data, same, size

N = 100
UNIT = size(N)
DISK_CALLS = ("write", "read", "delete", "write_tombstone", "read_tombstone", "scan", "prune_tombstones")
REDIS_CALLS = ("put", "get", "head", "heads", "settle", "remember", "delete", "tombstone", "ping")


class Watch:
    """Wraps a cache's store calls: counts them, and which ran under the cache's lock."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.locked: list[str] = []

    def cache(self, cache: SessionCache) -> SessionCache:
        self.wrap(cache, cache.disk, "disk", DISK_CALLS)
        if cache.redis is not None:
            self.wrap(cache, cache.redis, "redis", REDIS_CALLS)
        self.wrap(cache, cache.placement, "placement", ("read", "write"))  # copies between device and host too
        return cache

    def wrap(self, cache: SessionCache, store, label: str, names: tuple[str, ...]) -> None:
        for name in names:
            real = getattr(store, name)

            def watched(*args, _real=real, _name=f"{label}.{name}", **kwargs):
                self.calls[_name] += 1
                if cache._lock._is_owned():
                    self.locked.append(_name)
                return _real(*args, **kwargs)

            setattr(store, name, watched)


def key(name: str, fingerprint: str = "f") -> dict:
    return {"key": name, "fingerprint": fingerprint}


def workout(cache: SessionCache, owner: str) -> list[str]:
    """Every operation, with budgets tight enough that sessions spill down the tiers."""
    ids = [cache.create("toy", owner, data(N, i)).id for i in range(6)]
    for i, session_id in enumerate(ids):
        lease = cache.acquire(session_id, owner, key(f"c{i}"))
        cache.commit(lease, data(N, 10 + i, tokens=7), {**key(f"c{i}"), "result": None})
        assert cache.acquire(session_id, owner, key(f"c{i}")).replay is not None  # a replay holds nothing
        cache.release(cache.acquire(ids[0], owner))
    fork = cache.fork(ids[1], owner, key("fork"))
    cache.replace(fork.id, owner, data(N, 30), key("replace"))
    cache.export(ids[2], owner)
    cache.info(ids[3], owner)
    cache.list_sessions(owner, limit=100)
    cache.move(ids[4], "host")
    cache.move(ids[4], "device")
    assert cache.delete(ids[5], owner, key("delete")) is None
    assert cache.delete(ids[5], owner, key("delete")) is not None  # from the tombstone
    return ids


def test_no_file_is_written_or_read_under_the_lock(tmp_path):
    watch = Watch()
    cache = watch.cache(SessionCache(tmp_path / "state", 2 * UNIT, 2 * UNIT, None))
    cache.open({"toy": MODEL})
    ids = workout(cache, "owner")
    cache.close()
    again = watch.cache(SessionCache(tmp_path / "state", 2 * UNIT, 2 * UNIT, None))
    assert again.open({"toy": MODEL}) == 6  # five of the workout's and the fork
    assert same(again.acquire(ids[0], "owner").data, data(N, 10, tokens=7))
    assert watch.calls["disk.write"] >= 12 and watch.calls["disk.read"] >= 1 and watch.calls["placement.write"] >= 1
    assert watch.locked == []


def test_redis_and_the_disk_spill_are_never_called_under_the_lock(tmp_path, redis_url):  # noqa: F811
    watch = Watch()
    one = watch.cache(SessionCache(tmp_path / "one", UNIT, UNIT, UNIT, redis_url=redis_url))
    two = watch.cache(SessionCache(tmp_path / "two", UNIT, UNIT, UNIT, redis_url=redis_url))
    for cache in (one, two):
        cache.open({"toy": MODEL})
    owner = "locking-" + tmp_path.name
    ids = workout(one, owner)
    one.release(one.acquire(ids[0], owner))
    assert one.info(ids[0], owner).tier == "device"
    lease = two.acquire(ids[0], owner)  # the other replica takes it in ...
    two.commit(lease, data(N, 40))
    info = one.info(ids[0], owner)  # ... and this one catches up: its stale copies go
    assert (info.version, info.tier) == (2, "redis")
    assert same(one.acquire(ids[0], owner).data, data(N, 40))
    for cache in (one, two):
        cache.close()
    assert watch.calls["redis.put"] >= 12 and watch.calls["disk.write"] >= 1  # the disk spill tier was used
    assert watch.locked == []


def blocking_writes(cache: SessionCache, session_id: str) -> tuple[threading.Event, threading.Event]:
    """Make the disk write of `session_id` wait for `go`; `writing` is set once it waits."""
    writing, go = threading.Event(), threading.Event()
    real = cache.disk.write

    def write(sid, blob):
        if sid == session_id:
            writing.set()
            assert go.wait(30)
        return real(sid, blob)

    cache.disk.write = write
    return writing, go


def blocking_moves(cache: SessionCache, session_id: str, tier: str) -> tuple[threading.Event, threading.Event]:
    """Make the copy of `session_id` into `tier` (a move between tiers) wait for `go`; `moving`
    is set once it waits."""
    moving, go = threading.Event(), threading.Event()
    real = cache.placement.write

    def write(record, to_tier, value):
        if record.id == session_id and to_tier == tier:
            moving.set()
            assert go.wait(30)
        return real(record, to_tier, value)

    cache.placement.write = write
    return moving, go


def in_thread(fn, *args):
    """Run `fn` in a thread; returns (thread, outcome dict with 'value' or 'error')."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn(*args)
        except Exception as error:  # noqa: BLE001 - the test compares the outcome
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_one_sessions_slow_durable_write_holds_up_no_other_session(tmp_path):
    cache = SessionCache(tmp_path / "state", None, None, None)
    cache.open({"toy": MODEL})
    slow, fast = (cache.create("toy", None, data(N, i)).id for i in range(2))
    writing, go = blocking_writes(cache, slow)
    lease = cache.acquire(slow, None)
    committing, outcome = in_thread(cache.commit, lease, data(N, 5, tokens=9))
    assert writing.wait(10)  # the commit of `slow` is inside its fsync'd write now

    def others():
        other = cache.acquire(fast, None)
        info = cache.commit(other, data(N, 6, tokens=8))
        return info, cache.info(slow, None), cache.list_sessions(None)[0], cache.create("toy", None, data(N, 7))

    meanwhile, done = in_thread(others)
    meanwhile.join(10)  # with one lock around local I/O, this would wait for the slow write
    assert not meanwhile.is_alive() and "error" not in done, done
    info, slow_info, listed, created = done["value"]
    assert info.version == 1 and slow_info.in_use and slow_info.version == 0 and len(listed) == 2
    assert created.version == 0 and len(cache.sessions()) == 3
    with pytest.raises(SessionLocked):
        cache.acquire(slow, None)  # the lease still holds it: one request at a time
    go.set()
    committing.join(10)
    assert outcome["value"].version == 1 and cache.info(slow, None).tokens == 9
    assert same(cache.acquire(slow, None).data, data(N, 5, tokens=9))


def test_a_request_for_a_session_in_transit_waits_for_its_bytes(tmp_path):
    cache = SessionCache(tmp_path / "state", 2 * UNIT, UNIT, None)
    cache.open({"toy": MODEL})
    a, c, b = (cache.create("toy", None, data(N, i)).id for i in range(3))  # a and c on the device, b on disk
    assert [cache.info(s, None).tier for s in (a, c, b)] == ["host", "device", "device"]
    cache.move(b, "disk")
    cache.move(a, "disk")
    cache.move(a, "device")  # a, c on the device (a least recently used), neither in host RAM; b only on disk
    assert [cache.info(s, None).tier for s in (a, c, b)] == ["device", "device", "disk"]

    moving, go = blocking_moves(cache, a, "host")
    taking_b, got_b = in_thread(cache.acquire, b, None)  # evicts a to host RAM: its copy is in transit
    assert moving.wait(10)
    info = cache.info(a, None)
    assert info.tier == "host" and not info.in_use  # the books say where it goes; no request holds it
    taking_a, got_a = in_thread(cache.acquire, a, None)
    time.sleep(0.3)
    assert taking_a.is_alive()  # it waits for a's bytes, rather than being told the session is busy
    go.set()
    taking_b.join(10)
    taking_a.join(10)
    assert "error" not in got_b and "error" not in got_a, (got_a, got_b)
    assert same(got_a["value"].data, data(N, 0)) and same(got_b["value"].data, data(N, 2))
    for lease in (got_a["value"], got_b["value"]):
        cache.release(lease)


# -- a release during a commit ----------------------------------------------------------------------


def test_release_during_a_local_commit_does_not_let_another_request_overwrite_it(tmp_path):
    """The engine handles Release inline while Commit runs on the pool (a client that disconnects
    while its commit is awaited). The old cache held the lock across the disk write, so the
    release waited and found the lease done. Now the release gives the hold back mid-write."""
    cache = SessionCache(tmp_path / "state", None, None, None)
    cache.open({"toy": MODEL})
    sid = cache.create("toy", None, data(N, 0)).id
    a = cache.acquire(sid, None)
    writing, go = blocking_writes(cache, sid)
    committing, outcome = in_thread(cache.commit, a, data(N, 1, tokens=9))
    assert writing.wait(10)
    cache.release(a)  # the API's `finally: release(lease)` after a cancelled commit
    b_thread, b_out = in_thread(cache.acquire, sid, None)  # a second request for the session
    b_thread.join(0.5)
    go.set()
    committing.join(10)
    b_thread.join(10)
    assert outcome["value"].version == 1  # A was told nothing (it left), but its change landed
    b = b_out["value"]  # B got the session (at version 0, the state before A's change) ...
    cache.commit(b, data(N, 2, tokens=11))  # ... and its commit silently overwrites A's version 1
    assert cache.info(sid, None).version == 2, "lost update: B's commit rewrote version 1 over A's"


def test_a_commit_that_fails_after_its_request_left_ends_the_lease_itself(tmp_path):
    cache = SessionCache(tmp_path / "state", None, None, None)
    cache.open({"toy": MODEL})
    sid = cache.create("toy", None, data(N, 0)).id
    lease = cache.acquire(sid, None)
    writing, go = threading.Event(), threading.Event()

    def failing_write(session_id, blob):
        writing.set()
        assert go.wait(30)
        raise OSError("the disk went away")

    cache.disk.write = failing_write
    committing, outcome = in_thread(cache.commit, lease, data(N, 1, tokens=9))
    assert writing.wait(10)
    cache.release(lease)  # the request left: recorded, the hold stays with the write
    assert not lease.done and not cache.info(sid, None).in_use
    waiting, got = in_thread(cache.acquire, sid, None)
    waiting.join(0.3)
    assert waiting.is_alive()  # it waits for the write, rather than 409 or the state being replaced
    go.set()
    committing.join(10)
    waiting.join(10)
    assert isinstance(outcome.get("error"), OSError) and lease.done  # the commit ended the lease itself
    after = got["value"]
    assert after.version == 0 and same(after.data, data(N, 0))  # nothing changed: the write failed
    cache.release(after)
    cache.release(lease)  # a late release changes nothing
    assert not cache.info(sid, None).in_use


def test_a_commits_answer_is_its_own_not_a_later_requests(tmp_path):
    """commit() gives its hold back, then rebalances the device outside the lock, and only then
    reads the session's info: a request that took the session meanwhile shows up in the answer."""
    cache = SessionCache(tmp_path / "state", 2 * UNIT, None, None)
    cache.open({"toy": MODEL})
    x = cache.create("toy", None, data(N, 0)).id
    s = cache.create("toy", None, data(N, 1)).id  # x and s on the device, x least recently used
    moving, go = blocking_moves(cache, x, "host")
    a = cache.acquire(s, None)
    committing, outcome = in_thread(cache.commit, a, data(2 * N, 2, tokens=9))  # grows: x leaves the device
    assert moving.wait(10)
    b = cache.acquire(s, None)  # the hold was given back: another request takes the session ...
    cache.commit(b, data(2 * N, 3, tokens=12))  # ... and commits, all before A's commit returns
    go.set()
    committing.join(10)
    info = outcome["value"]
    assert (info.version, info.tokens) == (1, 9), f"A was answered with B's commit: {info}"


def test_a_commits_booked_growth_does_not_count_on_the_device(tmp_path):
    """reserve() books a commit's growth with manager.resize, which grows every copy's count,
    the device's too: while the write runs the device looks fuller than it is, and a request
    that fits (and did fit with the old code, which finished the commit first) gets CacheFull."""
    cache = SessionCache(tmp_path / "state", 2 * UNIT, None, 20 * UNIT)
    cache.open({"toy": MODEL})
    z, s, y = (cache.create("toy", None, data(N, i)).id for i in range(3))  # z went to host RAM
    assert cache.info(z, None).tier == "host"
    a = cache.acquire(s, None)
    writing, go = blocking_writes(cache, s)
    committing, outcome = in_thread(cache.commit, a, data(2 * N, 5, tokens=9))
    assert writing.wait(10)
    try:
        lease = cache.acquire(z, None)  # y can leave the device: room for z
        cache.release(lease)
    finally:
        go.set()
        committing.join(10)
    assert outcome["value"].version == 1 and outcome["value"].state_bytes == size(2 * N)


# -- a hold that would never end -----------------------------------------------------------------


def test_a_request_for_a_session_held_for_good_is_refused_in_time_not_hung(tmp_path):
    cache = SessionCache(tmp_path / "state", None, None, None, hold_wait_s=0.3)
    cache.open({"toy": MODEL})
    sid = cache.create("toy", None, data(N, 0)).id
    with cache._lock:
        cache.holds.take(sid, MOVE)  # a hold nobody gives back (the bug a leaked hold would be)
    started = time.monotonic()
    for call in (lambda: cache.acquire(sid, None), lambda: cache.delete(sid, None)):
        waiting, outcome = in_thread(call)
        waiting.join(10)
        assert isinstance(outcome.get("error"), SessionUnavailable), outcome
    assert time.monotonic() - started < 5


def test_requests_waiting_for_one_held_session_are_bounded_and_the_rest_refused_at_once(tmp_path):
    # each waiter holds one of the engine process's session-op threads: a client retrying one
    # session whose write is slow must not take every thread the other clients' requests need
    cache = SessionCache(tmp_path / "state", None, None, None, hold_wait_s=20)
    cache.open({"toy": MODEL})
    sid = cache.create("toy", None, data(N, 0)).id
    other = cache.create("toy", None, data(N, 1)).id
    with cache._lock:
        hold = cache.holds.take(sid, MOVE)  # the cache writing or moving it
    waiters = [in_thread(cache.acquire, sid, None) for _ in range(WAITERS_PER_SESSION)]
    deadline = time.monotonic() + 10
    while cache._waiting.get(sid, 0) < WAITERS_PER_SESSION and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    for call in (lambda: cache.acquire(sid, None), lambda: cache.delete(sid, None)):
        with pytest.raises(SessionUnavailable, match="already wait"):
            call()
    assert time.monotonic() - started < 5  # refused at once, not after hold_wait_s
    cache.release(cache.acquire(other, None))  # another session is served meanwhile
    with cache._lock:
        cache.holds.give_back(sid, hold)
    outcomes = []
    for thread, outcome in waiters:
        thread.join(10)
        outcomes.append(outcome)
    taken = [outcome["value"] for outcome in outcomes if "value" in outcome]
    assert len(taken) == 1  # one waiter takes it; the others find it leased (409)
    assert all(isinstance(outcome.get("error"), SessionLocked) for outcome in outcomes if "value" not in outcome)
    cache.release(taken[0])
    assert cache._waiting == {}


def test_a_rebalance_that_fails_partway_after_a_commit_gives_its_holds_back(tmp_path):
    cache = SessionCache(tmp_path / "state", 2 * UNIT, None, None, hold_wait_s=2)
    cache.open({"toy": MODEL})
    x = cache.create("toy", None, data(N, 0)).id
    s = cache.create("toy", None, data(N, 1)).id  # x and s on the device, x least recently used
    held_when_it_failed = []
    real = cache.placement.rebalance

    def rebalance_then_fail(tier, transfer):
        real(tier, transfer)  # x booked to leave the device, and held for its move ...
        held_when_it_failed.extend(session_id for session_id, _ in transfer.held)
        raise RuntimeError("injected: the prefix cache failed to give its room back")  # ... then a failure

    cache.placement.rebalance = rebalance_then_fail
    info = cache.commit(cache.acquire(s, None), data(2 * N, 2, tokens=9))  # grows: x must leave the device
    assert held_when_it_failed == [x]
    assert (info.version, info.tokens) == (1, 9)  # the commit landed: its answer says so
    taking, outcome = in_thread(cache.acquire, x, None)
    taking.join(10)  # a leaked hold would keep x waiting until hold_wait_s, then refuse it
    assert "error" not in outcome, outcome
    assert same(outcome["value"].data, data(N, 0))
    cache.release(outcome["value"])
    assert cache.holds.kind(x) is None and cache.holds.kind(s) is None


def test_a_catch_up_that_fails_after_taking_its_hold_gives_it_back(tmp_path, redis_url):  # noqa: F811
    one = SessionCache(tmp_path / "one", None, None, None, redis_url=redis_url, hold_wait_s=2)
    two = SessionCache(tmp_path / "two", None, None, None, redis_url=redis_url, hold_wait_s=2)
    for cache in (one, two):
        cache.open({"toy": MODEL})
    owner = "locking-" + tmp_path.name
    sid = one.create("toy", owner, data(N, 0)).id
    two.commit(two.acquire(sid, owner), data(N, 1, tokens=9))  # one's copies are stale now
    real = one._info
    failures = []

    def info_failing_once(record, *args, **kwargs):
        if not failures:
            failures.append(record.id)
            raise RuntimeError("injected: a failure while the catch-up holds the session")
        return real(record, *args, **kwargs)

    one._info = info_failing_once
    with pytest.raises(RuntimeError, match="injected"):
        one.info(sid, owner)  # it catches up (taking the session to remove its stale file), then fails
    assert failures == [sid] and one.holds.kind(sid) is None
    taking, outcome = in_thread(one.acquire, sid, owner)
    taking.join(15)  # a leaked hold would keep this waiting until hold_wait_s, then refuse it
    assert "error" not in outcome, outcome
    lease = outcome["value"]
    assert lease.version == 1 and same(lease.data, data(N, 1, tokens=9))
    one.release(lease)
    for cache in (one, two):
        cache.close()
