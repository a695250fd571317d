"""Leases: who holds which session (docs/design.md section 6).

A session has at most one holder at a time, and every hold has an id:

- REQUEST: a request's lease (acquire, then commit or release; a delete while it runs). Another
  request for the session is refused with SessionLocked (409 session_busy): one request at a time.
- MOVE: the session cache itself, while it moves the session's bytes between tiers (an eviction,
  a file of an old version being removed). The session is idle and only in transit, so a request
  for it waits until the move is done (one write or read) instead of being refused.
- NEW: a session being written for the first time (create, fork, import). Nobody knows its id
  yet; it is left out of every listing until it is written.
- COMMIT: a request's commit still being written after the request left (its release came while
  the commit ran: a client that disconnects while its commit is awaited). The hold stays until
  the write ends, so no later request starts from the state the commit is replacing; like a move,
  a request for the session waits for it (one write) instead of being refused.

The hold is what keeps a session's bytes still while they are read or written outside the cache's
lock: nothing reads, writes or moves the copies of a held session but its holder. A held session
is pinned in the manager, so no plan moves it. Giving a hold back names its id, so a late or
repeated release never ends a newer hold.

Every method here is called under the session cache's lock (`lock`, given to the constructor);
`wait` gives the lock up while it waits and has it again when it returns.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xlserve.server.cache.errors import SessionInfo, SessionLocked

if TYPE_CHECKING:
    from xlserve.server.cache.codec import SessionData
    from xlserve.server.cache.manager import CacheManager

REQUEST = "request"
MOVE = "move"
NEW = "new"
COMMIT = "commit"


@dataclass
class Lease:
    """A request's hold on a session: `data` is the committed state it starts from. A lease with
    `replay` holds nothing: the request's Idempotency-Key was seen before, and `replay` is that
    request's remembered entry (its first `result`, and the session's version and tokens after it)."""

    session_id: str
    version: int
    data: SessionData | None
    info: SessionInfo
    done: bool = field(default=False)
    replay: dict | None = None
    lease_id: int = 0  # the hold's id (Holds.take); 0 for a replay, which holds nothing
    # a commit is writing the lease's state: a release meanwhile is only recorded (release_asked),
    # and the commit ends the hold itself, whether it lands or fails
    committing: bool = False
    release_asked: bool = False


class Holds:
    """The table of holds: session id -> (hold id, kind)."""

    def __init__(self, manager: CacheManager, lock: threading.RLock):
        self.manager = manager
        self._changed = threading.Condition(lock)
        self._held: dict[str, tuple[int, str]] = {}
        self._ids = itertools.count(1)

    def kind(self, session_id: str) -> str | None:
        """Who holds the session: REQUEST, MOVE, NEW, or None."""
        held = self._held.get(session_id)
        return None if held is None else held[1]

    def leased(self, session_id: str) -> bool:
        """Whether a request holds the session (what SessionInfo.in_use reports)."""
        return self.kind(session_id) == REQUEST

    def holds(self, session_id: str, hold_id: int) -> bool:
        held = self._held.get(session_id)
        return held is not None and held[0] == hold_id

    def take(self, session_id: str, kind: str = REQUEST) -> int:
        """Hold an unheld session; the hold's id. SessionLocked when a request holds it; a
        session the cache holds must be waited for first (`settled`)."""
        held = self._held.get(session_id)
        if held is not None:
            if held[1] == REQUEST:
                raise SessionLocked(session_id)
            raise RuntimeError(f"session {session_id} is held by the cache ({held[1]}): wait for it first")
        hold_id = next(self._ids)
        self._held[session_id] = (hold_id, kind)
        if self.manager.get(session_id) is not None:
            self.manager.pin(session_id)
        return hold_id

    def give_back(self, session_id: str, hold_id: int) -> bool:
        """End the hold `hold_id` (False, changing nothing, when it is not the session's hold)."""
        if not self.holds(session_id, hold_id):
            return False
        del self._held[session_id]
        if self.manager.get(session_id) is not None:
            self.manager.unpin(session_id)
        self._changed.notify_all()
        return True

    def hand_over(self, session_id: str, hold_id: int) -> bool:
        """A request's hold becomes a COMMIT hold, same id: its request left while its commit is
        being written, and the commit gives the hold back when the write ends (False, changing
        nothing, when `hold_id` is not the session's hold)."""
        if not self.holds(session_id, hold_id):
            return False
        self._held[session_id] = (hold_id, COMMIT)
        return True

    def by_cache(self, session_id: str) -> bool:
        """Whether the cache itself holds the session (a move, a new session, or a left request's
        commit): a request waits for such a hold rather than being refused."""
        return self.kind(session_id) not in (None, REQUEST)

    def settled(self, session_id: str, timeout: float | None = None) -> bool:
        """True when the cache holds no move (nor a left request's commit) of the session;
        otherwise waits until some hold ends, or `timeout` seconds pass, and returns False (the
        caller looks the session up again: it may have changed meanwhile)."""
        if not self.by_cache(session_id):
            return True
        self.wait(timeout)
        return False

    def wait(self, timeout: float | None = None) -> None:
        """Until some hold ends, or `timeout` seconds pass (the lock is given up meanwhile)."""
        self._changed.wait(timeout)
