"""The session cache with real stores (memory, disk) and a toy state: no model runs."""

import pytest
import torch

from xlserve.server.cache import (
    CacheFull,
    SessionLocked,
    SessionNotFound,
    SessionUnavailable,
)
from xlserve.server.cache.codec import decode
from xlserve.server.cache.session_cache import SessionCache
from xlserve.server.metrics import Metrics
from tests.server.cache_helpers import MODEL, data, same, size


def make_cache(tmp_path, device=None, host=None, disk=None, metrics=None) -> SessionCache:
    cache = SessionCache(tmp_path / "state", device, host, disk, metrics=metrics)
    cache.open({"toy": MODEL})
    return cache


def commit(cache, sid, d, owner=None):
    lease = cache.acquire(sid, owner)
    try:
        return cache.commit(lease, d)
    finally:
        cache.release(lease)


def test_commit_bumps_version_release_changes_nothing(tmp_path):
    cache = make_cache(tmp_path)
    info = cache.create("toy", None, data(10, 0))
    assert info.version == 0 and info.state_bytes == size(10) and info.id.startswith("sess_") and len(info.id) == 37
    lease = cache.acquire(info.id, None)
    with pytest.raises(SessionLocked):
        cache.acquire(info.id, None)
    assert cache.info(info.id, None).in_use
    cache.release(lease)
    cache.release(lease)  # idempotent
    assert cache.info(info.id, None).version == 0
    after = commit(cache, info.id, data(12, 1, tokens=9))
    assert (after.version, after.tokens, after.state_bytes) == (1, 9, size(12))
    assert same(cache.acquire(info.id, None).data, data(12, 1, tokens=9))


def test_sessions_spill_down_the_tiers_and_come_back_bit_identical(tmp_path):
    n = 100
    cache = make_cache(tmp_path, device=2 * size(n), host=2 * size(n))
    ids = [cache.create("toy", None, data(n, i)).id for i in range(5)]
    tiers = [cache.info(s, None).tier for s in ids]
    assert tiers == ["disk", "host", "host", "device", "device"]
    assert cache.manager.used("device") == 2 * size(n) and cache.manager.used("host") == 2 * size(n)
    assert cache.manager.used("disk") == 5 * size(n)  # write-through: every session has its file
    for i in [0, 1, 4]:  # from disk, from host, from the device
        lease = cache.acquire(ids[i], None)
        assert same(lease.data, data(n, i))
        cache.release(lease)
    # each restore pushed the least recently used device session down: 1 and 4 were used last
    assert [cache.info(s, None).tier for s in ids] == ["host", "device", "disk", "host", "device"]
    assert sum(cache.manager.used(t) for t in ("device", "host")) == 4 * size(n)


def test_no_room_when_every_device_session_is_in_use(tmp_path):
    n = 100
    cache = make_cache(tmp_path, device=2 * size(n))
    a, b, c = (cache.create("toy", None, data(n, i)).id for i in range(3))
    leases = [cache.acquire(a, None), cache.acquire(b, None)]
    with pytest.raises(CacheFull, match="in use"):
        cache.acquire(c, None)
    assert cache.info(c, None).in_use is False
    cache.release(leases[0])
    cache.release(cache.acquire(c, None))  # a is idle now and makes room


def test_committed_session_itself_steps_down_when_the_others_are_pinned(tmp_path):
    n = 100
    cache = make_cache(tmp_path, device=2 * size(n))
    a, b = (cache.create("toy", None, data(n, i)).id for i in range(2))
    held = cache.acquire(a, None)
    lease = cache.acquire(b, None)
    info = cache.commit(lease, data(2 * n, 7))  # b grew: device would hold 3 units
    assert info.tier == "host" and cache.manager.used("device") == size(n)
    cache.release(held)


def test_disk_budget_refuses_new_bytes(tmp_path):
    n = 100
    cache = make_cache(tmp_path, disk=2 * size(n) + 10)
    sid = cache.create("toy", None, data(n, 0)).id
    cache.create("toy", None, data(n, 1))
    with pytest.raises(CacheFull, match="storage is full"):
        cache.create("toy", None, data(n, 2))
    lease = cache.acquire(sid, None)
    with pytest.raises(CacheFull):
        cache.commit(lease, data(n + 10, 3))
    cache.release(lease)
    assert cache.info(sid, None).version == 0
    assert same(cache.acquire(sid, None).data, data(n, 0))


