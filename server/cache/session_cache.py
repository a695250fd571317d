"""The session cache: every session's model state, across tiers, durable at every commit.

A session is (model, state, token count, version, owner). This class is what the engine process
calls for the API process's session operations (the wire ops of server/engine/process.py;
docs/design.md section 6):

    create / fork / import_new      a new session (random 128-bit id, version 0; a create or
                                    import with an Idempotency-Key: an id derived from it)
    acquire -> Lease                one request at a time (else SessionLocked -> 409): the
                                    session's committed state, promoted to the model's device
    commit(lease, data)             the request's whole effect, version + 1, durable on return
    release(lease)                  end a lease without changing anything (cancel, error,
                                    disconnect): the state is exactly as before the request
    info / sessions / list_sessions / delete / export / replace

It is a thin front over four parts, each a module of its own:

    leases.py      who holds which session: a request's lease, or the cache while it moves bytes
    ledger.py      Idempotency-Keys: the entries a session remembers, replays, tombstones
    placement.py   the tiers (device → host → disk → Redis), their budgets, promotion, eviction,
                   and the refusals (CacheFull, SessionTooLarge); the books are the manager's
                   (manager.py), the bytes the stores' (stores.py)
    durable.py     the last tier (disk, or Redis with compare-and-set and settling), which every
                   commit, create, fork and import writes before it returns

Locking: one lock guards the books (the manager, the holds, the memory tiers' dictionaries) and
is never held during the sessions' I/O: no session file written, read or removed, no Redis call,
no copy between device and host happens under it (placement.py says what little of the prefix
cache's does). Each operation takes what it needs under the lock (a lookup, a hold on the
session, a plan booked at once), does the I/O without it, and records the outcome under it again.
The hold keeps it correct meanwhile: nothing reads, writes or moves the bytes of a held session
but its holder, and no plan moves a held session. A request's lease is such a hold (another
request gets SessionLocked); the cache holds the sessions it moves between tiers (a request for
one waits until its bytes have arrived), and a commit whose request left while it was written
keeps the lease's hold until the write ends (a request waits for it likewise). Such a wait lasts
at most `hold_wait_s` (then SessionUnavailable), and every hold is given back in a `finally`, so
no failure leaves a session held for good. Commits serialise only per session, not on one lock:
two sessions' fsyncs overlap.

Persistence: write-through. Every commit (and every create, fork and import) writes the
session's new state to the last tier before it returns (durable.py): whole, or, for a model whose
state grows or slides by appending, as a delta block on the session's log that holds only what
changed since the lease's version (`_changes`; compacted into a new whole copy when the log
outgrows it; a fork on disk shares its source's base file). So a `kill -9`
at any moment finds every session at its last committed version, and a graceful shutdown has
nothing left to write (close() checks that every session has its durable copy and writes any that
lack one). On start, `open()` indexes the session files by their headers (the checksum is verified
when a session is loaded).

Several replicas: with Redis, Redis holds every committed session and is the truth. A replica
keeps copies of the sessions it serves on its own device/host/disk; before using one (acquire,
info) it compares its version with Redis's (`head`) and takes in a newer one (`catch_up`). A
commit succeeds only if Redis still holds the version the lease started from; otherwise
SessionConflict (→ 409) and the stale result is dropped, never written.

Metrics: `xlserve_sessions{tier}` counts sessions by their fastest copy, while
`xlserve_session_state_bytes{tier}` counts the bytes each tier holds (with write-through the last
tier holds every session). An acquire is a hit on the tier it found the session in and a miss on
every faster tier. Budgets count the bytes of committed states (`SessionData.nbytes()`).

State dtype: every state that enters the cache (a commit, a create, fork, import or replace) has
its floating tensors converted to `state_dtype` (XLSERVE_STATE_DTYPE; codec.py) first, so every
tier, every budget and every export holds and counts that dtype, the device included. A lease
hands out the state as stored; the engine converts it to its model's compute dtype for the request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import secrets
import threading
import time
import weakref
from contextlib import contextmanager

import torch

from xlserve.server.cache.codec import (
    STATE_DTYPES,
    SessionData,
    delta_bytes_bound,
    encode,
    encode_delta,
    encode_parts,
    state_metadata,
)
from xlserve.server.cache.compactor import Compactor
from xlserve.server.cache.durable import DEFAULT_COMPACT_RATIO, DurableStore
from xlserve.server.cache.errors import (
    CacheError,
    CommitOutcomeUnknown,
    IdempotencyKeyReused,
    SessionConflict,
    SessionInfo,
    SessionLocked,
    SessionNotFound,
    SessionQuotaBusy,
    SessionQuotaExceeded,
    SessionUnavailable,
)
from xlserve.server.cache.leases import MOVE, NEW, Holds, Lease
from xlserve.server.cache.ledger import (
    IDEMPOTENCY_KEYS_PER_SESSION,
    TOMBSTONE_SECONDS,
    Replay,
    commit_entry,
    deleted_before,
    kept,
    new_entry,
    remembered_entry,
)
from xlserve.server.cache.manager import CacheManager, Record, new_commit_id
from xlserve.server.cache.placement import Placement, Transfer, overtaken, same_commit
from xlserve.server.cache.stores import SESSION_ID, DiskStore, Head, RedisStore

__all__ = ["IDEMPOTENCY_KEYS_PER_SESSION", "TOMBSTONE_SECONDS", "Lease", "Replay", "SessionCache", "new_session_id"]

log = logging.getLogger("xlserve.cache")

# requests that may wait at once for one session the cache holds (a move, or the commit of a
# request that left); the next is refused at once (`_settled` says why)
WAITERS_PER_SESSION = 4
# with Redis, how often a replica's books let go of the sessions other replicas deleted
FORGET_DELETED_ELSEWHERE_SECONDS = 600.0


def new_session_id() -> str:
    return "sess_" + secrets.token_hex(16)  # 128 random bits


class _AlreadyMade(Exception):
    """A keyed id the books already hold (`_admit_new`): `create` answers with that session."""


def keyed_session_id(owner: str | None, idempotency: dict) -> str:
    """The id a create or import with an Idempotency-Key gives its session: a hash of the owner
    and the key, so that its retry, on any replica and after a restart, finds the session the
    first one made instead of making another. 128 bits, as a random id; the same key of another
    owner names another session. (Without API keys every client is one owner, as for the keys
    of every other request.)"""
    digest = hashlib.sha256(f"xlserve create\0{owner or ''}\0{idempotency['key']}".encode()).hexdigest()
    return "sess_" + digest[:32]


# with Redis and XLSERVE_MAX_SESSIONS_PER_KEY, one owner's new sessions are made one at a time on a
# replica (`_admit_new`); one waits this long for its turn, then is 429 sessions_being_made: the
# session-op threads it would hold meanwhile are every other client's too
OWNER_TURN_SECONDS = 1.0


class SessionCache:
    def __init__(self, state_dir, device_bytes: int | None, host_bytes: int | None, disk_bytes: int | None,
                 redis_url: str = "", metrics=None, store_timeout_s: float = 5.0, settle_s: float = 15.0,
                 hold_wait_s: float | None = None, state_dtype: torch.dtype = torch.float32,
                 compact_ratio: float = DEFAULT_COMPACT_RATIO,
                 forget_deleted_every_s: float = FORGET_DELETED_ELSEWHERE_SECONDS, max_sessions_per_key: int = 0):
        """`store_timeout_s` bounds each Redis call; `settle_s` is how long a commit whose write
        timed out keeps asking Redis whether it landed before answering CommitOutcomeUnknown;
        `hold_wait_s` is how long a request waits for a session the cache holds (its bytes moving
        between tiers, or the commit of a request that left being written) before it is refused
        with SessionUnavailable (503): by default longer than such a write can take when Redis
        answers within its timeouts, and bounded, so that a hold leaked by a bug is an error, not
        a request that never returns. `state_dtype` is the dtype every floating state tensor is
        kept in (module docstring). `compact_ratio`: a session's log of delta commits is
        compacted into a new base once it would outgrow this times the base (durable.py).
        `forget_deleted_every_s`: how often the disk's expired tombstones are removed, and with
        Redis the books let go of the sessions another replica deleted (`forget_deleted_elsewhere`).
        `max_sessions_per_key`: how many sessions one owner may hold (0: no bound; `_check_quota`)."""
        self.state_dtype = state_dtype
        budgets = {"device": device_bytes, "host": host_bytes, "disk": disk_bytes}
        self.redis = RedisStore(redis_url, timeout_s=store_timeout_s) if redis_url else None
        if self.redis is not None:
            budgets["redis"] = None  # bounded by Redis's own maxmemory
        self.manager = CacheManager(budgets)
        self.models: dict[str, object] = {}  # name -> LanguageModel (device, state_class, init_state, check_session)
        self.disk = DiskStore(state_dir)
        self.durable = DurableStore(self.disk, self.redis, self.models, settle_s, compact_ratio, metrics)
        self.metrics = metrics
        self.hold_wait_s = hold_wait_s if hold_wait_s is not None else max(30.0, settle_s + 3 * store_timeout_s)
        self._lock = threading.RLock()
        self.holds = Holds(self.manager, self._lock)
        self._waiting: dict[str, int] = {}  # session id -> requests waiting for the cache's hold on it (`_settled`)
        self.placement = Placement(self.manager, self.durable, self.holds, self._lock, metrics)
        self.compactions = Compactor(self.compact)
        self.forget_deleted_every_s = forget_deleted_every_s
        self.max_sessions_per_key = max_sessions_per_key
        # owner -> [its lock, the creates holding or waiting for it] (`_owner_turn`; under self._lock)
        self._owner_turns: dict[str | None, list] = {}
        self._closing = threading.Event()  # ends the thread of `forget_deleted_elsewhere`
        self._forgetting: threading.Thread | None = None

    def lend_to(self, borrower) -> None:
        """Share the tiers' budgets with `borrower` (the prefix cache): it reports what it holds
        per tier (`held(tier)`), keeps entries only in the room sessions leave, and gives room
        back when sessions need it (`release(tier, nbytes)`, called under this cache's lock, so
        the borrower never calls this cache)."""
        self.placement.borrower = borrower
        self.manager.lend(borrower.held)

    @classmethod
    def from_settings(cls, settings, metrics=None) -> "SessionCache":
        """From the cache's group of the server's settings (`settings.cache`, a CacheSettings; the
        cache reads its fields and imports nothing of server/settings.py)."""
        return cls(settings.state_dir, settings.device_state_bytes, settings.host_state_bytes,
                   settings.disk_state_bytes, settings.redis_url, metrics,
                   store_timeout_s=settings.store_timeout_seconds, settle_s=settings.commit_settle_seconds,
                   state_dtype=STATE_DTYPES[settings.state_dtype],
                   compact_ratio=getattr(settings, "compact_ratio", DEFAULT_COMPACT_RATIO),
                   max_sessions_per_key=getattr(settings, "max_sessions_per_key", 0))

    # -- start and stop ---------------------------------------------------------------------

    def open(self, models: dict[str, object]) -> int:
        """Register the served models and index the sessions already written down. Returns how
        many were found."""
        self.models.update(models)
        found = self.durable.open()  # file headers and a Redis ping: outside the lock
        # counted whatever the last tier: a session moved to Redis keeps the log it had on disk
        # (state_directory.py) until its spill copy is next written whole
        log_bytes = {session_id: self.durable.disk.log_bytes(session_id) for session_id, _ in found}
        copies = {"disk"} | ({"redis"} if self.redis is not None else set())
        with self._lock:
            for session_id, meta in found:
                if self.manager.get(session_id) is None:
                    record = DurableStore.record_from_meta(session_id, meta, copies)
                    record.disk_log_bytes = log_bytes[session_id]
                    self.manager.add(record)
            if self.manager.free("disk") is not None and self.manager.free("disk") < 0:
                log.warning("sessions on disk hold %d bytes (their logs of delta commits included), over "
                            "XLSERVE_DISK_STATE_BYTES=%d; new sessions and commits that grow the disk are refused "
                            "until some are deleted (a commit that would grow a log is written whole instead)",
                            self.manager.used("disk"), self.manager.budgets["disk"])
            self.placement.publish()
        if self._forgetting is None:
            # the thread holds the cache weakly: a cache nobody closes is not kept alive by it
            self._forgetting = threading.Thread(target=_forget_deleted_periodically,
                                                args=(weakref.ref(self), self._closing, self.forget_deleted_every_s),
                                                name="xlserve-forget-deleted", daemon=True)
            self._forgetting.start()
        return len(found)

    def forget_deleted_elsewhere(self) -> int:
        """With Redis, let go of the idle sessions another replica deleted, as a listing does
        (`_forget_deleted_elsewhere`); how many left the books. Run every `forget_deleted_every_s`
        from `open`, so that a replica whose clients never list does not keep such records, and
        their copies on its device, host RAM and disk, until evicted."""
        if self.redis is None:
            return 0
        listed_at, unreadable = time.time(), set()
        heads = self.durable.heads(unreadable)  # outside the lock
        with self._locked():  # the files of sessions let go here go when it is released
            before = len(self.manager.records)
            self._forget_deleted_elsewhere(heads.keys() | unreadable, listed_at)
            return before - len(self.manager.records)

    def close(self) -> None:
        """Graceful shutdown: make sure every session has its durable copy (write-through means
        they all have one already; a session that somehow lacks it is written now). A compaction
        that runs ends first; those still waiting are dropped (their logs are whole)."""
        self._closing.set()
        if self._forgetting is not None:
            self._forgetting.join(self.hold_wait_s)  # a pass under way asks Redis at most for its timeouts
        self.compactions.close()
        with self._lock:
            lacking = [r for r in self.manager.records.values() if self.durable.tier not in r.copies]
        written, failed = 0, []
        try:
            for record in lacking:  # one write that fails leaves the others to be written
                with self._lock:
                    if record.pinned or self.manager.get(record.id) is not record:
                        continue
                    hold = self.holds.take(record.id, MOVE)
                try:
                    data = self.placement.read(record, record.tier, to_device=False)
                    self.durable.write(record, encode_parts(data, self.durable.metadata(record)), expected=None)
                    with self._lock:
                        self.manager.add_copy(record.id, self.durable.tier)
                    written += 1
                except Exception as error:
                    log.error("session %s: its durable copy could not be written at shutdown (%s); its change since "
                              "its last durable write is lost", record.id, error)
                    failed.append(record.id)
                finally:
                    with self._lock:
                        self.holds.give_back(record.id, hold)
            log.log(logging.ERROR if failed else logging.INFO,
                    "session cache closed: %d sessions persisted (%d written at shutdown, %d could not be)",
                    len(self.manager.records) - len(failed), written, len(failed))
        finally:
            self.durable.close()

    # -- the API ----------------------------------------------------------------------------

    def create(self, model: str, owner: str | None, data: SessionData,
               idempotency: dict | None = None) -> SessionInfo | Replay:
        """A new session holding `data` (a fresh state, or an imported one). With `idempotency`
        ({key, fingerprint}) its id comes from the owner and the key (`keyed_session_id`) and
        the request's fingerprint is written with it for its whole life (`made_by`): a retry
        finds that session and is answered with it as it is now (a Replay), however often, on
        whichever replica, until it is deleted; the key with another request is
        IdempotencyKeyReused, and so is a retry after a delete this replica made or one sent
        with a key (a tombstone); after any other delete the retry makes the session anew. While
        the first request is still writing it, a retry is SessionLocked (409: retry)."""
        if idempotency is None:
            return self._admit_new(model, owner, data)
        session_id = keyed_session_id(owner, idempotency)
        replay = self._made_before(session_id, owner, idempotency)
        if replay is not None:
            return replay
        try:
            return self._admit_new(model, owner, data, session_id=session_id, made_by=idempotency["fingerprint"])
        except (_AlreadyMade, SessionConflict):  # another request with the key got there first (Redis: on another replica)
            replay = self._made_before(session_id, owner, idempotency)
            if replay is None:
                raise SessionLocked(session_id) from None
            return replay

    def _made_before(self, session_id: str, owner: str | None, idempotency: dict) -> Replay | None:
        """The session a create or import with this key made (`session_id`, its keyed id) as a
        Replay whose result is the session as it is now; None when it made none."""
        with self._lock:
            if self.holds.kind(session_id) == NEW:  # its first request is writing it
                raise SessionLocked(session_id)
        try:
            info = self.info(session_id, owner)
        except SessionNotFound:
            with self._lock:
                deleted = self.placement.deleted_session(session_id) is not None
            if deleted or self.durable.tombstone(session_id) is not None:
                raise IdempotencyKeyReused(
                    f"Idempotency-Key '{idempotency['key']}' made session '{session_id}', which was deleted since; "
                    "send a new key to make a new session", session_id) from None
            return None
        with self._lock:
            record = self.manager.get(session_id)
            made_by = record.made_by if record is not None else ""
        if made_by != idempotency["fingerprint"]:  # the key made it for another request
            raise IdempotencyKeyReused(
                f"Idempotency-Key '{idempotency['key']}' made session '{session_id}' for a different request; "
                "send a new key with a new request", session_id)
        return Replay(new_entry(idempotency, dataclasses.asdict(info), info.version, info.tokens))

    def info(self, session_id: str, owner: str | None) -> SessionInfo:
        head = self.durable.head(session_id)  # outside the lock: Redis may be slow
        transfer = Transfer(self.placement)
        try:
            with self._locked():
                record = self._lookup(session_id, owner, head)
                if head is None or head.version < record.version or same_commit(record, head):
                    return self._info(record)
                if record.pinned:  # held (a commit may be landing, or its bytes moving): report, change nothing
                    return dataclasses.replace(self._info(record), version=head.version,
                                               tokens=int(head.meta["tokens"]), state_bytes=int(head.meta["nbytes"]))
                transfer.hold(session_id, self.holds.take(session_id, MOVE))  # while its stale file goes
                self.placement.catch_up(record, head, transfer)
                info = self._info(record)
        finally:
            if transfer.held:  # carried out even after an error, which would otherwise keep the hold for good
                transfer.carry_out(self._lock)
        return info

    def sessions(self) -> list[SessionInfo]:
        with self._lock:
            return [self._info(r) for r in self.manager.records.values() if self.holds.kind(r.id) != NEW]

    def list_sessions(self, owner: str | None, limit: int = 20, after: str | None = None) -> tuple[list[SessionInfo], bool]:
        """`owner`'s sessions, newest first (created_at, then id), from the one after `after`
        (a session id, perhaps one of the owner's deleted since, here or, with Redis, on any
        replica within the last hour; ValueError when it is none of the owner's), at most `limit`; and whether more follow. With Redis, Redis is the truth: every replica's sessions are listed,
        and this replica's books let go of the idle sessions another replica deleted (`_forget_deleted_elsewhere`)."""
        listed_at, unreadable = time.time(), set()
        heads = self.durable.heads(unreadable)  # outside the lock
        with self._locked():  # the files of sessions let go here go when it is released
            if heads is not None:
                self._forget_deleted_elsewhere(heads.keys() | unreadable, listed_at)
            if heads is None:
                infos = [self._info(r) for r in self.manager.records.values()
                         if r.owner == owner and self.holds.kind(r.id) != NEW]
            else:
                infos = []
                for session_id, (version, meta) in heads.items():
                    if (meta.get("owner") or None) != owner:
                        continue
                    record = self.manager.get(session_id)
                    if record is None and self.placement.deleted_here(session_id, meta):  # read before a delete here
                        continue
                    if record is not None and (record.version > version
                                               or same_commit(record, Head(version, meta, None))):
                        infos.append(self._info(record))
                    else:
                        infos.append(DurableStore.info_from_head(session_id, version, meta, self.holds.leased(session_id)))
        infos.sort(key=lambda info: (info.created_at, info.id), reverse=True)
        start = 0
        if after is not None:
            start = next((i + 1 for i, info in enumerate(infos) if info.id == after), -1)
            with self._lock:
                deleted = self.placement.deleted_session(after) if start < 0 else None
            if start < 0 and deleted is None:  # perhaps deleted on another replica: Redis remembers its place
                deleted = self.durable.deleted_place(after)
            if deleted is not None and deleted[0] == owner:
                # deleted since the page that named it (a client deleting the sessions it lists):
                # the listing goes on from its place in the order
                cursor = (deleted[1], after)
                start = next((i for i, info in enumerate(infos) if (info.created_at, info.id) < cursor), len(infos))
            if start < 0:
                raise ValueError(f"'after' is not one of your sessions: {after!r}")
        return infos[start : start + limit], start + limit < len(infos)

    def _forget_deleted_elsewhere(self, in_redis: set[str], listed_at: float) -> None:
        """(Under the lock.) With Redis, a session another replica deleted stays in these books,
        with its copies on the device, host RAM and disk, until something asks for it here: the
        books grow with every session deleted elsewhere. The sessions Redis does not hold
        (`in_redis`, scanned from `listed_at` on), idle, and unchanged here for longer than a
        write may take to land in Redis (`hold_wait_s`: a create or commit whose write the scan
        missed is younger), leave the books as `_lookup` lets one go that Redis says is gone. They
        are not remembered as deleted here: a scan may miss a key Redis holds (a cluster's slot
        that moved, a failover in the middle of it), and such a session is then read from Redis
        again at its next request, where one remembered as deleted would read as gone for good."""
        settled_before = listed_at - self.hold_wait_s
        forgotten = 0
        for record in list(self.manager.records.values()):
            if (record.id not in in_redis and not record.pinned and self.holds.kind(record.id) is None
                    and record.last_used_at < settled_before):
                # one publish for the pass: each is a pass over the books
                self.placement.forget(record, deleted=False, publish=False)
                forgotten += 1
        if forgotten:
            self.placement.publish()

    def acquire(self, session_id: str, owner: str | None, idempotency: dict | None = None) -> Lease:
        """Take the session for one request; its committed state comes back on its model's
        device. SessionLocked when another request holds it, CacheFull when the device has no
        room even after moving every idle session out of the way, SessionTooLarge when it never
        could. With `idempotency` ({key, fingerprint}) seen before on this session, nothing is
        taken: the lease carries the remembered entry as `replay`."""
        want_keys = idempotency is not None
        head = self.durable.head(session_id, want_keys)  # outside the lock: Redis may be slow
        with self._locked():
            record = self._settled(session_id, owner, head)
            lease_id = self.holds.take(session_id)  # from here on no other request of this replica changes it
        transfer = Transfer(self.placement)
        try:
            read_while_held = False
            if head is not None and overtaken(record, head):
                # a commit here went in between that read and the hold, or Redis holds this version
                # from another commit (manager.py `Record.commit_id`): read again (it cannot change now)
                head, read_while_held = self.durable.head(session_id, want_keys), True
            with self._locked():
                record = self._lookup(session_id, owner, head)
                remembered = head.remembered if head is not None else record.remembered
                entry = remembered_entry(remembered or [], idempotency, session_id)
                self.placement.catch_up(record, head, transfer, read_while_held)
                if entry is None:
                    self.placement.promote(record, transfer)
            data = transfer.carry_out(self._lock)  # the moves and the fetch: outside the lock
            with self._lock:
                if entry is not None:  # a replay holds nothing
                    self.holds.give_back(session_id, lease_id)
                    return Lease(session_id, record.version, None, self._info(record), done=True, replay=entry)
                self.manager.touch(session_id, time.time())
                self.placement.publish()
                return Lease(session_id, record.version, data, self._info(record), lease_id=lease_id)
        except BaseException:
            try:
                if not transfer.finished:  # what was booked is carried out (a stale file removed), its holds end
                    transfer.carry_out(self._lock)
            finally:
                with self._lock:
                    self.holds.give_back(session_id, lease_id)
            raise

    def commit(self, lease: Lease, data: SessionData, remember: dict | None = None, whole: bool = False) -> SessionInfo:
        """Make `data` the session's state: durable when this returns, version + 1, lease ended.
        `remember` ({key, fingerprint, result}) is an Idempotency-Key to remember with it, in the
        same write (`result` None: the commit's own info). On CacheFull, SessionTooLarge or
        SessionConflict nothing changed and the lease is still held (release it); on
        CommitOutcomeUnknown the change may land or not, the lease is still held. A release that
        comes while the commit runs (from another thread) takes effect when it ends.

        A model whose state grows or slides by appending has only what changed since the lease's
        version written (a delta block, durable.py), unless `whole` (an import) or the change is
        no delta (`_changes`)."""
        data = self.placement.on_device(lease.info.model, data.cast_state(self.state_dtype).compact())
        changes = None if whole or lease.data is None else self._changes(lease.data, data)
        with self._lock:
            record = self._leased(lease)
            now = time.time()
            committed = Record(
                id=record.id, model=record.model, owner=record.owner, nbytes=data.nbytes(), tokens=data.tokens,
                version=lease.version + 1, created_at=record.created_at, last_used_at=now,
                remembered=list(record.remembered), made_by=record.made_by, commit_id=new_commit_id(),
            )
            entry = None
            if remember is not None:  # the info in it is the commit's answer: on the device, the lease ended
                entry = commit_entry(remember, self._info(committed, tier="device", in_use=False), now)
                if self.redis is None:  # in the file's metadata; Redis's script adds it itself
                    committed.remembered = kept(entry, record.remembered)
            meta = self.durable.metadata(committed)
            log_growth = None if changes is None else delta_bytes_bound(changes, data.next_log_probs, meta)
            if changes is not None and not self.placement.fits_in_durable(
                    self.placement.commit_growth(record, data.nbytes(), log_growth)):
                # a full disk compacts before it refuses: written whole, the session's log goes
                changes, log_growth = None, None
            booked = self.placement.reserve(record, data.nbytes(), log_growth)
            lease.committing = True  # from here a release leaves the hold to this commit (`release`)
        try:  # the lease's hold keeps every other request of this replica off the session meanwhile
            delta = None if changes is None else encode_delta(changes, state_metadata(data), data.next_log_probs, meta)
            written = self.durable.write(committed, lambda: encode_parts(data, meta), expected=lease.version,
                                         entry=entry, delta=delta, expected_commit=record.commit_id)
            committed.disk_log_bytes = self.durable.disk_log_bytes(record.id)
        except (SessionConflict, CommitOutcomeUnknown):
            transfer = Transfer(self.placement)
            try:
                with self._lock:  # another replica committed first, or perhaps did we: local copies may be stale
                    self.placement.unreserve(booked)
                    self.placement.forget_local(record, transfer)
                transfer.carry_out(self._lock)  # the stale file goes while the session is still held
            finally:
                self._commit_failed(lease)
            raise
        except BaseException as error:
            try:
                with self._lock:
                    self.placement.unreserve(booked)
                    if getattr(error, "stored_copy_in_doubt", False):
                        self.placement.doubt_durable_copy(record)
            finally:
                self._commit_failed(lease)
            raise
        self.placement.drop_stale_file(record)
        at_home = self.placement.home_copy(record.id, committed.nbytes, data)  # outside the lock: perhaps to host RAM
        transfer = Transfer(self.placement)
        try:
            with self._lock:
                try:
                    self.placement.unreserve(booked)  # the new size is counted in every copy from here
                    self.placement.committed(record, committed, at_home)
                finally:  # the write landed: the lease ends, even should the books fail to record it
                    lease.done = True
                    self.holds.give_back(record.id, lease.lease_id)
                self._rebalance_device(transfer)  # it may step down itself, as its hold is given back
                # the answer, taken before the lock is given up: once the rebalance's bytes move
                # without it, another request may take the session and commit, and its commit is not this one's
                info = self._info(record)
        finally:  # the sessions the rebalance holds move and are given back, whatever failed
            transfer.carry_out(self._lock)
        if written.compaction_due:
            self.compactions.submit(record.id)
        return info

    def release(self, lease: Lease) -> None:
        """End a lease without changing the session (cancel, disconnect, error). Idempotent.
        During the lease's commit (the request left while it was written) the release is only
        recorded: the hold stays until the write ends, so that no later request starts from the
        state the commit is replacing (a request for the session waits for it meanwhile), and the
        commit ends it, whether it lands or fails."""
        with self._lock:
            if lease.done:
                return
            if lease.committing:
                lease.release_asked = True
                self.holds.hand_over(lease.session_id, lease.lease_id)
                return
            self._end_lease(lease)

    def release_after_commit(self, lease: Lease) -> None:
        """The request left while its commit is on its way to `commit` (queued behind other
        session operations in the engine process): as a release during the commit, the hold
        becomes the commit's, so that a request for the session (the client's retry) waits for
        the write instead of being refused 409, and the commit ends the lease, whether it lands or
        fails. Whoever sent the commit still calls `release` once it returned (a commit that
        failed before it began leaves the lease to that)."""
        with self._lock:
            if lease.done:
                return
            lease.release_asked = True
            self.holds.hand_over(lease.session_id, lease.lease_id)

    def delete(self, session_id: str, owner: str | None, idempotency: dict | None = None) -> Replay | None:
        """Delete the session. With `idempotency`, a tombstone remembers the key for
        TOMBSTONE_SECONDS, and the same delete again returns a Replay instead of 404."""
        try:
            head = self.durable.head(session_id, idempotency is not None)
            with self._locked():
                record = self._settled(session_id, owner, head)
                hold = self.holds.take(session_id)  # SessionLocked (409) while a request holds it, before ...
            try:
                if head is not None and overtaken(record, head):
                    # a commit of this replica landed between that read and the hold (one the delete
                    # waited for in `_settled`): read again, as the delete is of the version Redis
                    # holds now (durable.py `delete`); no commit of this replica can land while held
                    head = self.durable.head(session_id, idempotency is not None)
                with self._lock:
                    remembered = head.remembered if head is not None else record.remembered
                    remembered_entry(remembered or [], idempotency, session_id)  # ... a key used elsewhere: 422
            except BaseException:
                with self._lock:
                    self.holds.give_back(session_id, hold)
                raise
        except SessionNotFound:
            replay = None if idempotency is None else deleted_before(
                self.durable.tombstone(session_id), owner, idempotency, session_id)
            if replay is None:
                raise
            return replay
        except SessionUnavailable:  # perhaps a record whose metadata does not read: its owner may still delete it
            entry = None if idempotency is None else new_entry(idempotency, {}, -1, 0)
            if not self.durable.delete_unreadable(session_id, owner, entry):
                raise
            with self._locked():
                record = self.manager.get(session_id)
                if record is not None and not record.pinned:
                    self.placement.forget(record)
            return None
        entry = None if idempotency is None else new_entry(idempotency, {}, record.version, record.tokens)
        try:
            self.durable.delete(record, entry, head)  # outside the lock, the session held
        except BaseException:
            with self._lock:
                self.holds.give_back(session_id, hold)
            raise
        with self._locked():
            try:
                self.placement.forget(record)
            finally:
                self.holds.give_back(session_id, hold)
        return None

    def fork(self, session_id: str, owner: str | None, idempotency: dict | None = None) -> SessionInfo | Replay:
        """A new session starting from this one's committed state; the two diverge independently.
        With `idempotency`, the key is remembered on the source (after the fork is written: a
        failure in between leaves a fork nobody was told of, listed in GET /v1/sessions)."""
        lease = self.acquire(session_id, owner, idempotency)
        if lease.replay is not None:
            return Replay(lease.replay)
        try:
            info = self._admit_new(lease.info.model, owner, lease.data.clone(), source_id=session_id,
                                   source_version=lease.version)
            if idempotency is not None:
                self._remember(lease, new_entry(idempotency, dataclasses.asdict(info), lease.version, lease.info.tokens))
            return info
        finally:
            self.release(lease)

    def export(self, session_id: str, owner: str | None) -> tuple[SessionInfo, bytes]:
        """The committed state as safetensors bytes (metadata: model, tokens, version, ...; no
        owner, no remembered Idempotency-Keys or the fingerprint of the request that made it)."""
        lease = self.acquire(session_id, owner)
        try:
            with self._lock:
                meta = self.durable.metadata(self.manager.get(session_id))
            meta["owner"] = ""
            meta.pop("idempotency", None)
            meta.pop("made_by", None)
            meta.pop("commit", None)  # the session's, not the file's: an import is a commit of its own
            return lease.info, encode(lease.data, meta)
        finally:
            self.release(lease)

    def replace(self, session_id: str, owner: str | None, data: SessionData,
                idempotency: dict | None = None) -> SessionInfo | Replay:
        """Import into an existing session: its state becomes `data`, as one commit."""
        lease = self.acquire(session_id, owner, idempotency)
        if lease.replay is not None:
            return Replay(lease.replay)
        try:
            return self.commit(lease, data, None if idempotency is None else {**idempotency, "result": None},
                               whole=True)
        finally:
            self.release(lease)

    def import_new(self, model: str, owner: str | None, data: SessionData,
                   idempotency: dict | None = None) -> SessionInfo | Replay:
        return self.create(model, owner, data, idempotency)

    def compact(self, session_id: str) -> bool:
        """Write an idle session whole at its version, its log of delta commits gone (durable.py
        `compact`): what the compactor does after a commit whose log passed `compact_ratio`
        times its base (compactor.py). The session is held meanwhile, as for a move: a request
        for it waits. False, doing nothing, when a request holds it (its commit asks again) or it
        is gone; False too when the compaction was not written (the log stays valid). Counted in
        xlserve_session_compactions_total{outcome} and, when it held the session,
        xlserve_session_compaction_seconds."""
        with self._lock:
            record = self.manager.get(session_id)
            if record is None or self.durable.tier not in record.copies:
                return False
            if self.holds.kind(session_id) is not None:
                self._count_compaction(record.model, "busy")
                return False
            hold = self.holds.take(session_id, MOVE)
        started = time.monotonic()
        outcome = "failed"
        try:  # from the hold on: whatever fails gives it back
            with self._lock:
                meta = self.durable.metadata(record)
            if self.redis is None and record.disk_log_bytes == 0:  # a whole write cleared the log since it was asked
                outcome = "moved_on"
                return False
            if self.redis is not None:  # another replica may have committed since: then its log is its own
                head = self.durable.head(session_id)
                if head is None or not same_commit(record, head) or head.log_bytes == 0:  # or its log went since
                    outcome = "moved_on"
                    return False
            data = self.placement.read(record, record.tier, to_device=False)
            outcome = self.durable.compact(record, lambda: encode_parts(data, meta))
            if outcome == "compacted":
                # no log left, unless its removal failed (the blocks name the old base: never read)
                log_bytes = self.durable.disk_log_bytes(session_id)
                with self._lock:
                    self.manager.resize(session_id, record.nbytes, log_bytes)
                    self.placement.publish()
            return outcome == "compacted"
        except CacheError as error:  # a full or failing store: the log stays, a later commit asks again
            log.warning("session %s: compaction failed (%s); its log stays", session_id, error)
            return False
        finally:
            with self._lock:
                self.holds.give_back(session_id, hold)
            self._count_compaction(record.model, outcome, time.monotonic() - started)

    def _count_compaction(self, model: str, outcome: str, seconds: float | None = None) -> None:
        if self.metrics is None:
            return
        self.metrics.session_compactions.labels(model, outcome).inc()
        if seconds is not None:
            self.metrics.session_compaction_seconds.labels(model).observe(seconds)

    def move(self, session_id: str, tier: str) -> None:
        """Put an idle session's fastest copy in `tier` (benchmarks and tests): copies above it
        are dropped, one is made there if needed. Budgets are not checked. A session the cache
        holds (a compaction after its last commit) is waited for, as a request waits."""
        transfer = Transfer(self.placement)
        try:
            with self._lock:
                deadline = time.monotonic() + self.hold_wait_s
                while not self.holds.settled(session_id, timeout=max(deadline - time.monotonic(), 0.0)):
                    if time.monotonic() >= deadline:
                        break
                record = self.manager.get(session_id)
                if record is None or record.pinned or tier not in self.manager.tiers:
                    raise ValueError(f"cannot move {session_id} to {tier}")
                transfer.hold(session_id, self.holds.take(session_id, MOVE))
                self.placement.move(record, tier, transfer)
        finally:
            if transfer.held:
                transfer.carry_out(self._lock)

    # -- internals --------------------------------------------------------------------------

    def _admit_new(self, model: str, owner: str | None, data: SessionData, source_id: str | None = None,
                   source_version: int = 0, session_id: str | None = None, made_by: str = "") -> SessionInfo:
        """`_admit`, within `owner`'s bound (`_check_quota`). With Redis the owner's sessions are
        counted by a scan, which a create of the same owner running beside it could miss, landing
        after the scan began (eight at once passed a bound of 3 by 4): this replica's new sessions
        of one owner are made one at a time (`_owner_turn`), so that each scan sees every one made
        here before it."""
        if not self.max_sessions_per_key or self.redis is None:
            return self._admit(model, owner, data, source_id, source_version, session_id, made_by, None)
        with self._owner_turn(owner):
            return self._admit(model, owner, data, source_id, source_version, session_id, made_by,
                               self._held_in_redis(owner))

    @contextlib.contextmanager
    def _owner_turn(self, owner: str | None):
        """Hold `owner`'s turn to make a session on this replica: a lock of its own (another
        owner's import, seconds of writing at real size, never holds it up), waited for at most
        OWNER_TURN_SECONDS, then SessionQuotaBusy (429), so that one key making sessions at
        once parks at most that long each of the session-op threads every client shares."""
        with self._lock:
            turn = self._owner_turns.setdefault(owner, [threading.Lock(), 0])
            turn[1] += 1
        try:
            if not turn[0].acquire(timeout=OWNER_TURN_SECONDS):
                raise SessionQuotaBusy(f"another session of this API key is being made on this replica, and with "
                                       f"XLSERVE_MAX_SESSIONS_PER_KEY its sessions are made one at a time; retry")
            try:
                yield
            finally:
                turn[0].release()
        finally:
            with self._lock:
                turn[1] -= 1
                if not turn[1]:
                    del self._owner_turns[owner]

    def _admit(self, model: str, owner: str | None, data: SessionData, source_id: str | None, source_version: int,
               session_id: str | None, made_by: str, in_redis: int | None) -> SessionInfo:
        """Write a new session to the last tier, then put it on the device (create, fork, import).
        `session_id` (a keyed id, else a random one) is refused with _AlreadyMade when the books
        hold it or the cache holds it; `made_by` is the keyed request's fingerprint.
        A fork (`source_id` at `source_version`, held by the caller) shares its source's stored
        base where the last tier can (durable.py `fork`), unless the source's state is in another
        dtype than the cache's (stored before XLSERVE_STATE_DTYPE changed): the fork is then
        written whole, in the cache's dtype, as its books count it."""
        stored = data
        data = self.placement.on_device(model, data.cast_state(self.state_dtype).compact())
        if source_id is not None and any(t.dtype != u.dtype for (_, t), (_, u) in zip(stored.state._named_tensors(),
                                                                                       data.state._named_tensors())):
            source_id = None
        now = time.time()
        record = Record(id=session_id or new_session_id(), model=model, owner=owner, nbytes=data.nbytes(),
                        tokens=data.tokens, version=0, created_at=now, last_used_at=now, made_by=made_by,
                        commit_id=new_commit_id())
        meta = self.durable.metadata(record)
        meta_block = None if source_id is None else encode_delta({}, state_metadata(data), "same", meta)
        with self._lock:
            if session_id is not None and (self.manager.get(session_id) is not None
                                           or self.holds.kind(session_id) is not None):
                raise _AlreadyMade(session_id)
            self._check_quota(owner, in_redis)
            # its bytes booked in the last tier; a fork's also its copy of the source's log and a block
            source = None if source_id is None else self.manager.get(source_id)
            log_bytes = 0 if meta_block is None else (
                (source.disk_log_bytes if source else 0) + DiskStore.framed_bytes(len(meta_block)))
            booked = self.placement.admit(record, log_bytes)
            hold = self.holds.take(record.id, NEW)
        try:  # outside the lock
            if source_id is None:
                self.durable.write(record, lambda: encode_parts(data, meta), expected=None)
            else:
                self.durable.fork(source_id, source_version, record, lambda: encode_parts(data, meta), meta_block)
        except BaseException as error:
            with self._locked():
                self.placement.unreserve(booked)
                self.holds.give_back(record.id, hold)
                if getattr(error, "stored_copy_in_doubt", False):
                    # the file may be there although the client is told the session was not made:
                    # it goes at the sweep, or a restart would list a session nobody was given. A
                    # keyed id is not remembered as deleted: the client's retry with its key makes it
                    self.placement.forget(record, deleted=session_id is None)
                else:
                    self.manager.remove(record.id)
            raise
        log_bytes = self.durable.disk_log_bytes(record.id)  # a fork's copy of its source's log
        at_home = self.placement.home_copy(record.id, record.nbytes, data)  # outside the lock: perhaps to host RAM
        transfer = Transfer(self.placement)
        try:
            with self._lock:
                try:
                    self.placement.unreserve(booked)
                    self.manager.resize(record.id, record.nbytes, log_bytes)
                    self.placement.admitted(record, at_home)
                finally:
                    self.holds.give_back(record.id, hold)
                self._rebalance_device(transfer)
                info = self._info(record)  # before the lock is given up, as a commit's answer (see there)
        finally:
            transfer.carry_out(self._lock)
        return info

    def _held_in_redis(self, owner: str | None) -> int:
        """How many sessions of `owner` Redis holds, over every replica (one scan of its sessions,
        as a listing makes; outside the cache's lock)."""
        return sum((meta.get("owner") or None) == owner for _, meta in self.durable.heads().values())

    def _check_quota(self, owner: str | None, in_redis: int | None) -> None:
        """(Under the lock.) SessionQuotaExceeded when `owner` already holds `max_sessions_per_key`
        sessions: without Redis, those in the books (every session of the disk is; a create
        enters them under this lock); with Redis, those Redis holds (`in_redis`, scanned in the
        owner's turn: `_admit_new`). Replicas creating for one owner at the same moment may
        each pass with one place left: the bound can be passed by the replicas' number less one,
        never more."""
        limit = self.max_sessions_per_key
        if not limit:
            return
        held = self.manager.owned(owner) if in_redis is None else in_redis
        if held >= limit:
            raise SessionQuotaExceeded(
                f"this API key holds {held:,} sessions, the most XLSERVE_MAX_SESSIONS_PER_KEY ({limit:,}) allows: "
                "delete one (DELETE /v1/sessions/{id}) before making another")

    def _remember(self, lease: Lease, entry: dict) -> None:
        """Remember an Idempotency-Key on a leased session without changing its state (a fork's)."""
        if self.redis is not None:
            with self._lock:
                commit_id = self._leased(lease).commit_id
            if not self.durable.remember(lease.session_id, lease.version, entry, commit_id):
                log.warning("session %s changed before its fork's Idempotency-Key could be remembered", lease.session_id)
            return
        with self._lock:
            record = self.manager.get(lease.session_id)
            remembered = kept(entry, record.remembered)
            meta = self.durable.metadata(dataclasses.replace(record, remembered=remembered))
        # the lease holds the session; only the metadata changes: a delta block of no tensors
        self.durable.write(record, lambda: encode_parts(lease.data, meta), expected=None,
                           delta=encode_delta({}, state_metadata(lease.data), "same", meta))
        log_bytes = self.durable.disk_log_bytes(record.id)
        with self._lock:
            record.remembered = remembered
            self.manager.resize(record.id, record.nbytes, log_bytes)

    @staticmethod
    def _changes(old: SessionData, new: SessionData) -> dict | None:
        """What a commit changed from the leased version (models/interface.py `State.delta_from`),
        or None for a whole write: a model whose state changes as a whole, or a change that costs
        more than half the state to describe (writing it whole then costs little more, and
        starts a new base). Any failure to compute it is a whole write too, never a wrong one."""
        try:
            device = new.state._named_tensors()[0][1].device  # the lease's copy may be elsewhere (a host-homed session)
            changes = new.state.delta_from(old.state.to(device), new.tokens - old.tokens)
        except Exception:  # a model's state the change cannot be described for: written whole
            log.exception("the change of a %s could not be computed; writing it whole", type(new.state).__name__)
            return None
        if changes is None or 2 * sum(change.nbytes() for change in changes.values()) > new.state.nbytes():
            return None
        return changes

    def _rebalance_device(self, transfer: Transfer) -> None:
        """Under the lock, once a commit or a new session is written: the moves that bring the
        device, then host RAM (the home of sessions larger than the device's budget), back within
        their budgets, into `transfer`. The change is durable by then, so a
        failure here is logged, not answered (the client would retry a change that landed): what
        was booked before it is carried out with `transfer`, and the next plan moves the rest."""
        try:
            self.placement.rebalance("device", transfer)
            self.placement.rebalance("host", transfer)  # where a session larger than the device's budget lives
        except Exception:
            log.exception("the device could not be brought back within its budget; the next plan tries again")

    def _end_lease(self, lease: Lease) -> None:
        """Under the lock: the lease's hold given back, the session's state as it was."""
        lease.done = True
        if self.holds.give_back(lease.session_id, lease.lease_id) and self.manager.get(lease.session_id):
            self.manager.touch(lease.session_id, time.time())
            self.placement.publish()

    def _commit_failed(self, lease: Lease) -> None:
        """After a commit's write failed: the lease is the request's again, or, when its release
        came during the write, it ends now."""
        with self._lock:
            lease.committing = False
            if lease.release_asked:
                self._end_lease(lease)

    @contextmanager
    def _locked(self):
        """The lock; the files of sessions that left the books meanwhile go once it is released."""
        try:
            with self._lock:
                yield
        finally:
            self.placement.sweep()

    def _lookup(self, session_id: str, owner: str | None, head: Head | None = None) -> Record:
        """The session's record (under the lock). With Redis, `head` is what Redis holds: a
        session it has not is gone, one this replica has not seen is taken into the books."""
        if not SESSION_ID.match(session_id):
            raise SessionNotFound(session_id)
        record = self.manager.get(session_id)
        if head is not None:
            if head.version < 0:
                if record is not None and not record.pinned:
                    self.placement.forget(record)
                raise SessionNotFound(session_id)
            if record is None:  # created by another replica
                if self.placement.deleted_here(session_id, head.meta):  # a head read before this replica deleted it
                    raise SessionNotFound(session_id)
                record = DurableStore.record_from_meta(session_id, {**head.meta, "version": head.version}, {"redis"})
                self.manager.add(record)
        if record is None or record.owner != owner or self.holds.kind(session_id) == NEW:
            raise SessionNotFound(session_id)  # another key's session does not exist for you
        return record

    def _settled(self, session_id: str, owner: str | None, head: Head | None) -> Record:
        """`_lookup`, once the cache is done moving the session's bytes (it waits for that, at
        most `hold_wait_s`: then SessionUnavailable, a 503 the client may retry). At most
        WAITERS_PER_SESSION requests wait for one session; the next is refused at once with
        SessionUnavailable. Each waiter holds one of the engine process's session-op threads,
        which every other client's acquire and commit need: a client retrying one session in a
        loop while its write is slow must not take them all."""
        deadline = time.monotonic() + self.hold_wait_s
        record = self._lookup(session_id, owner, head)
        if not self.holds.by_cache(session_id):
            return record
        waiting = self._waiting.get(session_id, 0)
        if waiting >= WAITERS_PER_SESSION:
            raise SessionUnavailable(f"session '{session_id}' is being moved or written and {waiting} requests "
                                     "already wait for it; retry later", session_id)
        self._waiting[session_id] = waiting + 1
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.error("session %s: still held by the cache (%s) after %.0fs", session_id,
                              self.holds.kind(session_id), self.hold_wait_s)
                    raise SessionUnavailable(f"session '{session_id}' is still being moved or written after "
                                             f"{self.hold_wait_s:.0f}s; retry later", session_id)
                self.holds.wait(left)  # until some hold ends
                record = self._lookup(session_id, owner, head)  # it may have changed meanwhile
                if not self.holds.by_cache(session_id):
                    return record
        finally:
            left_waiting = self._waiting.pop(session_id) - 1
            if left_waiting:
                self._waiting[session_id] = left_waiting

    def _leased(self, lease: Lease) -> Record:
        if lease.done:
            raise RuntimeError("this lease has already ended")
        if lease.committing:
            raise RuntimeError("this lease is being committed already")
        record = self.manager.get(lease.session_id)
        if record is None or not self.holds.holds(lease.session_id, lease.lease_id):
            raise SessionNotFound(lease.session_id)
        return record

    def _info(self, record: Record, tier: str | None = None, in_use: bool | None = None) -> SessionInfo:
        return SessionInfo(
            id=record.id, model=record.model, owner=record.owner, tokens=record.tokens, version=record.version,
            state_bytes=record.nbytes, tier=tier or record.tier, created_at=record.created_at,
            last_used_at=record.last_used_at, in_use=self.holds.leased(record.id) if in_use is None else in_use,
        )


def _forget_deleted_periodically(cache_ref: weakref.ref, closing: threading.Event, every_s: float) -> None:
    """SessionCache's housekeeping thread, every `every_s` until `closing` or until the cache is
    gone: the disk's expired tombstones go, and with Redis `forget_deleted_elsewhere`."""
    while not closing.wait(every_s):
        cache = cache_ref()
        if cache is None:
            return
        try:
            cache.durable.prune_tombstones()  # the disk's; Redis expires its own
            cache.forget_deleted_elsewhere()
        except Exception as error:  # noqa: BLE001 - Redis away: the next round tries again
            log.warning("letting go of sessions deleted on other replicas failed: %r", error)
        del cache
