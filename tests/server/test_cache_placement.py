"""Placement (server/cache/placement.py): tiers and budgets, plans booked under the lock at once,
bytes moved outside it by a Transfer, and the refusals."""

from __future__ import annotations

import threading

import pytest

from xlserve.server.cache.codec import encode
from xlserve.server.cache.durable import DurableStore
from xlserve.server.cache.errors import CacheFull, SessionTooLarge, SessionUnavailable
from xlserve.server.cache.leases import MOVE, Holds
from xlserve.server.cache.manager import CacheManager, Record
from xlserve.server.cache.placement import Placement, Transfer
from xlserve.server.cache.stores import DiskStore
from tests.server.cache_helpers import MODEL, data, same, size

N = 100
UNIT = size(N)


class Cache:
    """A placement over a disk-only last tier, and sessions put where a test wants them."""

    def __init__(self, tmp_path, device=None, host=None, disk=None):
        self.manager = CacheManager({"device": device, "host": host, "disk": disk})
        self.lock = threading.RLock()
        self.holds = Holds(self.manager, self.lock)
        durable = DurableStore(DiskStore(tmp_path / "state"), None, {"toy": MODEL}, 1.0)
        self.placement = Placement(self.manager, durable, self.holds, self.lock)
        self.seeds: dict[str, int] = {}

    def add(self, name: str, tiers: tuple[str, ...], units: int = 1) -> Record:
        session_id = "sess_" + name * 32
        record = Record(id=session_id, model="toy", owner=None, nbytes=size(units * N), tokens=5, version=0,
                        created_at=0, last_used_at=0, copies={"disk", *tiers})
        value = data(units * N, len(self.seeds))
        self.seeds[session_id] = len(self.seeds)
        self.placement.disk.write(session_id, encode(value, self.placement.durable.metadata(record)))
        for tier in tiers:
            self.placement._store(tier).put(session_id, value)
        self.manager.add(record)
        return record

    def promote(self, record: Record) -> tuple[Transfer, int]:
        """Plan under the lock (the session held as a request would hold it)."""
        with self.lock:
            hold = self.holds.take(record.id)
            transfer = Transfer(self.placement)
            self.placement.promote(record, transfer)
            return transfer, hold

    def value(self, record: Record, units: int):
        """The state `add` stored for `record`."""
        return data(units * N, self.seeds[record.id])

    def tiers(self, *records: Record) -> list[set[str]]:
        return [set(r.copies) for r in records]


def test_a_promotion_is_booked_at_once_and_its_bytes_move_outside_the_lock(tmp_path):
    cache = Cache(tmp_path, device=2 * UNIT, host=2 * UNIT)
    a, b = cache.add("a", ("device",)), cache.add("b", ("device",))
    c = cache.add("c", ())
    transfer, hold = cache.promote(c)
    # booked: the device's room is c's, a (least recently used) is in host RAM in the books ...
    assert cache.tiers(a, b, c) == [{"host", "disk"}, {"device", "disk"}, {"device", "disk"}]
    assert cache.manager.used("device") == 2 * UNIT
    # ... while its bytes are in transit: held by the cache (no plan moves it, no request is told 409)
    assert cache.holds.kind(a.id) == MOVE and a.pinned and not cache.holds.leased(a.id)
    assert a.id not in cache.placement.device and a.id not in cache.placement.host
    seen_lock = []
    real_write = cache.placement.write

    def write(record, tier, value):
        seen_lock.append(cache.lock._is_owned())
        return real_write(record, tier, value)

    cache.placement.write = write
    transfer.run()  # outside the lock
    with cache.lock:
        fetched = transfer.finish()
        cache.holds.give_back(c.id, hold)
    assert seen_lock == [False]
    assert same(fetched, data(N, cache.seeds[c.id]))
    assert same(cache.placement.host.get(a.id), data(N, cache.seeds[a.id]))
    assert not a.pinned and cache.holds.kind(a.id) is None


