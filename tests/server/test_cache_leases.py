"""Leases (server/cache/leases.py): who holds which session, hold ids, and waiting out a move."""

import threading
import time

import pytest

from xlserve.server.cache.errors import SessionLocked
from xlserve.server.cache.leases import COMMIT, MOVE, NEW, REQUEST, Holds
from xlserve.server.cache.manager import CacheManager, Record


def books(*ids: str) -> tuple[CacheManager, Holds, threading.RLock]:
    manager = CacheManager({"device": None, "disk": None})
    for session_id in ids:
        manager.add(Record(id=session_id, model="toy", owner=None, nbytes=1, tokens=0, version=0, created_at=0,
                           last_used_at=0, copies={"disk"}))
    lock = threading.RLock()
    return manager, Holds(manager, lock), lock


def test_a_request_holds_a_session_alone_and_its_hold_is_pinned():
    manager, holds, lock = books("a", "b")
    with lock:
        first = holds.take("a")
        assert holds.kind("a") == REQUEST and holds.leased("a") and manager.get("a").pinned
        with pytest.raises(SessionLocked):
            holds.take("a")
        other = holds.take("b")
        assert other != first  # every hold has its own id
        assert holds.give_back("a", first)
        assert not manager.get("a").pinned and holds.kind("a") is None
        assert holds.give_back("a", first) is False  # a second release changes nothing


def test_a_stale_hold_id_never_ends_a_newer_hold():
    manager, holds, lock = books("a")
    with lock:
        old = holds.take("a")
        holds.give_back("a", old)
        new = holds.take("a")
        assert holds.give_back("a", old) is False  # the late release of the first lease
        assert holds.holds("a", new) and manager.get("a").pinned


def test_the_cache_moving_a_session_is_not_a_request_holding_it():
    manager, holds, lock = books("a", "b")
    with lock:
        hold = holds.take("a", MOVE)
        assert manager.get("a").pinned  # no plan moves it meanwhile
        assert not holds.leased("a")  # but no request holds it: SessionInfo.in_use stays False
        with pytest.raises(RuntimeError, match="wait for it first"):
            holds.take("a")  # a request must wait for the move, not be told 409
        holds.take("b", NEW)
        assert holds.kind("b") == NEW and manager.get("b").pinned and not holds.leased("b")
        holds.give_back("a", hold)


def test_settled_waits_until_the_move_ends():
    manager, holds, lock = books("a")
    with lock:
        hold = holds.take("a", MOVE)

    def finish_the_move():
        time.sleep(0.2)
        with lock:
            holds.give_back("a", hold)

    mover = threading.Thread(target=finish_the_move)
    started = time.monotonic()
    with lock:  # taken before the mover starts: it can give the hold back only while settled waits
        mover.start()
        assert holds.settled("a") is False  # it waited (the lock given up meanwhile): look it up again
        assert time.monotonic() - started >= 0.15
        assert holds.settled("a") is True
        lease = holds.take("a")
    mover.join()
    assert holds.leased("a") and lease


def test_a_hold_outlives_the_record_it_held():
    manager, holds, lock = books("a")
    with lock:
        hold = holds.take("a")
        manager.remove("a")  # deleted while held
        assert holds.give_back("a", hold)
        assert holds.kind("a") is None


def test_a_request_that_leaves_during_its_commit_hands_its_hold_to_the_commit():
    manager, holds, lock = books("a")
    with lock:
        lease = holds.take("a")
        assert holds.hand_over("a", lease + 1) is False and holds.kind("a") == REQUEST  # not its hold
        assert holds.hand_over("a", lease)
        assert holds.kind("a") == COMMIT and not holds.leased("a") and manager.get("a").pinned
        with pytest.raises(RuntimeError, match="wait for it"):
            holds.take("a")  # a request waits for the write (settled), it is not told 409
        assert holds.give_back("a", lease)  # the commit ends it, by the same id
        assert holds.kind("a") is None and not manager.get("a").pinned
