"""The cache manager: bookkeeping of where every session's state lives. It moves no bytes.

In the spirit of vLLM's KV cache manager, this class only counts and decides. It knows, for
every session, its model, owner, size in bytes, version, last use, whether a running request
holds it (pinned), and which tiers hold a copy of its state. It answers "can this fit in that
tier now, and who has to move for it?" with a plan of moves, or None when the answer is no.
The session cache (server/cache/session_cache.py) carries the plans out through the stores.

Tiers, fastest first: device → host → disk → redis (the last one only when configured). Each
has a byte budget (None = unbounded). A session may have copies in several tiers; its `tier`
is the fastest one. The *last* tier always holds a copy of every session: that is the
write-through rule that makes commits durable (see session_cache.py). Nothing is ever evicted
from the last tier, so its budget is an admission limit: when it is full, new bytes are
refused.

Eviction: when a tier is over budget, its least recently used idle session moves down: its copy
there is dropped, after a copy is made in the next tier below that can hold it, unless a lower
tier already has one (with write-through it usually has: moving a session from host to disk
costs nothing). Pinned sessions never move. Byte counts are exact sums of what the copies a
tier holds occupy (`Record.size_in`: the state's `nbytes`, and on disk the session's log of
delta commits besides); a session counts once per tier that holds a copy.

Lent bytes: a tier's budget is shared with the prefix-state cache (prefix_cache.py), which may
keep its entries in whatever room the sessions leave (`lent(tier)`: the bytes it holds there).
Sessions come first: a plan that needs room takes it from the lent bytes before it moves any
session (a `Reclaim` in the plan, carried out by the prefix cache dropping its least recently
used entries of that tier), since entries are a cache and sessions are data.
"""

from __future__ import annotations

import collections
import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

TIERS = ("device", "host", "disk", "redis")


def home_tier(nbytes: int, budgets: dict[str, int | None]) -> str:
    """Where a session of `nbytes` is kept between requests: the device, or host RAM when it is
    larger than the device's whole budget and there is a host tier (a host budget of 0: none)."""
    device, host = budgets.get("device"), budgets.get("host", 0)
    return "host" if device is not None and nbytes > device and host != 0 else "device"


def tier_too_small(nbytes: int, budgets: dict[str, int | None], last_tier: str) -> tuple[str, int] | None:
    """The tier, and its budget, whose whole budget a session of `nbytes` exceeds among those it
    must fit (its home, `home_tier`, and the last tier): such a session could never be served.
    None when it fits them (budgets of None are unbounded)."""
    for tier in dict.fromkeys((home_tier(nbytes, budgets), last_tier)):
        budget = budgets.get(tier)
        if budget is not None and nbytes > budget:
            return tier, budget
    return None


def new_commit_id() -> str:
    """A fresh `Record.commit_id`: 64 random bits."""
    return secrets.token_hex(8)


def commit_of(meta: dict) -> str:
    """The commit id a session's stored metadata names: "" when written before commit ids, or
    when it is not a string (as the Redis scripts' `commit_of` reads it, stores.py)."""
    commit = meta.get("commit")
    return commit if isinstance(commit, str) else ""


@dataclass
class Record:
    """What the manager knows about one session."""

    id: str
    model: str
    owner: str | None
    nbytes: int  # bytes of the committed state (what every copy holds)
    tokens: int
    version: int
    created_at: float
    last_used_at: float  # wall time, reported to users
    copies: set[str] = field(default_factory=set)  # tiers holding the committed state
    pinned: bool = False  # a request holds a lease
    # Idempotency-Key entries, newest first, as in the durable copy (without Redis; with Redis,
    # Redis holds them and they are read from there when a request carries a key)
    remembered: list[dict] = field(default_factory=list)
    # the fingerprint of the create or import with an Idempotency-Key that made it (its id comes
    # from the key: session_cache.py keyed_session_id), kept for its whole life; "" for any other
    made_by: str = ""
    use_seq: int = 0  # monotonic use counter: the LRU order (wall clocks can tie or step back)
    # bytes of the session's log of delta commits beside its base file, where the disk is the last
    # tier (stores.py `DiskStore.append`): up to compact_ratio times the base, on disk as surely
    # as the base, so the disk's budget counts them too
    disk_log_bytes: int = 0
    # names the commit that made this version (random, kept by a compaction): with Redis, the
    # version alone does not say which state it is. A session deleted and made anew under the
    # same keyed id, or a version Redis lost in a failover and another replica wrote again,
    # reach the same number with another state; a replica compares this too before it trusts
    # its own copy, and every write compare-and-sets on it with the version (stores.py). "" for
    # sessions written before it existed.
    commit_id: str = ""

    @property
    def tier(self) -> str:
        return next(t for t in TIERS if t in self.copies) if self.copies else "none"

    def size_in(self, tier: str) -> int:
        """Bytes a copy in `tier` occupies: the state, and on disk its log as well."""
        return self.nbytes + (self.disk_log_bytes if tier == "disk" else 0)


