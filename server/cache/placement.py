"""Placement: which tiers hold each session's committed state, within their budgets (docs/design.md
section 6, "Tiers").

Tiers, fastest first: device (where the model runs) → host RAM → disk → Redis (with
XLSERVE_REDIS_URL), each with a byte budget. A request needs its session on the device
(`promote`); making room there moves the least recently used idle sessions down (device → host →
disk → Redis: the manager's plan, manager.py), and a commit that grew the device's sessions moves
them down again (`rebalance`). The last tier holds every session (durable.py) and never evicts:
its budget is an admission limit. When no room can be made the answer is CacheFull (503, retry
later); a state larger than the whole budget of the last tier, or of both memory tiers, is
SessionTooLarge (413), since no wait could help.

A session larger than the device's whole budget lives on host RAM instead (its home, `home`):
it is kept, booked and committed there, and a request runs it on the model's device unbooked, for
that request alone (on a CPU server the device is host RAM and the copy is the same tensors). So a
236 MB session with a 128 MB device budget is served, slower on a GPU (a copy to the device per
request), rather than refused.

Bytes move outside the cache's lock, in three steps:

1. under the lock, a plan is made and booked at once: the manager's books show every move done
   and the room it made taken by the session it was made for, so no other plan counts the same
   room twice; each session whose bytes will move is held (leases.py: MOVE), and a state leaving
   a memory tier is taken out of it then (a reference: no copy);
2. outside the lock, `Transfer.run` moves the bytes: a copy to host RAM, a file written to or
   read from disk, a state read from Redis, a file removed;
3. under the lock again, `Transfer.finish` records what happened: the copies made go into the
   memory stores, the holds are given back, and the books are mended where a step failed. An
   evicted session whose new copy could not be made keeps the copies below it (the last tier
   always has one), so a failed eviction costs speed, never a session; a file that could not be
   removed is removed at a later `sweep`.

One step of a plan still runs under the lock: a `Reclaim`, room the prefix cache borrowed, which
it gives back at once by dropping entries (prefix_cache.py `release`, under its own lock; for an
entry on disk that removes its file, never writes one). It must happen before another plan
counts the same room, and the prefix cache never calls back into this one.

Sessions in transit never cause a refusal: a move takes its session out of its old tier in the
books before its bytes go, so the device never counts one; and an idle session leaving the device
can always go, if not to a tier below then simply away (the last tier has its copy), so a full tier
below, even one full of sessions in transit, never keeps it there. The device is full only when the
sessions on it are in use, as before.

`Record.pinned` is the manager's view of a hold: a held session is never a plan's victim.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from xlserve.server.cache.codec import SessionData, encode_parts
from xlserve.server.cache.durable import DurableStore, store_call
from xlserve.server.cache.errors import CacheError, CacheFull, SessionReadOutOfMemory, SessionTooLarge, SessionUnavailable
from xlserve.server.cache.leases import MOVE, NEW, Holds
from xlserve.server.cache.manager import CacheManager, Move, Reclaim, Record, commit_of, home_tier, tier_too_small
from xlserve.server.cache.stores import Head, MemoryStore

log = logging.getLogger("xlserve.cache")

DELETED_REMEMBERED = 100_000  # deleted sessions remembered (about 20 MB): against stale heads, and as cursors

MEMORY_TIERS = ("device", "host")


def same_commit(record: Record, head: Head) -> bool:
    """Whether Redis's `head` is the very state the record describes: the same version, made by the
    same commit (manager.py `Record.commit_id`)."""
    return head.version == record.version and commit_of(head.meta) == record.commit_id


def overtaken(record: Record, head: Head) -> bool:
    """Whether Redis's `head`, read before the session was held, may not be what Redis holds now:
    older than the books (a commit of this replica landed since), or the same version from
    another commit. Read again once held, it is (no commit of this replica can land then)."""
    return head.version <= record.version and not same_commit(record, head)


class Placement:
    def __init__(self, manager: CacheManager, durable: DurableStore, holds: Holds, lock: threading.RLock,
                 metrics=None):
        self.manager = manager
        self.durable = durable
        self.holds = holds
        self.metrics = metrics
        self.device = MemoryStore()  # each state on its own model's device
        self.host = MemoryStore("cpu")
        self.disk = durable.disk
        self.borrower = None  # the prefix cache, once it shares the budgets (SessionCache.lend_to)
        self._lock = lock
        self._forgotten: list[str] = []  # sessions that left the books with a file perhaps left on disk
        # the latest sessions deleted here or seen deleted, with their owner and creation time: a
        # Redis head read before the delete must not bring one back into the books (session ids
        # are never reused), and a listing may go on after one (its place in the order)
        self._deleted: collections.OrderedDict[str, tuple[str | None, float]] = collections.OrderedDict()
        # sessions still in the books whose disk copy was dropped but whose file could not be removed,
        # and files a sweep could not remove (tried again at every sweep; how often each failed)
        self._left_files: list[str] = []
        self._removal_failures: dict[str, int] = {}
        self._published: set[tuple[str, str]] = set()

    # -- bytes, outside the lock (the caller holds the session) --------------------------------

    def read(self, record: Record, tier: str, to_device: bool = True) -> SessionData:
        """The committed state from `tier`, checked; on the session's model device unless
        `to_device` is False."""
        if tier == "device":
            return self.device.get(record.id)
        if tier == "host":
            data = self.host.get(record.id)
        elif tier == "disk":
            data = self.durable.read_disk(record)
        else:
            data = self.durable.fetch(record)
        return data.to(self.durable.spec(record).device) if to_device else data

    def write(self, record: Record, tier: str, data: SessionData) -> SessionData | None:
        """Make a copy of `data` for `tier`: the value to put in a memory store, or None once a
        disk file is written."""
        if tier == "device":
            return self.on_device(record.model, data)
        if tier == "host":
            return data.to("cpu")
        if tier == "disk":
            store_call(lambda: self.disk.write(record.id, encode_parts(data, self.durable.metadata(record))))
            return None
        raise ValueError("Redis copies are written by commits only")

    def on_device(self, model: str, data: SessionData) -> SessionData:
        spec = self.durable.models.get(model)
        return data if spec is None else data.to(spec.device)

    def sweep(self) -> None:
        """Remove the files of sessions that left the books (no lock needed for the files:
        nothing can reach those sessions any more), and the files left over by sessions still in
        them (`leave_file`), each under a hold taken here, so that no spill of the session is
        written or read meanwhile; a session held now keeps its file until a later sweep, and so
        does a file whose removal fails here."""
        with self._lock:
            forgotten, self._forgotten = self._forgotten, []
            left, self._left_files = self._left_files, []
            gone: list[str] = []
            held: list[tuple[str, int]] = []
            # a left file whose session has left the books since is a forgotten one's
            forgotten += [session_id for session_id in left if self.manager.get(session_id) is None]
            # a forgotten id may be in the books again (a keyed id: a create retried with its
            # Idempotency-Key), whose new file is not to go; held meanwhile, it cannot come back
            for session_id in dict.fromkeys(forgotten):
                if self.manager.get(session_id) is not None or self.holds.kind(session_id) == NEW:
                    self._removal_failures.pop(session_id, None)
                    continue
                if self.holds.kind(session_id) is None:
                    held.append((session_id, self.holds.take(session_id, MOVE)))
                else:
                    gone.append(session_id)
            for session_id in dict.fromkeys(left):
                record = self.manager.get(session_id)
                if record is None:
                    continue  # with the forgotten ones above
                elif self.holds.kind(session_id) is not None:
                    # held (a commit whose old spill could not be removed, its books not yet
                    # changed): judged at a later sweep, once the books say what the file is
                    self._left_files.append(session_id)
                elif "disk" in record.copies:  # a newer copy was written to disk since: the file is no longer left over
                    self._removal_failures.pop(session_id, None)
                    continue
                else:
                    held.append((session_id, self.holds.take(session_id, MOVE)))
        try:
            for session_id in gone + [session_id for session_id, _ in held]:
                try:
                    self.disk.delete(session_id)
                    self._removal_failures.pop(session_id, None)
                except OSError as error:
                    # tried again at the next sweep, for as long as it fails: a file left over is
                    # taken for a session on the next start (one answered as never made, or deleted)
                    failures = self._removal_failures[session_id] = self._removal_failures.get(session_id, 0) + 1
                    if failures == 1 or failures % 1000 == 0:
                        log.warning("session %s: its file could not be removed (%s; %d tries); a later sweep "
                                    "tries again", session_id, error, failures)
                    with self._lock:  # checked again then as it is now: the id may be a new session's by then
                        (self._forgotten if self.manager.get(session_id) is None else self._left_files).append(session_id)
        finally:
            if held:
                with self._lock:
                    for session_id, hold_id in held:
                        self.holds.give_back(session_id, hold_id)

    def leave_file(self, session_id: str) -> None:
        """A session's disk copy left the books but its file could not be removed: a later `sweep`
        removes it (a file left over would be taken for a session on the next start)."""
        with self._lock:
            self._left_files.append(session_id)

    def drop_stale_file(self, record: Record) -> None:
        """After a commit to Redis: remove the disk spill of the old version (the committer holds
        the session; the books drop it in `committed`)."""
        if self.durable.tier != "disk" and "disk" in record.copies:
            try:
                self.disk.delete(record.id)
            except OSError as error:
                log.warning("session %s: the disk copy of version %d could not be removed (%s); a later sweep "
                            "removes it", record.id, record.version, error)
                self.leave_file(record.id)

    # -- plans, under the lock -----------------------------------------------------------------

    def promote(self, record: Record, transfer: Transfer) -> None:
        """Bring a held session's committed state to its model's device: the room there, made by
        moving idle sessions down, is booked for it at once, and `transfer` carries the bytes
        (the moves first, then the fetch). CacheFull when the device has no room even after
        moving every idle session, SessionTooLarge when it never could."""
        source = record.tier
        if source == "device":
            self.count_hit(record.model, "device")
            transfer.add(_Fetched(self.device.get(record.id)))
            return
        if self.home(record.nbytes) == "host":  # larger than the device's budget: it stays on host RAM
            if source != "host":
                moves = self.manager.plan_room("host", record.nbytes, exclude={record.id})
                if moves is None:
                    raise self.full("host", record.model, record.nbytes, record.id)
                self._execute_for(record, "host", moves, transfer)
            transfer.add(_Fetch(record, source, self.host.get(record.id) if source == "host" else None, home="host"))
            return
        if source == "host":  # the copy leaves host RAM: its room there is free for the moves below
            self.manager.drop_copy(record.id, "host")
        moves = self.manager.plan_room("device", record.nbytes, exclude={record.id})
        if moves is None:
            if source == "host":
                self.manager.add_copy(record.id, "host")
            raise self.full("device", record.model, record.nbytes, record.id)
        self._execute_for(record, "device", moves, transfer)
        transfer.add(_Fetch(record, source, self._take_out(source, record.id) if source == "host" else None))

    def _execute_for(self, record: Record, tier: str, moves: list[Move | Reclaim], transfer: Transfer) -> None:
        """`_execute` the moves that make room in `tier` for `record`, whose copy there is booked
        then: its bytes are reserved before anything moves, since the prefix cache reads the room
        sessions leave without this cache's lock (PrefixCache.limit) and would otherwise take the
        room just given back to it, or freed by the moves, for an entry of its own meanwhile."""
        self.manager.reserve(tier, record.nbytes)
        try:
            self._execute(moves, transfer)
        finally:
            self.manager.unreserve(tier, record.nbytes)
        self.manager.add_copy(record.id, tier)  # the room the moves made is this session's now

    def rebalance(self, tier: str, transfer: Transfer) -> None:
        """Moves that bring `tier` back within its budget (after a commit or a new session), their
        bytes in `transfer`: the caller carries it out even when this raises partway, since the
        sessions moved so far are held in it."""
        moves = self.manager.plan_room(tier, 0)
        if moves is None:  # only held sessions left above budget; they leave as soon as they are released
            log.warning("tier %s is over budget and every session in it is in use", tier)
            return
        self._execute(moves, transfer)

    def admit(self, record: Record, log_bytes: int = 0) -> int:
        """Book a new session's bytes in the last tier before its first write (it is held NEW by
        the caller afterwards), with `log_bytes` more for a log it starts with on disk (a fork's
        copy of its source's); SessionTooLarge or CacheFull when they do not fit. Returns the
        bytes booked beside the state, the caller's to `unreserve` once the write has landed or
        failed."""
        self.refuse_never_fits(record.model, record.nbytes)
        extra = log_bytes if self.durable.tier == "disk" else 0
        self._durable_room(record.model, record.nbytes + extra)
        record.copies = {self.durable.tier}
        self.manager.add(record)
        self.manager.reserve(self.durable.tier, extra)
        return extra

    def admitted(self, record: Record, data: SessionData | None) -> None:
        """A new session is written: its state (`home_copy`'s) goes to its home, the device or,
        larger than the device's budget, host RAM (the caller's rebalance makes room)."""
        self._keep(record.id, record.nbytes, data)

    def home(self, nbytes: int) -> str:
        """Where a session of `nbytes` is kept between requests: the device, or host RAM when it
        is larger than the device's whole budget (and the host tier is there to hold it)."""
        return home_tier(nbytes, self.manager.budgets)

    def home_copy(self, session_id: str, nbytes: int, data: SessionData) -> SessionData | None:
        """A just-written session's state (`data`, on its model's device) as its home keeps it:
        itself on the device, or a copy in host RAM for a session larger than the device's budget.
        Called outside the lock: on a GPU that copy is the whole state, which no other session's
        acquire or commit should wait for. None when the copy fails (out of host memory): the
        durable copy is written already, so the session is whole there, as an evicted session is;
        logged, never raised to a client whose change has landed (who might apply it twice)."""
        tier = self.home(nbytes)
        try:
            return data if tier == "device" else data.to("cpu")
        except Exception as error:  # noqa: BLE001 (any failure here: the write stands)
            self._not_kept(session_id, tier, error)
            return None

    def _not_kept(self, session_id: str, tier: str, error: Exception) -> None:
        log.error("session %s: its new state is written but could not be kept on %s (%s: %s); it is read back from "
                  "the %s when next used", session_id, tier, type(error).__name__, error, self.durable.tier)

    def _keep(self, session_id: str, nbytes: int, data: SessionData | None) -> None:
        """Keep a just-written session's state (`home_copy`'s; None: kept in no memory tier) at
        its home."""
        if data is None:
            return
        tier = self.home(nbytes)
        try:
            self._store(tier).put(session_id, data)
        except Exception as error:  # noqa: BLE001 (as in `home_copy`: the write stands)
            self._not_kept(session_id, tier, error)
            return
        self.manager.add_copy(session_id, tier)

    def reserve(self, record: Record, nbytes: int, log_growth: int | None = None) -> int:
        """Book a commit's growth (to `nbytes`) in the last tier before its write; returns the
        bytes booked, the commit's until its write lands or fails (then `unreserve`). Only there:
        the session's copy on the device keeps its size in the books until the commit replaces it
        (`committed`), so the growth never makes the device look fuller than it is to the
        requests that run meanwhile. SessionTooLarge or CacheFull when the new size does not fit;
        a commit that does not grow the last tier is never refused, however full it is. On disk
        the session's log counts too: a delta commit adds at most `log_growth` bytes to it, a
        whole write (`log_growth` None) removes it."""
        self.refuse_never_fits(record.model, nbytes, record.id, committing=True)
        growth = self.commit_growth(record, nbytes, log_growth)
        if growth > 0:
            self._durable_room(record.model, growth, record.id)
        booked = max(growth, 0)
        self.manager.reserve(self.durable.tier, booked)
        return booked

    def commit_growth(self, record: Record, nbytes: int, log_growth: int | None = None) -> int:
        """Bytes a commit to `nbytes` adds to the last tier (`reserve`'s arguments)."""
        growth = nbytes - record.nbytes
        if self.durable.tier == "disk":
            growth += -record.disk_log_bytes if log_growth is None else log_growth
        return growth

    def fits_in_durable(self, growth: int) -> bool:
        """Whether `growth` more bytes fit the last tier now (a pure question: nothing is counted
        or refused)."""
        return growth <= 0 or self.manager.plan_room(self.durable.tier, growth) is not None

    def unreserve(self, booked: int) -> None:
        """Give back what `reserve` booked (the write landed, its size now counted in `committed`;
        or it failed)."""
        self.manager.unreserve(self.durable.tier, booked)

    def committed(self, record: Record, committed: Record, data: SessionData | None) -> None:
        """The books after a commit's durable write: `record` becomes `committed`, its state
        `data` (on its device), its disk log `committed.disk_log_bytes`."""
        # the old copies are stale: only the durable one (just overwritten) and the device one remain
        for tier in [t for t in record.copies if t != self.durable.tier]:
            if tier in MEMORY_TIERS:
                self._store(tier).drop(record.id)
            self.manager.drop_copy(record.id, tier)  # a disk spill: removed by the committer (drop_stale_file)
        self.manager.add_copy(record.id, self.durable.tier)
        self.manager.resize(record.id, committed.nbytes, committed.disk_log_bytes)
        record.tokens, record.version, record.last_used_at = committed.tokens, committed.version, committed.last_used_at
        record.remembered, record.commit_id = committed.remembered, committed.commit_id
        self._keep(record.id, committed.nbytes, data)
        self.manager.touch(record.id)

    def doubt_durable_copy(self, record: Record) -> None:
        """A commit's disk write failed after its bytes may have reached the session's files: they
        may hold the version the client was told failed, which every later read would refuse (its
        version is not the books'). While a memory copy holds the acknowledged state, the disk
        copy is no longer counted as one: the session is written whole again before its last
        memory copy goes (an eviction makes a new disk copy; shutdown writes every session that
        lacks one), or by its next commit. Its log is taken as gone (a whole write removes it)."""
        if self.durable.tier != "disk" or not record.copies & set(MEMORY_TIERS):
            return
        self.manager.drop_copy(record.id, "disk")
        record.disk_log_bytes = 0
        log.warning("session %s: its disk copy may hold a version that was answered as failed; it is written again "
                    "from memory before the session leaves memory", record.id)

    def catch_up(self, record: Record, head: Head | None, transfer: Transfer, read_while_held: bool = False) -> None:
        """With Redis: take in a version another replica committed since (the local copies are
        stale and go; the held session's file goes in `transfer`). A head older than the record is
        a read that a local commit overtook: ignored, unless it was read while this replica held
        the session (`read_while_held`), when no local commit can be in flight: then Redis lost a
        version it had acknowledged (a failover with asynchronous replication, a restore from a
        snapshot), and what it holds is the truth, taken in the same way. Ignoring it would leave
        the session answering 409 (the books' version is not Redis's) until a restart. The same
        version made by another commit (manager.py `Record.commit_id`: the session deleted and made
        anew under its keyed id, or a lost version written again by another replica) is another
        state: taken in as a newer one."""
        if head is None or same_commit(record, head):
            return
        if head.version < record.version:
            if not read_while_held:
                return
            log.warning("session %s: Redis holds version %d, older than the version %d this replica committed: "
                        "it lost an acknowledged write (a failover or a restore?); the session goes on from Redis's",
                        record.id, head.version, record.version)
        elif head.version == record.version:
            log.warning("session %s: Redis holds version %d from another commit than this replica's copy (the "
                        "session deleted and made anew, or a lost version written again); its copies here go",
                        record.id, head.version)
        self.forget_local(record, transfer)
        self.manager.resize(record.id, int(head.meta["nbytes"]))
        record.version, record.tokens, record.commit_id = head.version, int(head.meta["tokens"]), commit_of(head.meta)
        record.last_used_at = float(head.meta.get("last_used_at", record.last_used_at))
        # what a session made anew under the same id may have changed (the owner is in its id)
        record.model, record.made_by = str(head.meta["model"]), str(head.meta.get("made_by") or "")
        record.created_at = float(head.meta.get("created_at", record.created_at))

    def forget_local(self, record: Record, transfer: Transfer) -> None:
        """Drop every local copy of a held session (they are stale); Redis keeps the truth."""
        for tier in [t for t in record.copies if t != "redis"]:
            if tier in MEMORY_TIERS:
                self._store(tier).drop(record.id)
            else:
                transfer.add(_Unlink(record.id))
            self.manager.drop_copy(record.id, tier)
        self.manager.add_copy(record.id, "redis")

    def deleted_session(self, session_id: str) -> tuple[str | None, float] | None:
        """(owner, created_at) of a session that left the books deleted, among the latest
        DELETED_REMEMBERED; None for any other."""
        return self._deleted.get(session_id)

    def deleted_here(self, session_id: str, meta: dict) -> bool:
        """Whether a session Redis describes with `meta` is one this replica deleted (a head read
        before the delete): the same id and creation time. A session made under that id since
        (a create retried with its Idempotency-Key, after a delete) is another, and not."""
        deleted = self._deleted.get(session_id)
        if deleted is None:
            return False
        try:
            return float(meta.get("created_at", 0)) == deleted[1]
        except (TypeError, ValueError):
            return True

    def forget(self, record: Record, deleted: bool = True, publish: bool = True) -> None:
        """The session leaves the books (deleted, which this replica remembers; or, with
        `deleted` False, never made); its file goes at the next `sweep`. Without `publish` the
        metrics wait for the caller's `publish` (a pass over many sessions publishes once: each
        publish is a pass over every record)."""
        for tier in MEMORY_TIERS:
            self._store(tier).drop(record.id)
        self._forgotten.append(record.id)
        if deleted:
            self._deleted[record.id] = (record.owner, record.created_at)
        while len(self._deleted) > DELETED_REMEMBERED:
            self._deleted.popitem(last=False)
        self.manager.remove(record.id)
        if publish:
            self.publish()

    def move(self, record: Record, tier: str, transfer: Transfer) -> None:
        """Put a held session's fastest copy in `tier`: copies above it are dropped, one is made
        there if needed (benchmarks and tests; budgets are not checked)."""
        if tier not in record.copies:
            source = record.tier
            data = self._store(source).get(record.id) if source in MEMORY_TIERS else None
            transfer.add(_Copy(record, source, tier, data))
        for above in self.manager.tiers[: self.manager.tiers.index(tier)]:
            if above in record.copies:
                if above in MEMORY_TIERS:
                    self._store(above).drop(record.id)
                else:
                    transfer.add(_Unlink(record.id))
                self.manager.drop_copy(record.id, above)

    def _execute(self, moves: list[Move | Reclaim], transfer: Transfer) -> None:
        """Book `moves` now and put their bytes in `transfer`. A plan may move one session more
        than once: down twice (device → host → disk), or one copy down and another dropped (with
        Redis, a session on the device whose disk spill made room on the disk). What is carried is
        each session's whole change: its state taken out of the memory tier it left, written to
        the tier it gained, its spill file removed where the disk copy went, and nothing where a
        copy went and came back (the same version). Each session's moves are booked and its step
        put in `transfer` before the next session's, so that should this raise partway, the books
        and `transfer` agree on every session booked so far."""
        by_session: dict[str, list[Move]] = {}
        for move in moves:
            if isinstance(move, Reclaim):  # room the prefix cache borrowed: it drops entries (its own lock only)
                self.borrower.release(move.tier, move.nbytes)
            else:
                by_session.setdefault(move.session, []).append(move)
        for session_id, its_moves in by_session.items():
            record = self.manager.get(session_id)
            had = set(record.copies)
            after = set(had)
            for move in its_moves:
                after.discard(move.src)
                if move.dst is not None:
                    after.add(move.dst)
            left, gained = had - after, after - had
            source = next((tier for tier in MEMORY_TIERS if tier in left), None)
            if len(gained) > 1 or (gained and source is None):  # moves only go down, from memory into the tier below
                raise RuntimeError(f"session {session_id}: a plan that moves it {its_moves} cannot be carried out")
            for move in its_moves:
                self.manager.apply(move)
            data = self._take_out(source, session_id) if source is not None else None
            for tier in left - {source, "disk"}:  # a second memory copy let go (a lower tier has the state)
                self._store(tier).drop(session_id)
            destination = next(iter(gained), None)
            if destination is not None or "disk" in left:  # else a lower tier has it: nothing to carry
                transfer.hold(session_id, self.holds.take(session_id, MOVE))
                transfer.add(_Evict(record, Move(session_id, source or "disk", destination), data,
                                    unlink="disk" in left))
            if self.metrics is not None:
                for move in its_moves:
                    self.metrics.session_evictions.labels(record.model, move.src).inc()

    def _durable_room(self, model: str, nbytes: int, session_id: str | None = None) -> None:
        room = self.manager.plan_room(self.durable.tier, nbytes)
        if room is None:
            raise self.full(self.durable.tier, model, nbytes, session_id)
        self._execute(room, Transfer(self))  # the last tier moves nothing: at most it takes back lent bytes

    def _store(self, tier: str) -> MemoryStore:
        return self.device if tier == "device" else self.host

    def _take_out(self, tier: str, session_id: str) -> SessionData:
        data = self._store(tier).get(session_id)
        self._store(tier).drop(session_id)
        return data

    # -- refusals ------------------------------------------------------------------------------

    def refuse_never_fits(self, model: str, nbytes: int, session_id: str | None = None,
                          committing: bool = False) -> None:
        """SessionTooLarge when `nbytes` of state exceed the whole budget of the last tier (where
        it is kept), or of its home (`home`: the device, or host RAM for a session larger than the
        device's budget): no wait could help."""
        too_small = tier_too_small(nbytes, self.manager.budgets, self.durable.tier)
        if too_small is None:
            return
        tier, budget = too_small
        # not in xlserve_session_refusals_total, the 503s for lack of room an operator is alerted to:
        # this is the client's 413 (xlserve_request_errors_total, code session_too_large)
        subject = (f"this request would make session '{session_id}' hold" if committing
                   else f"session '{session_id}' holds" if session_id else "the new session would hold")
        raise SessionTooLarge(
            f"{subject} {nbytes} bytes of state, more than the whole {tier} budget of {budget} bytes "
            f"(XLSERVE_{tier.upper()}_STATE_BYTES): it could never be served, so nothing was changed. A "
            "retry cannot help; the server's operator can raise the budget", session_id)

    def full(self, tier: str, model: str, nbytes: int, session_id: str | None = None) -> CacheError:
        """CacheFull (503, retry later), or SessionTooLarge (413) when `nbytes` exceed the tier's
        whole budget."""
        budget = self.manager.budgets[tier]
        if budget is not None and nbytes > budget and tier in ("device", "host", self.durable.tier):
            self.refuse_never_fits(model, nbytes, session_id)
        if self.metrics is not None:
            self.metrics.session_refusals.labels(model, tier).inc()
        if tier == self.durable.tier:
            return CacheFull(f"session storage is full: {tier} holds {self.manager.used(tier)} of {budget} bytes "
                             f"(XLSERVE_{tier.upper()}_STATE_BYTES) and {nbytes} more are needed; delete sessions", session_id)
        return CacheFull(f"no room for a {nbytes}-byte session state on the {tier}: {self.manager.used(tier)} of "
                         f"{budget} bytes are held by sessions in use; retry when a request finishes", session_id)

    # -- metrics -------------------------------------------------------------------------------

    def count_hit(self, model: str, tier: str) -> None:
        if self.metrics is None:
            return
        self.metrics.session_cache_hits.labels(model, tier).inc()
        for above in self.manager.tiers[: self.manager.tiers.index(tier)]:
            self.metrics.session_cache_misses.labels(model, above).inc()

    def publish(self) -> None:
        if self.metrics is None:
            return
        current = self.manager.by_tier()
        for key in self._published - set(current):
            self.metrics.sessions.labels(*key).set(0)
            self.metrics.session_state_bytes.labels(*key).set(0)
        for (model, tier), (count, nbytes) in current.items():
            self.metrics.sessions.labels(model, tier).set(count)
            self.metrics.session_state_bytes.labels(model, tier).set(nbytes)
        self._published = set(current)


class Transfer:
    """Bytes to move, planned under the lock: `run` moves them without the lock, then `finish`,
    under it again, records what happened, gives back the holds taken for them, and answers
    the fetched state (raising the error of a step whose failure is the caller's)."""

    def __init__(self, placement: Placement):
        self.placement = placement
        self.steps: list[_Step] = []
        self.held: list[tuple[str, int]] = []
        self.finished = False

    def add(self, step: _Step) -> None:
        self.steps.append(step)

    def hold(self, session_id: str, hold_id: int) -> None:
        """Give back this hold at `finish`."""
        self.held.append((session_id, hold_id))

    def run(self) -> None:
        for step in self.steps:
            step.run(self.placement)

    def finish(self) -> SessionData | None:
        self.finished = True
        try:
            errors = [step.finish(self.placement) for step in self.steps]
        finally:  # whatever happens, the holds end: a session held for good would hang every request for it
            for session_id, hold_id in self.held:
                self.placement.holds.give_back(session_id, hold_id)
            self.placement.publish()
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error
        return next((step.data for step in self.steps if isinstance(step, (_Fetch, _Fetched))), None)

    def carry_out(self, lock: threading.RLock) -> SessionData | None:
        """`run`, then `finish` under `lock`. Idle sessions moved out of the way of another step
        (a fetch) are moved and finished first, their holds given back, before that step runs: a
        fetch from disk or Redis takes seconds at real size, and a request for a session moved
        out of its way, itself moved in microseconds, waited for all of it."""
        evictions = [step for step in self.steps if isinstance(step, _Evict)]
        if evictions and len(evictions) < len(self.steps):
            for step in evictions:
                step.run(self.placement)
            moved = {step.record.id for step in evictions}
            with lock:
                try:
                    for step in evictions:
                        step.finish(self.placement)  # an eviction's failure is its own: it answers None
                finally:
                    for session_id, hold_id in self.held:
                        if session_id in moved:
                            self.placement.holds.give_back(session_id, hold_id)
                    self.held = [(session_id, hold_id) for session_id, hold_id in self.held if session_id not in moved]
                    self.steps = [step for step in self.steps if not isinstance(step, _Evict)]
                    self.placement.publish()
        self.run()
        with lock:
            return self.finish()


class _Step:
    """One session's bytes: `_run` outside the lock; `finish` under it, returning the error the
    caller should raise (None: nothing to raise)."""

    error: BaseException | None = None

    def run(self, placement: Placement) -> None:
        try:
            self._run(placement)
        except BaseException as error:  # noqa: BLE001 - recorded, answered in finish
            self.error = error

    def _run(self, placement: Placement) -> None:
        pass

    def finish(self, placement: Placement) -> BaseException | None:
        return None


class _Fetched(_Step):
    """The state is on the device already: nothing to carry."""

    def __init__(self, data: SessionData):
        self.data = data


class _Fetch(_Step):
    """A held session's committed state from `source` to its model's device (its room there is
    booked): a host copy taken out of host RAM (`host_data`), or a disk file or Redis value read
    and checked. With `home` "host" (a session larger than the device's budget) the device's copy
    is the request's alone, unbooked, and host RAM keeps (or, read from below, gets) a copy: its
    room there is booked."""

    def __init__(self, record: Record, source: str, host_data: SessionData | None, home: str = "device"):
        self.record, self.source, self.host_data, self.home = record, source, host_data, home
        self.data: SessionData | None = None
        self.host_copy: SessionData | None = None  # host RAM's copy, read from below for a host home
        self.seconds = 0.0
        self.spill_unusable = False  # the disk spill could not be read: read from Redis instead

    def _run(self, placement: Placement) -> None:
        started = time.perf_counter()
        if self.source == "host":
            self.data = self.host_data.to(placement.durable.spec(self.record).device)
        else:
            # a session homed on host RAM is read there (on the CPU), and the request's copy made
            # from it: no copy back from the device, and none under the lock in `finish`
            to_device = self.home != "host"
            try:
                self.data = placement.read(self.record, self.source, to_device)
            except SessionUnavailable as error:
                if self.source != "disk" or placement.durable.tier == "disk" or isinstance(error, SessionReadOutOfMemory):
                    raise  # (no memory to read it: the spill is fine, and Redis's copy would need the same)
                # with Redis the disk only spills what Redis holds: read it there, and the spill goes
                log.warning("session %s: its disk spill is unusable (%s); read from Redis", self.record.id, error)
                self.data = placement.read(self.record, placement.durable.tier, to_device)
                self.source, self.spill_unusable = placement.durable.tier, True
            if not to_device:
                self.host_copy = self.data.to("cpu")  # (read on the CPU already: the same tensors)
                self.data = placement.on_device(self.record.model, self.host_copy)
        self.seconds = time.perf_counter() - started

    def finish(self, placement: Placement) -> BaseException | None:
        record, source, manager = self.record, self.source, placement.manager
        if self.spill_unusable:  # out of the books; its file goes at the next sweep
            manager.drop_copy(record.id, "disk")
            placement.leave_file(record.id)
        if self.home == "host":
            if self.error is not None:
                if source != "host":  # the room booked on host goes back
                    manager.drop_copy(record.id, "host")
                return self.error
            if source != "host":
                placement.host.put(record.id, self.host_copy)
            self._count(placement)
            return None
        if self.error is not None:  # the booked room goes back; a host copy goes back to host RAM ...
            manager.drop_copy(record.id, "device")
            # ... if it still fits there: its room may have gone to the sessions moved down to make
            # room on the device. If not, it is let go: the last tier has its copy (costs speed only)
            if source == "host" and (manager.plan_room("host", record.nbytes) == [] or not record.copies):
                placement.host.put(record.id, self.host_data)
                manager.add_copy(record.id, "host")
            return self.error
        placement.device.put(record.id, self.data)
        self._count(placement)
        return None

    def _count(self, placement: Placement) -> None:
        record, source = self.record, self.source
        placement.count_hit(record.model, source)
        if placement.metrics is not None:
            placement.metrics.session_restore_latency.labels(record.model, source).observe(self.seconds)
            placement.metrics.session_promotions.labels(record.model, source).inc()
        return None


class _Evict(_Step):
    """An idle session moved down (`move`, booked already): its state, taken out of a memory tier
    (`data`), copied to `move.dst` (None: let go, a lower tier has it); and, with `unlink`, its
    file removed from disk (the disk copy it left: `move.src` "disk", or a spill dropped in the
    same plan). A copy that cannot be made is dropped from the books: the session keeps its copies
    below."""

    def __init__(self, record: Record, move: Move, data: SessionData | None, unlink: bool = False):
        self.record, self.move, self.data, self.unlink = record, move, data, unlink or move.src == "disk"
        self.out: SessionData | None = None
        self.unlink_error: OSError | None = None  # the copy was made, the file could not be removed

    def _run(self, placement: Placement) -> None:
        if self.move.dst is not None:
            self.out = placement.write(self.record, self.move.dst, self.data)
        if self.unlink:
            try:
                placement.disk.delete(self.record.id)
            except OSError as error:
                if self.move.dst is None:
                    raise
                self.unlink_error = error

    def finish(self, placement: Placement) -> BaseException | None:
        record, move, manager = self.record, self.move, placement.manager
        if self.error is None:
            if self.out is not None:
                placement._store(move.dst).put(record.id, self.out)
            if self.unlink_error is not None:  # the new copy stands; the stale file goes at a later sweep
                log.warning("session %s: its disk file could not be removed (%s); it goes at a later sweep", record.id,
                            self.unlink_error)
                placement.leave_file(record.id)
            return None
        log.warning("session %s: moving it from %s to %s failed (%s); it keeps its copies below", record.id,
                    move.src, move.dst or "the tiers below", self.error)
        if self.unlink:  # the books dropped its disk copy, the file may be there still
            placement.leave_file(record.id)
        if move.dst is not None:
            manager.drop_copy(record.id, move.dst)
            if not record.copies and move.src in MEMORY_TIERS:  # no copy below after all: it stays where it was
                placement._store(move.src).put(record.id, self.data)
                manager.add_copy(record.id, move.src)
        return None


class _Copy(_Step):
    """A held session's state copied from `source` (`data` when it is in memory) to `tier`
    (SessionCache.move)."""

    def __init__(self, record: Record, source: str, tier: str, data: SessionData | None):
        self.record, self.source, self.tier, self.data = record, source, tier, data
        self.out: SessionData | None = None

    def _run(self, placement: Placement) -> None:
        data = self.data if self.data is not None else placement.read(self.record, self.source, to_device=False)
        self.out = placement.write(self.record, self.tier, data)

    def finish(self, placement: Placement) -> BaseException | None:
        if self.error is not None:
            return self.error
        if self.out is not None:
            placement._store(self.tier).put(self.record.id, self.out)
        placement.manager.add_copy(self.record.id, self.tier)
        return None


class _Unlink(_Step):
    """A held session's disk file removed (a stale version, a dropped copy)."""

    def __init__(self, session_id: str):
        self.session_id = session_id

    def _run(self, placement: Placement) -> None:
        placement.disk.delete(self.session_id)

    def finish(self, placement: Placement) -> BaseException | None:
        if self.error is not None:
            log.warning("session %s: a stale file could not be removed (%s); a later sweep removes it",
                        self.session_id, self.error)
            placement.leave_file(self.session_id)
        return None