def test_a_session_moved_twice_in_one_plan_goes_straight_to_its_last_place(tmp_path):
    # making room for c (two units) moves a to host RAM, then b to host RAM, which pushes a on
    # (it is host's least recently used; its file keeps it): a's device copy is let go, nothing
    # carried for it, and only b's bytes move
    cache = Cache(tmp_path, device=2 * UNIT, host=UNIT)
    h = cache.add("4", ("host",))
    a, b = cache.add("a", ("device",)), cache.add("b", ("device",))
    c = cache.add("c", (), units=2)
    transfer, hold = cache.promote(c)
    with cache.lock:
        moved = [step.move for step in transfer.steps if hasattr(step, "move")]
    assert [(m.session, m.src, m.dst) for m in moved] == [(b.id, "device", "host")]
    fetched = transfer.carry_out(cache.lock)
    assert cache.tiers(h, a, b, c) == [{"disk"}, {"disk"}, {"host", "disk"}, {"device", "disk"}]
    assert same(fetched, data(2 * N, cache.seeds[c.id]))
    assert set(cache.placement.host._data) == {b.id} and set(cache.placement.device._data) == {c.id}
    assert cache.manager.used("host") == UNIT and cache.manager.used("device") == c.nbytes


def test_an_eviction_that_fails_costs_speed_not_the_session(tmp_path):
    cache = Cache(tmp_path, device=UNIT, host=UNIT)
    a = cache.add("a", ("device",))
    c = cache.add("c", ())

    def host_is_broken(record, tier, value):
        raise MemoryError("no host RAM")

    cache.placement.write = host_is_broken
    transfer, hold = cache.promote(c)
    fetched = transfer.carry_out(cache.lock)  # the request does not fail for it
    assert same(fetched, data(N, cache.seeds[c.id]))
    assert cache.tiers(a, c) == [{"disk"}, {"device", "disk"}]  # a keeps its file, and loses nothing else
    assert cache.manager.used("host") == 0 and not a.pinned


def test_a_fetch_that_fails_gives_its_booked_room_back(tmp_path):
    cache = Cache(tmp_path, device=UNIT)
    a = cache.add("a", ())
    path = cache.placement.disk.path(a.id)
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x01
    path.write_bytes(bytes(blob))
    transfer, hold = cache.promote(a)
    assert cache.manager.used("device") == UNIT  # booked ...
    with pytest.raises(SessionUnavailable, match="checksum"):
        transfer.carry_out(cache.lock)
    assert cache.manager.used("device") == 0 and cache.tiers(a) == [{"disk"}]  # ... and given back

    unserved = cache.add("f", ("host",))
    unserved.model = "gone"
    transfer, hold = cache.promote(unserved)
    assert unserved.id not in cache.placement.host
    with pytest.raises(SessionUnavailable, match="does not serve"):
        transfer.carry_out(cache.lock)
    assert cache.tiers(unserved) == [{"host", "disk"}] and unserved.id in cache.placement.host  # as it was


def test_a_promotion_from_host_ram_that_fails_leaves_host_ram_within_its_budget(tmp_path):
    cache = Cache(tmp_path, device=UNIT, host=UNIT)
    a = cache.add("a", ("device",))
    c = cache.add("c", ("host",))
    c.model = "gone"  # its fetch fails: this server does not serve its model
    transfer, hold = cache.promote(c)  # c's room in host RAM is a's now (a leaves the device for it)
    with pytest.raises(SessionUnavailable, match="does not serve"):
        transfer.carry_out(cache.lock)
    # c does not go back to host RAM over its budget: it keeps its file, a keeps host RAM
    assert cache.tiers(a, c) == [{"host", "disk"}, {"disk"}]
    assert cache.manager.used("host") == UNIT and set(cache.placement.host._data) == {a.id}