@dataclass(frozen=True)
class Move:
    """Put a copy of `session` into `dst` (None: no new copy, a lower tier has one), then drop
    its copy in `src`."""

    session: str
    src: str
    dst: str | None


@dataclass(frozen=True)
class Reclaim:
    """Take `nbytes` of `tier` back from whoever borrowed them (the prefix cache)."""

    tier: str
    nbytes: int


class _PlannedCopies(dict):
    """Each session's tiers as a plan (`CacheManager.plan_room`) changes them: a session's own set
    until the plan first asks for it to change it, then a copy of it. Copying every session's set
    for every plan cost a request time in proportion to the sessions in the books."""

    def __init__(self, records: dict[str, Record]):
        super().__init__()
        self.records = records

    def __missing__(self, session_id: str) -> set[str]:
        copies = self[session_id] = set(self.records[session_id].copies)
        return copies

    def peek(self, session_id: str) -> set[str]:
        """The session's tiers as planned so far, to read only (no copy made)."""
        return dict.__getitem__(self, session_id) if session_id in self else self.records[session_id].copies


class CacheManager:
    def __init__(self, budgets: dict[str, int | None]):
        """budgets: tier -> bytes (None = unbounded), for the tiers in use, in TIERS order."""
        unknown = set(budgets) - set(TIERS)
        if unknown:
            raise ValueError(f"unknown tiers {sorted(unknown)}")
        self.tiers = [t for t in TIERS if t in budgets]
        self.budgets = dict(budgets)
        self.records: dict[str, Record] = {}
        self._used = {t: 0 for t in self.tiers}
        self._reserved = {t: 0 for t in self.tiers}  # bytes booked for writes in flight (`reserve`)
        self._seq = itertools.count(1)
        self.lent: Callable[[str], int] = lambda tier: 0  # bytes of a tier the prefix cache holds
        # (model, tier) -> [sessions whose fastest copy is there, bytes held there], kept as the
        # books change (`_count`): `by_tier` is read at every request (the metrics), and counting
        # it over every record took 71 ms a request with 10,000 sessions in the books
        self._tallies: dict[tuple[str, str], list[int]] = {}
        # owner -> sessions in the books (an API key's quota, XLSERVE_MAX_SESSIONS_PER_KEY): an
        # owner never changes, so only `add` and `remove` count
        self._owned: collections.Counter = collections.Counter()

    def lend(self, lent: Callable[[str], int]) -> None:
        """Share the budgets with a borrower whose holdings per tier `lent` reports."""
        self.lent = lent

    # -- queries ------------------------------------------------------------------------------

    @property
    def last_tier(self) -> str:
        return self.tiers[-1]

    def used(self, tier: str) -> int:
        """Bytes of `tier` the sessions' copies hold, and those booked for writes in flight."""
        return self._used[tier] + self._reserved[tier]

    def free(self, tier: str) -> int | None:
        """Room the sessions leave in `tier` (lent bytes count as free: sessions may take them)."""
        budget = self.budgets[tier]
        return None if budget is None else budget - self.used(tier)

    def get(self, session_id: str) -> Record | None:
        return self.records.get(session_id)

    def owned(self, owner: str | None) -> int:
        """How many sessions of `owner` the books hold."""
        return self._owned[owner]

    def by_tier(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(model, tier) -> (sessions whose fastest copy is there, bytes held there)."""
        return {key: (count, nbytes) for key, (count, nbytes) in self._tallies.items() if count or nbytes}

    def _count(self, record: Record, sign: int) -> None:
        """Count `record` in (1) or out of (-1) the books, as its copies and sizes are: each tier's
        bytes used and `by_tier`'s tallies. Every change counts a record out, changes it, and
        counts it back in."""
        self._tallies.setdefault((record.model, record.tier), [0, 0])[0] += sign
        for t in record.copies:
            self._used[t] += sign * record.size_in(t)
            self._tallies.setdefault((record.model, t), [0, 0])[1] += sign * record.size_in(t)

    def lru(self, tier: str, exclude: set[str] = frozenset()) -> list[Record]:
        """Idle sessions with a copy in `tier`, least recently used first."""
        idle = [r for r in self.records.values() if tier in r.copies and not r.pinned and r.id not in exclude]
        return sorted(idle, key=lambda r: r.use_seq)

    # -- planning (pure: nothing changes until `apply`) ---------------------------------------

    def plan_room(self, tier: str, nbytes: int, exclude: set[str] = frozenset()) -> list[Move | Reclaim] | None:
        """Moves that leave `nbytes` free in `tier` (on top of what it holds now), or None when
        that is impossible without touching pinned or excluded sessions. nbytes=0 asks for a tier
        back within its budget."""
        used = {t: self.used(t) for t in self.tiers}
        copies = _PlannedCopies(self.records)
        moves: list[Move] = []
        if self._make_room(tier, nbytes, set(exclude), used, copies, moves):
            return moves
        return None

    def _lru_sim(self, tier, exclude, copies) -> list[Record]:
        idle = [r for r in self.records.values() if tier in copies.peek(r.id) and not r.pinned and r.id not in exclude]
        return sorted(idle, key=lambda r: r.use_seq)

    def _make_room(self, tier, nbytes, exclude, used, copies, moves) -> bool:
        budget = self.budgets[tier]
        if budget is None:
            return True
        lent = max(0, self.lent(tier) - used.get(("reclaimed", tier), 0))
        over = used[tier] + lent + nbytes - budget
        if over <= 0:
            return True
        if lent:  # lent bytes first: the borrower's entries are a cache
            take = min(lent, over)
            used[("reclaimed", tier)] = used.get(("reclaimed", tier), 0) + take
            moves.append(Reclaim(tier, take))
        if used[tier] + nbytes <= budget:
            return True
        if nbytes > budget or tier == self.last_tier:
            return False
        for victim in self._lru_sim(tier, exclude, copies):
            if used[tier] + nbytes <= budget:
                break
            self._demote(victim, tier, exclude, used, copies, moves)  # on failure it changes nothing
        return used[tier] + nbytes <= budget

    def _demote(self, victim: Record, tier: str, exclude, used, copies, moves) -> bool:
        """Move `victim` out of `tier` into the nearest tier below that can take it (making room
        there in turn), or just drop this copy when a lower tier reached first already has one."""
        have = copies[victim.id]
        dst = None
        for candidate in self.tiers[self.tiers.index(tier) + 1 :]:
            if candidate in have:
                break  # a lower copy exists: dropping this one loses nothing
            mark = len(moves)
            if self._make_room(candidate, victim.size_in(candidate), exclude | {victim.id}, used, copies, moves):
                dst = candidate
                break
            self._undo(moves, mark, used, copies)
        else:
            return False
        if dst is not None:
            have.add(dst)
            used[dst] += victim.size_in(dst)
        have.discard(tier)
        used[tier] -= victim.size_in(tier)
        moves.append(Move(victim.id, tier, dst))
        return True

    def _undo(self, moves, mark, used, copies) -> None:
        while len(moves) > mark:
            move = moves.pop()
            if isinstance(move, Reclaim):
                used[("reclaimed", move.tier)] -= move.nbytes
                continue
            record = self.records[move.session]
            copies[move.session].add(move.src)
            used[move.src] += record.size_in(move.src)
            if move.dst is not None:
                copies[move.session].discard(move.dst)
                used[move.dst] -= record.size_in(move.dst)

    # -- changes ------------------------------------------------------------------------------

    def add(self, record: Record) -> None:
        if record.id in self.records:
            raise KeyError(f"session {record.id} is already known")
        self._owned[record.owner] += 1  # first: an owner that is no key changes nothing
        record.use_seq = next(self._seq)
        self.records[record.id] = record
        self._count(record, 1)

    def remove(self, session_id: str) -> Record:
        record = self.records.pop(session_id)
        self._owned[record.owner] -= 1
        if not self._owned[record.owner]:
            del self._owned[record.owner]
        self._count(record, -1)
        return record

    def apply(self, move: Move | Reclaim) -> None:
        if isinstance(move, Reclaim):  # the borrower's books, not ours
            return
        record = self.records[move.session]
        self._count(record, -1)
        if move.dst is not None:
            record.copies.add(move.dst)
        record.copies.discard(move.src)
        self._count(record, 1)

    def add_copy(self, session_id: str, tier: str) -> None:
        record = self.records[session_id]
        if tier not in record.copies:
            self._count(record, -1)
            record.copies.add(tier)
            self._count(record, 1)

    def drop_copy(self, session_id: str, tier: str) -> None:
        record = self.records[session_id]
        if tier in record.copies:
            self._count(record, -1)
            record.copies.discard(tier)
            self._count(record, 1)

    def set_copies(self, session_id: str, tiers: set[str]) -> None:
        for t in set(self.records[session_id].copies) - tiers:
            self.drop_copy(session_id, t)
        for t in tiers:
            self.add_copy(session_id, t)

    def reserve(self, tier: str, nbytes: int) -> None:
        """Book `nbytes` of `tier` for a write in flight (a commit's growth in the last tier): no
        other plan counts them free until `unreserve`. Only that tier: the session's other copies
        keep their size until the write lands and they are replaced."""
        self._reserved[tier] += nbytes

    def unreserve(self, tier: str, nbytes: int) -> None:
        self._reserved[tier] -= nbytes

    def resize(self, session_id: str, nbytes: int, disk_log_bytes: int | None = None) -> None:
        """A commit changed the state's size (and the disk log's, when given); every copy must be
        replaced by the caller."""
        record = self.records[session_id]
        self._count(record, -1)
        record.nbytes = nbytes
        if disk_log_bytes is not None:
            record.disk_log_bytes = disk_log_bytes
        self._count(record, 1)

    def touch(self, session_id: str, now: float | None = None) -> None:
        record = self.records[session_id]
        record.use_seq = next(self._seq)
        if now is not None:
            record.last_used_at = now

    def pin(self, session_id: str) -> None:
        self.records[session_id].pinned = True

    def unpin(self, session_id: str) -> None:
        self.records[session_id].pinned = False