def test_restart_finds_every_session_at_its_last_committed_version(tmp_path):
    cache = make_cache(tmp_path, device=10**6)
    sid = cache.create("toy", "owner-1", data(10, 0)).id
    commit(cache, sid, data(11, 1), owner="owner-1")
    other = cache.create("toy", None, data(3, 2)).id
    lease = cache.acquire(other, None)  # in flight at the "crash": never committed
    (tmp_path / "state" / f".{other}.dead.tmp").write_bytes(b"half a write")
    del cache, lease  # no close(): as after kill -9

    again = make_cache(tmp_path, device=10**6)
    assert {s.id: s.version for s in again.sessions()} == {sid: 1, other: 0}
    assert again.info(sid, "owner-1").tier == "disk"
    with pytest.raises(SessionNotFound):
        again.info(sid, None)  # another owner
    assert same(again.acquire(sid, "owner-1").data, data(11, 1))
    assert same(again.acquire(other, None).data, data(3, 2))
    assert not list((tmp_path / "state").glob("*.tmp"))


def test_a_corrupt_file_is_detected_by_its_checksum(tmp_path):
    cache = make_cache(tmp_path, device=size(50), host=0)
    sid = cache.create("toy", None, data(50, 0)).id
    cache.create("toy", None, data(50, 1))
    assert cache.info(sid, None).tier == "disk"
    path = tmp_path / "state" / f"{sid}.safetensors"
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x01  # one bit in the last tensor
    path.write_bytes(bytes(blob))
    with pytest.raises(SessionUnavailable, match="checksum"):
        cache.acquire(sid, None)
    assert cache.info(sid, None).in_use is False


@pytest.mark.parametrize("damage", [(b'"nbytes"', b'"nbztes"'), (b'"tokens":"5"', b'"tokens":"x"')])
def test_a_header_that_parses_but_lacks_a_field_fails_its_own_session_at_start(tmp_path, damage):
    """A header whose JSON still parses after damage (a key's letter, a digit turned letter) is
    moved aside as .corrupt when the directory is opened, with a warning; the server starts and
    serves every other session."""
    cache = make_cache(tmp_path)
    sid = cache.create("toy", None, data(10, 0)).id
    other = cache.create("toy", None, data(10, 1)).id
    cache.close()
    path = tmp_path / "state" / f"{sid}.safetensors"
    blob = path.read_bytes()
    assert blob.count(damage[0]) == 1
    path.write_bytes(blob.replace(*damage))
    cache = make_cache(tmp_path)  # opens the directory: no crash
    with pytest.raises(SessionNotFound):
        cache.info(sid, None)
    assert path.with_suffix(".corrupt").exists()
    assert same(cache.acquire(other, None).data, data(10, 1))


def test_a_file_the_system_cannot_read_at_start_is_left_in_place_and_a_failed_rename_does_not_stop_the_start(
        tmp_path, monkeypatch):
    """At start, a session file that cannot be read for a reason that says nothing of its
    contents (EIO, EMFILE, EACCES) is not moved aside as .corrupt: it stays, skipped with an error,
    and a later start serves it. A corrupt file whose rename fails is skipped too; neither stops
    the start."""
    import errno
    from pathlib import Path

    from xlserve.server.cache.stores import DiskStore

    cache = make_cache(tmp_path)
    unlucky = cache.create("toy", None, data(10, 0)).id
    corrupt = cache.create("toy", None, data(10, 1)).id
    fine = cache.create("toy", None, data(10, 2)).id
    cache.close()
    state = tmp_path / "state"
    (state / f"{corrupt}.safetensors").write_bytes(b"not a safetensors file")
    read_head = DiskStore._read_head

    def failing_read(store, path):
        if unlucky in path.name:
            raise OSError(errno.EIO, "Input/output error")
        return read_head(store, path)

    def failing_rename(path, target):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(DiskStore, "_read_head", failing_read)
    monkeypatch.setattr(Path, "rename", failing_rename)
    cache = make_cache(tmp_path)  # starts
    assert same(cache.acquire(fine, None).data, data(10, 2))
    for skipped in (unlucky, corrupt):
        with pytest.raises(SessionNotFound):
            cache.info(skipped, None)
    assert (state / f"{unlucky}.safetensors").exists() and not (state / f"{unlucky}.corrupt").exists()
    cache.close()
    monkeypatch.undo()
    cache = make_cache(tmp_path)  # the disk reads again: the session is served, the corrupt file goes aside
    assert same(cache.acquire(unlucky, None).data, data(10, 0))
    assert (state / f"{corrupt}.corrupt").exists()
    cache.close()