def test_no_room_when_the_device_holds_only_sessions_in_use(tmp_path):
    cache = Cache(tmp_path, device=UNIT)
    a, b = cache.add("a", ("device",)), cache.add("b", ())
    with cache.lock:
        cache.holds.take(a.id)  # a request holds a
    with pytest.raises(CacheFull, match="in use"):
        cache.promote(b)
    assert cache.manager.used("device") == UNIT and cache.tiers(b) == [{"disk"}]
    no_host = Cache(tmp_path / "no-host", device=UNIT, host=0)
    with pytest.raises(SessionTooLarge, match="XLSERVE_DEVICE_STATE_BYTES"):
        no_host.promote(no_host.add("c", (), units=2))  # more than the whole device, and no host RAM to live in


def test_a_session_larger_than_the_device_budget_lives_on_host_ram(tmp_path):
    cache = Cache(tmp_path, device=UNIT, host=size(2 * N))
    small, large, other = cache.add("a", ("device",)), cache.add("b", (), units=2), cache.add("c", ("host",), units=2)
    transfer, hold = cache.promote(large)  # from disk: room is made on host RAM (c goes down), not on the device
    data = transfer.carry_out(cache.lock)
    assert same(data, cache.value(large, 2))
    assert cache.tiers(small, large, other) == [{"device", "disk"}, {"host", "disk"}, {"disk"}]
    assert cache.manager.used("device") == UNIT and cache.manager.used("host") == size(2 * N)
    with cache.lock:
        cache.holds.give_back(large.id, hold)
    transfer, hold = cache.promote(large)  # from host RAM: it stays there, the device keeps its one session
    assert same(transfer.carry_out(cache.lock), data)
    assert cache.tiers(small, large) == [{"device", "disk"}, {"host", "disk"}]
    assert set(cache.placement.host._data) == {large.id} and set(cache.placement.device._data) == {small.id}
    with cache.lock:
        cache.holds.give_back(large.id, hold)
    huge = cache.add("d", (), units=4)  # larger than host RAM's budget too: never
    with pytest.raises(SessionTooLarge, match="XLSERVE_HOST_STATE_BYTES"):
        cache.promote(huge)


def test_a_commit_books_its_growth_in_the_last_tier_until_it_lands_or_fails(tmp_path):
    cache = Cache(tmp_path, device=2 * UNIT, disk=3 * UNIT)
    a = cache.add("a", ("device",))
    with cache.lock:
        booked = cache.placement.reserve(a, 2 * UNIT)  # a commit of a, growing, in flight
        assert booked == UNIT and cache.manager.used("disk") == 2 * UNIT
        # only there: the device's copy is replaced when the commit lands, and counts its old size till then
        assert cache.manager.used("device") == UNIT and cache.manager.free("device") == UNIT and a.nbytes == UNIT
        newcomer = Record(id="sess_" + "b" * 32, model="toy", owner=None, nbytes=2 * UNIT, tokens=0, version=0,
                          created_at=0, last_used_at=0)
        with pytest.raises(CacheFull, match="storage is full"):
            cache.placement.admit(newcomer)  # the room is the commit's: nobody else gets it meanwhile
        cache.placement.unreserve(booked)  # the write failed
        assert cache.manager.used("disk") == UNIT
        cache.placement.admit(newcomer)
        assert cache.manager.used("disk") == 3 * UNIT
        with pytest.raises(SessionTooLarge):
            cache.placement.reserve(a, 4 * UNIT)


def test_move_puts_the_fastest_copy_in_a_tier(tmp_path):
    cache = Cache(tmp_path)
    a = cache.add("a", ("device",))
    for tier, expected in [("host", {"host", "disk"}), ("device", {"device", "host", "disk"}), ("disk", {"disk"})]:
        with cache.lock:
            transfer = Transfer(cache.placement)
            transfer.hold(a.id, cache.holds.take(a.id, MOVE))
            cache.placement.move(a, tier, transfer)
        transfer.carry_out(cache.lock)
        assert cache.tiers(a) == [expected] and not a.pinned
    assert a.id not in cache.placement.device and a.id not in cache.placement.host