def test_shutdown_writes_every_session_lacking_its_durable_copy_though_one_write_fails(tmp_path, monkeypatch, caplog):
    """close() writes each session whose durable copy is in doubt; one write that fails is logged
    as an error and the others are still written (it used to stop at the first failure, and left
    the store unclosed)."""
    cache = make_cache(tmp_path)
    ids = [cache.create("toy", None, data(10, i)).id for i in range(3)]
    with cache._lock:
        for session_id in ids:
            cache.placement.doubt_durable_copy(cache.manager.get(session_id))
    write, attempted, closed = cache.durable.write, [], []

    def failing_first(record, *args, **kwargs):
        attempted.append(record.id)
        if len(attempted) == 1:
            raise SessionUnavailable("the disk is failing", record.id)
        return write(record, *args, **kwargs)

    monkeypatch.setattr(cache.durable, "write", failing_first)
    monkeypatch.setattr(cache.durable, "close", lambda: closed.append(True))
    with caplog.at_level("ERROR", logger="xlserve.cache"):
        cache.close()
    assert sorted(attempted) == sorted(ids) and closed == [True]
    assert cache.durable.written["whole"][0] == 3 + 2  # the three creates, then two of the three at shutdown
    assert any("could not be written at shutdown" in r.getMessage() for r in caplog.records)


def test_fork_diverges_export_round_trips_replace_commits(tmp_path):
    cache = make_cache(tmp_path)
    sid = cache.create("toy", None, data(10, 0)).id
    fork = cache.fork(sid, None)
    assert fork.id != sid and fork.version == 0 and fork.tokens == 5
    commit(cache, fork.id, data(10, 1))
    assert same(cache.acquire(sid, None).data, data(10, 0))

    info, blob = cache.export(fork.id, None)
    meta, tensors, next_log_probs = decode(blob)
    assert meta["model"] == "toy" and meta["tokens"] == "5" and meta["owner"] == "" and meta["version"] == "1"
    assert torch.equal(next_log_probs, data(10, 1).next_log_probs) and set(tensors) == {"memory", "layers.0", "layers.1"}


def test_delete_and_unknown_ids(tmp_path):
    cache = make_cache(tmp_path)
    sid = cache.create("toy", None, data(10, 0)).id
    for bad in ["sess_nope", "../../etc/passwd", sid.upper()]:
        with pytest.raises(SessionNotFound):
            cache.acquire(bad, None)
    lease = cache.acquire(sid, None)
    with pytest.raises(SessionLocked):
        cache.delete(sid, None)
    cache.release(lease)
    cache.delete(sid, None)
    assert not (tmp_path / "state" / f"{sid}.safetensors").exists()
    with pytest.raises(SessionNotFound):
        cache.info(sid, None)
    assert cache.manager.used("disk") == 0


def sample(metrics: Metrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_metrics_follow_the_tiers(tmp_path):
    n = 100
    metrics = Metrics()
    cache = make_cache(tmp_path, device=size(n), host=size(n), metrics=metrics)
    ids = [cache.create("toy", None, data(n, i)).id for i in range(3)]
    assert [sample(metrics, "xlserve_sessions", model="toy", tier=t) for t in ("device", "host", "disk")] == [1, 1, 1]
    assert sample(metrics, "xlserve_session_state_bytes", model="toy", tier="disk") == 3 * size(n)
    cache.release(cache.acquire(ids[0], None))  # from disk
    assert sample(metrics, "xlserve_session_cache_hits_total", model="toy", tier="disk") == 1
    assert sample(metrics, "xlserve_session_cache_misses_total", model="toy", tier="device") == 1
    assert sample(metrics, "xlserve_session_cache_misses_total", model="toy", tier="host") == 1
    assert sample(metrics, "xlserve_session_promotions_total", model="toy", tier="disk") == 1
    assert sample(metrics, "xlserve_session_evictions_total", model="toy", tier="device") == 3
    assert sample(metrics, "xlserve_session_restore_latency_seconds_count", model="toy", tier="disk") == 1
    assert [sample(metrics, "xlserve_sessions", model="toy", tier=t) for t in ("device", "host", "disk")] == [1, 1, 1]


def test_a_failed_write_that_may_have_landed_is_rewritten_before_the_session_leaves_memory(tmp_path, monkeypatch):
    """A whole write whose rename landed but whose directory sync failed is answered as failed:
    the file may hold the failed version while the books keep the acknowledged one. The disk copy
    is then in doubt, so it is not counted as a copy: evicting the session writes it again from
    memory, instead of leaving a file every later read refuses (503 until a restart)."""
    from xlserve.server.cache.stores import DiskStore

    cache = make_cache(tmp_path, device=size(50), host=0)
    sid = cache.create("toy", None, data(50, 0)).id
    lease = cache.acquire(sid, None)
    sync = DiskStore._sync_directory
    monkeypatch.setattr(DiskStore, "_sync_directory", lambda self: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(SessionUnavailable):
        cache.commit(lease, data(50, 1))
    monkeypatch.setattr(DiskStore, "_sync_directory", sync)
    cache.release(lease)
    assert cache.info(sid, None).version == 0
    other = cache.create("toy", None, data(50, 2)).id  # takes the device: the first session leaves memory
    assert cache.info(sid, None).tier == "disk"
    lease = cache.acquire(sid, None)
    assert lease.version == 0 and same(lease.data, data(50, 0))
    cache.commit(lease, data(50, 3))
    cache.close()
    cache = make_cache(tmp_path, device=size(50), host=0)  # and after a restart
    lease = cache.acquire(sid, None)
    assert lease.version == 1 and same(lease.data, data(50, 3))
    cache.release(lease)
    assert same(cache.acquire(other, None).data, data(50, 2))


def test_a_session_homed_on_host_ram_is_never_copied_under_the_caches_lock(tmp_path, monkeypatch):
    """A session larger than the device's budget lives on host RAM: on a GPU each request copies
    it to the device and each commit or read from disk copies it back, hundreds of MB at real
    size. Those copies are made outside the cache's lock, which every other session's acquire and
    commit needs. On the CPU a copy is the tensors themselves, so what is checked is that the
    cache asks for none under the lock (a store's `put` given a copy made already is a no-op)."""
    from xlserve.server.cache.codec import SessionData
    from xlserve.server.cache.stores import MemoryStore

    cache = make_cache(tmp_path, device=size(10), host=size(200))
    copies_under_the_lock, in_put = [], []
    to, put = SessionData.to, MemoryStore.put

    def watched_to(self, device):
        if cache._lock._is_owned() and not in_put:
            copies_under_the_lock.append(str(device))
        return to(self, device)

    def watched_put(self, session_id, data, device=None):
        in_put.append(1)
        try:
            return put(self, session_id, data, device)
        finally:
            in_put.pop()

    monkeypatch.setattr(SessionData, "to", watched_to)
    monkeypatch.setattr(MemoryStore, "put", watched_put)
    sid = cache.create("toy", None, data(50, 0)).id  # kept on host RAM
    assert cache.info(sid, None).tier == "host"
    commit(cache, sid, data(50, 1))
    cache.move(sid, "disk")
    lease = cache.acquire(sid, None)  # read from disk, kept on host RAM again
    assert same(lease.data, data(50, 1))
    cache.commit(lease, data(50, 2))
    assert cache.info(sid, None).tier == "host"
    assert same(cache.placement.host.get(sid), data(50, 2))
    assert copies_under_the_lock == []


def test_a_commit_whose_host_copy_fails_still_answers_success_and_holds_nothing(tmp_path, monkeypatch):
    """A session homed on host RAM: its write landed, then the copy to host RAM failed (out of
    host memory). The commit answers success, the lease and the bytes it booked are given back,
    and the session is read back from disk when next used."""
    from xlserve.server.cache.codec import SessionData

    cache = make_cache(tmp_path, device=size(10), host=size(200))
    sid = cache.create("toy", None, data(50, 0)).id
    lease = cache.acquire(sid, None)
    to = SessionData.to
    monkeypatch.setattr(SessionData, "to", lambda self, device: (_ for _ in ()).throw(RuntimeError("out of memory"))
                        if device == "cpu" else to(self, device))
    info = cache.commit(lease, data(50, 1))
    monkeypatch.setattr(SessionData, "to", to)
    assert info.version == 1 and cache.info(sid, None).tier == "disk"
    assert cache.manager.used("disk") == size(50)  # nothing left booked
    lease = cache.acquire(sid, None)  # not held by the commit
    assert same(lease.data, data(50, 1))
    cache.release(lease)


def test_a_create_whose_write_may_have_landed_leaves_no_session_behind(tmp_path, monkeypatch):
    """A create whose rename landed but whose directory sync failed is answered as failed: its
    file goes, so that a restart does not list a session the client was never given."""
    from xlserve.server.cache.stores import DiskStore

    cache = make_cache(tmp_path)
    sync = DiskStore._sync_directory
    monkeypatch.setattr(DiskStore, "_sync_directory", lambda self: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(SessionUnavailable):
        cache.create("toy", None, data(10, 0))
    monkeypatch.setattr(DiskStore, "_sync_directory", sync)
    assert cache.sessions() == [] and cache.manager.used("disk") == 0
    cache.close()
    assert make_cache(tmp_path).sessions() == []


def test_the_room_made_for_a_session_is_booked_before_the_prefix_cache_gives_any_back(tmp_path):
    """Bringing a session to the device takes room back from the prefix cache (it holds entries in
    the room sessions leave) and moves idle sessions down; the prefix cache reads that room without
    the session cache's lock. The session's bytes are booked before any room is given back, so an
    offer meanwhile (from an engine's thread) sees none free: it took the room just given back, and
    sessions and entries together passed the device's budget."""
    n = 100

    class Borrower:
        def __init__(self):
            self.holding, self.free_seen = {"device": size(n)}, []

        def held(self, tier: str) -> int:
            return self.holding.get(tier, 0)

        def release(self, tier: str, nbytes: int) -> None:
            self.holding[tier] -= nbytes
            self.free_seen.append(cache.manager.free(tier))  # what an offer made now would see

    cache = make_cache(tmp_path, device=2 * size(n))
    kept = cache.create("toy", None, data(n, 0)).id
    brought = cache.create("toy", None, data(n, 1)).id
    cache.move(brought, "disk")
    borrower = Borrower()
    cache.lend_to(borrower)  # the device: one session and one session's worth of entries, full
    lease = cache.acquire(brought, None)
    assert same(lease.data, data(n, 1))
    cache.release(lease)
    assert borrower.free_seen == [0]
    assert cache.manager.used("device") + borrower.held("device") <= 2 * size(n)
    assert cache.info(kept, None).tier == "device"


def test_a_session_moved_out_of_the_way_is_free_before_the_slow_read_it_made_room_for(tmp_path, monkeypatch):
    """Acquiring a session from disk moves an idle one off the device for it; the moved session's
    own request waits for its move, not for the other's read (seconds from disk or Redis at real
    size: it waited for all of it)."""
    import threading
    import time

    n = 100
    cache = make_cache(tmp_path, device=2 * size(n), host=4 * size(n))
    slow = cache.create("toy", None, data(n, 0)).id
    cache.move(slow, "disk")
    idle = cache.create("toy", None, data(n, 1)).id
    cache.create("toy", None, data(n, 2))  # used last: `idle` is the one moved for the slow read
    assert cache.info(idle, None).tier == "device" and cache.info(slow, None).tier == "disk"
    reading, read = threading.Event(), cache.placement.read

    def slow_read(record, tier, to_device=True):
        if record.id == slow:
            reading.set()
            time.sleep(1.0)
        return read(record, tier, to_device)

    monkeypatch.setattr(cache.placement, "read", slow_read)
    acquired = []
    thread = threading.Thread(target=lambda: acquired.append(cache.acquire(slow, None)))
    thread.start()
    assert reading.wait(10)
    started = time.monotonic()
    lease = cache.acquire(idle, None)  # moved to host RAM for the slow one: free already
    waited = time.monotonic() - started
    thread.join(10)
    assert waited < 0.5 and cache.info(slow, None).tier == "device"
    assert same(lease.data, data(n, 1)) and same(acquired[0].data, data(n, 0))
    cache.release(lease), cache.release(acquired[0])
