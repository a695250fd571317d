"""The session cache: every session's model state, across tiers, durable at every commit.

A session is (model, state, token count, version, owner). The `CacheManager` (manager.py) keeps
the books and plans; this class carries the plans out through the stores (stores.py). It runs
in the engine process, which calls it for the API process's session operations (the wire ops of
server/engine/process.py; docs/design.md section 6):

    create / fork / import_new      a new session (random 128-bit id, version 0)
    acquire -> Lease                one request at a time (else SessionLocked -> 409): the
                                    session's committed state, promoted to the model's device
    commit(lease, data)             the request's whole effect, version + 1, durable on return
    release(lease)                  end a lease without changing anything (cancel, error,
                                    disconnect): the state is exactly as before the request
    info / delete / export / replace

Tiers: device (where the model runs) → host RAM → disk → Redis (with XLSERVE_REDIS_URL), each
with a byte budget. A request needs its session on the device; making room moves the least
recently used idle sessions down (device → host → disk → Redis). Leased sessions are pinned.
When the device cannot make room because every session on it is in use, or the last tier is
full, the call is refused with CacheFull (→ 503): the cache says no rather than run out of memory.

Persistence: write-through, not a journal. Every commit (and every create, fork and import)
writes the session's new state to the last tier before it returns: to disk as one safetensors
file (temporary name, fsync, rename, directory fsync; a checksum inside, verified on every
load), or, with Redis, to Redis with compare-and-set on the version. So a `kill -9` at any
moment finds every session at its last committed version, and a graceful shutdown has nothing
left to write (close() checks that every session has its durable copy and writes any that lack
one). On start, `open()` indexes the session files by their headers (the checksum is verified
when a session is loaded). Write-through costs one fsync per commit; a journal would cost the
same fsync for the same bytes, plus compaction and a replay on start, and the files are what
the disk tier and the export format need anyway.

Several replicas: with Redis, Redis holds every committed session and is the truth. A replica
keeps copies of the sessions it serves on its own device/host/disk; before using one (acquire,
info) it compares its version with Redis's and reloads when another replica committed since.
A commit succeeds only if Redis still holds the version the lease started from; otherwise
SessionConflict (→ 409) and the stale result is dropped, never written. Use Redis with
persistence (appendonly) in production: what Redis loses, the replicas lose.

Metrics: `xlserve_sessions{tier}` counts sessions by their fastest copy, while
`xlserve_session_state_bytes{tier}` counts the bytes each tier holds (with write-through the
last tier holds every session). An acquire is a hit on the tier it found the session in and a
miss on every faster tier.

Budgets count the bytes of committed states (`SessionData.nbytes()`: state tensors plus the
next-token distribution). A running request's working copy is the engine's business. A session
whose state is larger than the whole budget of the device or of the last tier can never be
served: that is SessionTooLarge (→ 413), never the retryable CacheFull.

Locking: the books and the local tiers (device, host, disk) are guarded by one lock, their I/O
included: simple and exact, at the price of serialising local commits (one fsync each). Redis
is never called under that lock: a hung Redis must not queue every other request behind one
that waits on it. A request that talks to Redis pins its session first (acquire does; a
commit's lease already has), so no other request of this replica changes that session in the
meantime, and each Redis call is bounded by the store's timeout (stores.py).

Certain commits: a client is never told that a commit failed when it landed, nor that it landed
when it did not. When a Redis write times out, the commit asks Redis, for up to the settle wait,
whether that write landed, and fences it if it has not (stores.py `settle`): then the answer is
final either way. Only when Redis stays silent for the whole settle wait is the answer
CommitOutcomeUnknown (→ 503 `commit_outcome_unknown`), which says how to find out.

Idempotency-Keys: a request that changes a session may carry a key (with a fingerprint of the
request). The session remembers the most recent IDEMPOTENCY_KEYS_PER_SESSION keys with each
one's first result, in its durable copy, written in the same atomic write as the change they
belong to (the file's metadata; Redis's hash). The same key again returns that result instead of
applying twice (a Lease with `replay`, or a `Replay`); the same key with another request is
IdempotencyKeyReused (→ 422). A delete with a key leaves a tombstone for a day.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

from xlserve.server.cache.codec import CorruptState, SessionData, decode, encode, session_data
from xlserve.server.cache.errors import (
    CacheError,
    CacheFull,
    CommitOutcomeUnknown,
    IdempotencyKeyReused,
    SessionConflict,
    SessionInfo,
    SessionLocked,
    SessionNotFound,
    SessionTooLarge,
    SessionUnavailable,
)
from xlserve.server.cache.manager import CacheManager, Move, Reclaim, Record
from xlserve.server.cache.stores import (
    SESSION_ID,
    DiskStore,
    Head,
    MemoryStore,
    RedisStore,
    StoreFull,
    StoreUnavailable,
    entries_from_lines,
    entry_line,
)

log = logging.getLogger("xlserve.cache")

IDEMPOTENCY_KEYS_PER_SESSION = 32  # the most recent Idempotency-Keys a session remembers (README)
TOMBSTONE_SECONDS = 24 * 3600  # how long a delete's Idempotency-Key is remembered


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


@dataclass
class Replay:
    """The answer of an operation whose Idempotency-Key was seen before: its remembered entry."""

    entry: dict


def new_session_id() -> str:
    return "sess_" + secrets.token_hex(16)  # 128 random bits


def remembered_entry(remembered: list[dict], idempotency: dict | None, session_id: str) -> dict | None:
    """The entry of `idempotency`'s key among a session's remembered ones; IdempotencyKeyReused
    when the key was used for a different request (another fingerprint)."""
    if idempotency is None:
        return None
    for entry in remembered:
        if entry.get("key") == idempotency["key"]:
            if entry.get("fingerprint") != idempotency["fingerprint"]:
                raise IdempotencyKeyReused(
                    f"Idempotency-Key '{idempotency['key']}' was already used on session '{session_id}' for a "
                    "different request; send a new key with a new request", session_id)
            return entry
    return None


def _info(record: Record) -> SessionInfo:
    return SessionInfo(
        id=record.id, model=record.model, owner=record.owner, tokens=record.tokens, version=record.version,
        state_bytes=record.nbytes, tier=record.tier, created_at=record.created_at,
        last_used_at=record.last_used_at, in_use=record.pinned,
    )


class SessionCache:
    def __init__(self, state_dir, device_bytes: int | None, host_bytes: int | None, disk_bytes: int | None,
                 redis_url: str = "", metrics=None, store_timeout_s: float = 5.0, settle_s: float = 15.0):
        """`store_timeout_s` bounds each Redis call; `settle_s` is how long a commit whose write
        timed out keeps asking Redis whether it landed before answering CommitOutcomeUnknown."""
        budgets = {"device": device_bytes, "host": host_bytes, "disk": disk_bytes}
        self.redis = RedisStore(redis_url, timeout_s=store_timeout_s) if redis_url else None
        self.settle_s = settle_s
        if self.redis is not None:
            budgets["redis"] = None  # bounded by Redis's own maxmemory
        self.manager = CacheManager(budgets)
        self.durable = self.manager.last_tier
        self.device = MemoryStore()  # each state on its own model's device
        self.host = MemoryStore("cpu")
        self.disk = DiskStore(state_dir)
        self.metrics = metrics
        self.models: dict[str, object] = {}  # name -> LanguageModel (device, state_class, check_session)
        self._lock = threading.RLock()
        self._published: set[tuple[str, str]] = set()
        self._borrower = None  # the prefix cache, once lend_to shares the budgets with it

    def lend_to(self, borrower) -> None:
        """Share the tiers' budgets with `borrower` (the prefix cache): it reports what it holds
        per tier (`held(tier)`), keeps entries only in the room sessions leave, and gives room
        back when sessions need it (`release(tier, nbytes)`, called under this cache's lock, so
        the borrower never calls this cache)."""
        self._borrower = borrower
        self.manager.lend(borrower.held)

    @classmethod
    def from_settings(cls, settings, metrics=None) -> "SessionCache":
        return cls(settings.state_dir, settings.device_state_bytes, settings.host_state_bytes,
                   settings.disk_state_bytes, settings.redis_url, metrics,
                   store_timeout_s=settings.store_timeout_seconds, settle_s=settings.commit_settle_seconds)

    # -- start and stop ---------------------------------------------------------------------

    def open(self, models: dict[str, object]) -> int:
        """Register the served models and index the sessions already written down. Returns how
        many were found."""
        with self._lock:
            self.models.update(models)
            if self.redis is not None:
                self.redis.ping()
            self.disk.prune_tombstones(TOMBSTONE_SECONDS)
            found = sorted(self.disk.scan(), key=lambda item: float(item[1].get("last_used_at", 0)))
            for session_id, meta in found:
                if self.manager.get(session_id) is not None:
                    continue
                copies = {"disk"} | ({"redis"} if self.redis is not None else set())
                self.manager.add(self._record_from_meta(session_id, meta, copies))
            if self.manager.free("disk") is not None and self.manager.free("disk") < 0:
                log.warning("sessions on disk hold %d bytes, over XLSERVE_DISK_STATE_BYTES=%d; new sessions are "
                            "refused until some are deleted", self.manager.used("disk"), self.manager.budgets["disk"])
            self._publish()
            return len(found)

    def close(self) -> None:
        """Graceful shutdown: make sure every session has its durable copy (write-through means
        they all have one already; a session that somehow lacks it is written now)."""
        with self._lock:
            written = 0
            for record in list(self.manager.records.values()):
                if self.durable in record.copies or self.durable == "redis":
                    continue
                data = self._load(record, record.tier)
                self._write_durable(record, data, expected=None)
                self.manager.add_copy(record.id, self.durable)
                written += 1
            log.info("session cache closed: %d sessions persisted (%d written at shutdown)",
                     len(self.manager.records), written)
            if self.redis is not None:
                self.redis.close()

    # -- the API ----------------------------------------------------------------------------

    def create(self, model: str, owner: str | None, data: SessionData) -> SessionInfo:
        return self._admit_new(model, owner, data)

    def info(self, session_id: str, owner: str | None) -> SessionInfo:
        head = self._head(session_id)  # outside the lock: Redis may be slow
        with self._lock:
            record = self._lookup(session_id, owner, head)
            if head is not None and head.version > record.version:
                if record.pinned:  # a request holds it (its commit may be landing): report, change nothing
                    return dataclasses.replace(_info(record), version=head.version, tokens=int(head.meta["tokens"]),
                                               state_bytes=int(head.meta["nbytes"]))
                self._catch_up(record, head)
            return _info(record)

    def sessions(self) -> list[SessionInfo]:
        with self._lock:
            return [_info(r) for r in self.manager.records.values()]

    def list_sessions(self, owner: str | None, limit: int = 20, after: str | None = None) -> tuple[list[SessionInfo], bool]:
        """`owner`'s sessions, newest first (created_at, then id), from the one after `after`
        (a session id; ValueError when it is none of the owner's), at most `limit`; and whether
        more follow. With Redis, Redis is the truth: every replica's sessions are listed."""
        heads = self._redis(self.redis.heads) if self.redis is not None else None  # outside the lock
        with self._lock:
            if heads is None:
                infos = [_info(r) for r in self.manager.records.values() if r.owner == owner]
            else:
                infos = []
                for session_id, (version, meta) in heads.items():
                    if (meta.get("owner") or None) != owner:
                        continue
                    record = self.manager.get(session_id)
                    if record is not None and record.version >= version:
                        infos.append(_info(record))
                        continue
                    infos.append(SessionInfo(
                        id=session_id, model=str(meta["model"]), owner=owner, tokens=int(meta["tokens"]),
                        version=version, state_bytes=int(meta["nbytes"]), tier="redis",
                        created_at=float(meta.get("created_at", 0)), last_used_at=float(meta.get("last_used_at", 0)),
                        in_use=record is not None and record.pinned))
        infos.sort(key=lambda info: (info.created_at, info.id), reverse=True)
        start = 0
        if after is not None:
            start = next((i + 1 for i, info in enumerate(infos) if info.id == after), -1)
            if start < 0:
                raise ValueError(f"'after' is not one of your sessions: {after!r}")
        return infos[start : start + limit], start + limit < len(infos)

    def acquire(self, session_id: str, owner: str | None, idempotency: dict | None = None) -> Lease:
        """Take the session for one request; its committed state comes back on its model's
        device. SessionLocked when another request holds it, CacheFull when the device has no
        room even after moving every idle session out of the way, SessionTooLarge when it never
        could. With `idempotency` ({key, fingerprint}) seen before on this session, nothing is
        taken: the lease carries the remembered entry as `replay`."""
        want_keys = idempotency is not None
        head = self._head(session_id, want_keys)  # outside the lock: Redis may be slow
        with self._lock:
            record = self._lookup(session_id, owner, head)
            if record.pinned:
                raise SessionLocked(session_id)
            self.manager.pin(session_id)  # from here on no other request of this replica changes it
        try:
            if head is not None and head.version < record.version:
                # a commit here went in between that read and the pin: read again (it cannot change now)
                head = self._head(session_id, want_keys)
            with self._lock:
                record = self._lookup(session_id, owner, head)
                self._catch_up(record, head)
                remembered = head.remembered if head is not None else record.remembered
                entry = remembered_entry(remembered or [], idempotency, session_id)
                if entry is not None:
                    self.manager.unpin(session_id)
                    return Lease(session_id, record.version, None, _info(record), done=True, replay=entry)
                if record.tier != "redis":
                    return self._leased(record, self._promote(record))
            data, seconds = self._fetch(record)  # the only copy is in Redis: outside the lock
            with self._lock:
                return self._leased(record, self._place(record, data, seconds))
        except BaseException:
            with self._lock:
                if self.manager.get(session_id) is record:
                    self.manager.unpin(session_id)
            raise

    def commit(self, lease: Lease, data: SessionData, remember: dict | None = None) -> SessionInfo:
        """Make `data` the session's state: durable when this returns, version + 1, lease ended.
        `remember` ({key, fingerprint, result}) is an Idempotency-Key to remember with it, in the
        same write (`result` None: the commit's own info). On CacheFull, SessionTooLarge or
        SessionConflict nothing changed and the lease is still held (release it); on
        CommitOutcomeUnknown the change may land or not, the lease is still held."""
        with self._lock:
            if lease.done:
                raise RuntimeError("this lease has already ended")
            record = self.manager.get(lease.session_id)
            if record is None or not record.pinned:
                raise SessionNotFound(lease.session_id)
            data = data.compact()
            nbytes = data.nbytes()
            self._refuse_never_fits(record.model, nbytes, record.id, committing=True)
            room = self.manager.plan_room(self.durable, nbytes - record.nbytes)
            if room is None:
                raise self._full(self.durable, record.model, nbytes - record.nbytes, record.id)
            self._execute(room)  # the last tier moves nothing: at most it takes back lent bytes
            now = time.time()
            committed = Record(
                id=record.id, model=record.model, owner=record.owner, nbytes=nbytes, tokens=data.tokens,
                version=lease.version + 1, created_at=record.created_at, last_used_at=now,
                remembered=list(record.remembered),
            )
            entry = None if remember is None else self._entry(remember, committed, now)
            if self.redis is None:  # the durable copy is local: written under the lock
                if entry is not None:
                    committed.remembered = ([entry] + record.remembered)[:IDEMPOTENCY_KEYS_PER_SESSION]
                self._write_durable(committed, data, expected=lease.version)
                return self._committed(lease, record, committed, data)
        # Redis, outside the lock: the lease's pin keeps every other request of this replica off it
        try:
            self._write_durable(committed, data, expected=lease.version, entry=entry)
        except (SessionConflict, CommitOutcomeUnknown):
            with self._lock:  # another replica committed first, or perhaps did we: local copies may be stale
                self._forget_local(record)
            raise
        with self._lock:
            return self._committed(lease, record, committed, data)

    def release(self, lease: Lease) -> None:
        """End a lease without changing the session (cancel, disconnect, error). Idempotent."""
        with self._lock:
            if lease.done:
                return
            lease.done = True
            if self.manager.get(lease.session_id) is not None:
                self.manager.unpin(lease.session_id)
                self.manager.touch(lease.session_id, time.time())
                self._publish()

    def delete(self, session_id: str, owner: str | None, idempotency: dict | None = None) -> Replay | None:
        """Delete the session. With `idempotency`, a tombstone remembers the key for
        TOMBSTONE_SECONDS, and the same delete again returns a Replay instead of 404."""
        try:
            head = self._head(session_id, idempotency is not None)
            with self._lock:
                record = self._lookup(session_id, owner, head)
                if record.pinned:
                    raise SessionLocked(session_id)
                remembered = head.remembered if head is not None else record.remembered
                remembered_entry(remembered or [], idempotency, session_id)  # a key used for another request: 422
                self.manager.pin(session_id)  # while Redis is asked, outside the lock
        except SessionNotFound:
            replay = self._deleted_before(session_id, owner, idempotency)
            if replay is None:
                raise
            return replay
        entry = None
        if idempotency is not None:
            entry = {**idempotency, "result": {}, "version": record.version, "tokens": record.tokens, "at": time.time()}
        try:
            if self.redis is not None:
                self._redis(lambda: self.redis.delete(session_id, owner, entry, IDEMPOTENCY_KEYS_PER_SESSION))
            elif entry is not None:
                kept = ([entry] + record.remembered)[:IDEMPOTENCY_KEYS_PER_SESSION]
                with self._lock:
                    self._wrap_io(lambda: self.disk.write_tombstone(session_id, owner, kept))
        except BaseException:
            with self._lock:
                if self.manager.get(session_id) is record:
                    self.manager.unpin(session_id)
            raise
        with self._lock:
            if self.manager.get(session_id) is record:
                self._forget(record)
        return None

    def fork(self, session_id: str, owner: str | None, idempotency: dict | None = None) -> SessionInfo | Replay:
        """A new session starting from this one's committed state; the two diverge independently.
        With `idempotency`, the key is remembered on the source (after the fork is written: a
        failure in between leaves a fork nobody was told of, listed in GET /v1/sessions)."""
        lease = self.acquire(session_id, owner, idempotency)
        if lease.replay is not None:
            return Replay(lease.replay)
        try:
            info = self._admit_new(lease.info.model, owner, lease.data.clone())
            if idempotency is not None:
                self._remember(lease, {**idempotency, "result": dataclasses.asdict(info), "version": lease.version,
                                       "tokens": lease.info.tokens, "at": time.time()})
            return info
        finally:
            self.release(lease)

    def export(self, session_id: str, owner: str | None) -> tuple[SessionInfo, bytes]:
        """The committed state as safetensors bytes (metadata: model, tokens, version, ...; no
        owner, no remembered Idempotency-Keys)."""
        lease = self.acquire(session_id, owner)
        try:
            with self._lock:
                meta = self._metadata(self.manager.get(session_id))
            meta["owner"] = ""
            meta.pop("idempotency", None)
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
            return self.commit(lease, data, None if idempotency is None else {**idempotency, "result": None})
        finally:
            self.release(lease)

    def import_new(self, model: str, owner: str | None, data: SessionData) -> SessionInfo:
        return self.create(model, owner, data)

    def move(self, session_id: str, tier: str) -> None:
        """Put an idle session's fastest copy in `tier` (benchmarks and tests): copies above it
        are dropped, one is made there if needed. Budgets are not checked."""
        with self._lock:
            record = self.manager.get(session_id)
            if record is None or record.pinned or tier not in self.manager.tiers:
                raise ValueError(f"cannot move {session_id} to {tier}")
            if tier not in record.copies:
                self._put_tier(record, tier, self._load(record, record.tier))
                self.manager.add_copy(session_id, tier)
            for above in self.manager.tiers[: self.manager.tiers.index(tier)]:
                if above in record.copies:
                    self._drop_tier(record, above)
                    self.manager.drop_copy(session_id, above)
            self._publish()

    # -- internals --------------------------------------------------------------------------

    def _admit_new(self, model: str, owner: str | None, data: SessionData) -> SessionInfo:
        data = data.compact()
        now = time.time()
        record = Record(id=new_session_id(), model=model, owner=owner, nbytes=data.nbytes(), tokens=data.tokens,
                        version=0, created_at=now, last_used_at=now)
        with self._lock:
            self._refuse_never_fits(model, record.nbytes)
            room = self.manager.plan_room(self.durable, record.nbytes)
            if room is None:
                raise self._full(self.durable, model, record.nbytes)
            self._execute(room)
            if self.redis is None:
                self._write_durable(record, data, expected=None)
                return self._admitted(record, data)
        self._write_durable(record, data, expected=None)  # to Redis, outside the lock
        with self._lock:
            return self._admitted(record, data)

    def _admitted(self, record: Record, data: SessionData) -> SessionInfo:
        record.copies = {self.durable}
        self.manager.add(record)
        self._put_tier(record, "device", data)
        self.manager.add_copy(record.id, "device")
        self._rebalance("device")
        self._publish()
        return _info(record)

    def _committed(self, lease: Lease, record: Record, committed: Record, data: SessionData) -> SessionInfo:
        """The books after a commit's durable write."""
        # the old copies are stale: only the durable one (just overwritten) and the device one remain
        for tier in [t for t in record.copies if t != self.durable]:
            self._drop_tier(record, tier)
            self.manager.drop_copy(record.id, tier)
        self.manager.add_copy(record.id, self.durable)
        self.manager.resize(record.id, committed.nbytes)
        record.tokens, record.version, record.last_used_at = committed.tokens, committed.version, committed.last_used_at
        record.remembered = committed.remembered
        self._put_tier(record, "device", data)
        self.manager.add_copy(record.id, "device")
        self.manager.touch(record.id)
        self.manager.unpin(record.id)
        lease.done = True
        self._rebalance("device")
        self._publish()
        return _info(record)

    def _leased(self, record: Record, data: SessionData) -> Lease:
        self.manager.touch(record.id, time.time())
        self._publish()
        return Lease(record.id, record.version, data, _info(record))

    def _entry(self, remember: dict, committed: Record, now: float) -> dict:
        """What a session remembers of an Idempotency-Key: the request's fingerprint, its first
        result, and the session's version and tokens after it."""
        result = remember.get("result")
        if result is None:  # the commit's own info, as the client got it
            result = dataclasses.asdict(dataclasses.replace(_info(committed), tier="device"))
        return {"key": remember["key"], "fingerprint": remember["fingerprint"], "result": result,
                "version": committed.version, "tokens": committed.tokens, "at": now}

    def _remember(self, lease: Lease, entry: dict) -> None:
        """Remember an Idempotency-Key on a leased session without changing its state (a fork's)."""
        if self.redis is not None:
            if not self._redis(lambda: self.redis.remember(lease.session_id, lease.version, entry,
                                                           IDEMPOTENCY_KEYS_PER_SESSION)):
                log.warning("session %s changed before its fork's Idempotency-Key could be remembered", lease.session_id)
            return
        with self._lock:
            record = self.manager.get(lease.session_id)
            record.remembered = ([entry] + record.remembered)[:IDEMPOTENCY_KEYS_PER_SESSION]
            self._write_durable(record, lease.data, expected=None)

    def _deleted_before(self, session_id: str, owner: str | None, idempotency: dict | None) -> Replay | None:
        """A delete retried with its Idempotency-Key: the tombstone's entry, or None."""
        if idempotency is None or not SESSION_ID.match(session_id):
            return None
        if self.redis is not None:
            tombstone = self._redis(lambda: self.redis.tombstone(session_id))
        else:
            tombstone = self.disk.read_tombstone(session_id)
        if tombstone is None or tombstone[0] != owner:
            return None
        entry = remembered_entry(tombstone[1], idempotency, session_id)
        return None if entry is None else Replay(entry)

    def _head(self, session_id: str, remembered: bool = False) -> Head | None:
        """Redis's view of the session, or None without Redis. Never called under the lock."""
        if self.redis is None:
            return None
        if not SESSION_ID.match(session_id):
            raise SessionNotFound(session_id)
        head = self._redis(lambda: self.redis.head(session_id, remembered))
        if head is None:
            return Head(-1, {}, None)  # Redis has no such session (deleted, perhaps by another replica)
        return head

    def _lookup(self, session_id: str, owner: str | None, head: Head | None = None) -> Record:
        """The session's record (under the lock). With Redis, `head` is what Redis holds: a
        session it has not is gone, one this replica has not seen is taken into the books."""
        if not SESSION_ID.match(session_id):
            raise SessionNotFound(session_id)
        record = self.manager.get(session_id)
        if head is not None:
            if head.version < 0:
                if record is not None and not record.pinned:
                    self._forget(record)
                raise SessionNotFound(session_id)
            if record is None:  # created by another replica
                record = self._record_from_meta(session_id, {**head.meta, "version": head.version}, {"redis"})
                self.manager.add(record)
        if record is None or record.owner != owner:  # another key's session does not exist for you
            raise SessionNotFound(session_id)
        return record

    def _catch_up(self, record: Record, head: Head | None) -> None:
        """With Redis: take in a version another replica committed since (the local copies are
        stale). A head older than the record is a read that a local commit overtook: ignored."""
        if head is None or head.version <= record.version:
            return
        self._forget_local(record)
        self.manager.resize(record.id, int(head.meta["nbytes"]))
        record.version, record.tokens = head.version, int(head.meta["tokens"])
        record.last_used_at = float(head.meta.get("last_used_at", record.last_used_at))

    def _fetch(self, record: Record) -> tuple[SessionData, float]:
        """The committed state from Redis, checked, and the seconds it took (outside the lock;
        the caller holds the session's pin)."""
        started = time.perf_counter()
        got = self._redis(lambda: self.redis.get(record.id))
        if got is None:
            raise SessionNotFound(record.id)
        if got[0] != record.version:  # another replica committed a moment ago
            raise SessionConflict(record.id)
        return self._decode(record, "redis", got[2]), time.perf_counter() - started

    def _place(self, record: Record, data: SessionData, seconds: float) -> SessionData:
        """Put a state fetched from Redis on its device, making room there (under the lock)."""
        moves = self.manager.plan_room("device", record.nbytes, exclude={record.id})
        if moves is None:
            raise self._full("device", record.model, record.nbytes, record.id)
        self._execute(moves)
        self._put_tier(record, "device", data)
        self.manager.add_copy(record.id, "device")
        self._count_hit(record.model, "redis")
        if self.metrics is not None:
            self.metrics.session_restore_latency.labels(record.model, "redis").observe(seconds)
            self.metrics.session_promotions.labels(record.model, "redis").inc()
        return self.device.get(record.id)

    def _promote(self, record: Record) -> SessionData:
        source = record.tier
        model = record.model
        if source == "device":
            self._count_hit(model, "device")
            return self.device.get(record.id)
        if source == "host":  # the copy leaves host RAM: its room there is free for the moves below
            self.manager.drop_copy(record.id, "host")
        moves = self.manager.plan_room("device", record.nbytes, exclude={record.id})
        if moves is None:
            if source == "host":
                self.manager.add_copy(record.id, "host")
            raise self._full("device", model, record.nbytes, record.id)
        started = time.perf_counter()
        try:
            data = self._load(record, source)
        except BaseException:
            if source == "host":
                self.manager.add_copy(record.id, "host")
            raise
        if self.metrics is not None:
            self.metrics.session_restore_latency.labels(model, source).observe(time.perf_counter() - started)
        if source == "host":
            self._drop_tier(record, "host")
        self._execute(moves)
        self._put_tier(record, "device", data)
        self.manager.add_copy(record.id, "device")
        self._count_hit(model, source)
        if self.metrics is not None:
            self.metrics.session_promotions.labels(model, source).inc()
        return self.device.get(record.id)

    def _rebalance(self, tier: str) -> None:
        moves = self.manager.plan_room(tier, 0)
        if moves is None:  # only pinned sessions left above budget; they leave as soon as they are released
            log.warning("tier %s is over budget and every session in it is in use", tier)
            return
        self._execute(moves)

    def _execute(self, moves: list[Move | Reclaim]) -> None:
        for move in moves:
            if isinstance(move, Reclaim):  # room the prefix cache borrowed: it drops entries
                self._borrower.release(move.tier, move.nbytes)
                continue
            record = self.manager.get(move.session)
            if move.dst is not None:
                self._put_tier(record, move.dst, self._load(record, move.src, to_device=False))
            self._drop_tier(record, move.src)
            self.manager.apply(move)
            if self.metrics is not None:
                self.metrics.session_evictions.labels(record.model, move.src).inc()

    def _load(self, record: Record, tier: str, to_device: bool = True) -> SessionData:
        """The committed state from `tier`, checked; on the session's model device unless
        `to_device` is False (a move between lower tiers)."""
        if tier == "device":
            return self.device.get(record.id)
        if tier == "host" and not to_device:
            return self.host.get(record.id)
        spec = self.models.get(record.model)
        if spec is None:
            raise SessionUnavailable(f"session '{record.id}' belongs to model '{record.model}', "
                                     "which this server does not serve", record.id)
        if tier == "host":
            return self.host.get(record.id).to(spec.device)
        if tier == "disk":
            blob = self.disk.read(record.id)
        else:
            got = self._redis(lambda: self.redis.get(record.id))
            if got is None:
                raise SessionNotFound(record.id)
            if got[0] != record.version:  # another replica committed a moment ago
                raise SessionConflict(record.id)
            blob = got[2]
        data = self._decode(record, tier, blob)
        return data.to(spec.device) if to_device else data

    def _decode(self, record: Record, tier: str, blob: bytes) -> SessionData:
        """A stored blob back into the session's state, checked against the record and its model."""
        spec = self.models.get(record.model)
        if spec is None:
            raise SessionUnavailable(f"session '{record.id}' belongs to model '{record.model}', "
                                     "which this server does not serve", record.id)
        try:
            meta, tensors, next_log_probs = decode(blob)
            if meta.get("session_id") != record.id or int(meta.get("version", -1)) != record.version:
                raise CorruptState(f"{tier} holds session {meta.get('session_id')} version {meta.get('version')}, "
                                   f"expected version {record.version}")
            data = session_data(spec.state_class, meta, tensors, next_log_probs)
            # the model's whole check, as an import gets it (finite, consistent, fits the token count)
            spec.check_session(data.state, data.tokens, data.next_log_probs)
        except (CorruptState, ValueError) as error:
            log.error("session %s: %s copy is unusable: %s", record.id, tier, error)
            raise SessionUnavailable(f"session '{record.id}': the stored state is unusable ({error})", record.id) from None
        return data

    def _put_tier(self, record: Record, tier: str, data: SessionData) -> None:
        if tier == "device":
            spec = self.models.get(record.model)
            self.device.put(record.id, data, device=None if spec is None else spec.device)
        elif tier == "host":
            self.host.put(record.id, data)
        elif tier == "disk":
            self._wrap_io(lambda: self.disk.write(record.id, encode(data, self._metadata(record))))
        else:
            raise ValueError("Redis copies are written by commits only")

    def _drop_tier(self, record: Record, tier: str) -> None:
        if tier == "device":
            self.device.drop(record.id)
        elif tier == "host":
            self.host.drop(record.id)
        elif tier == "disk":
            self.disk.delete(record.id)
        # a Redis copy is dropped only by delete()

    def _write_durable(self, record: Record, data: SessionData, expected: int | None,
                       entry: dict | None = None) -> None:
        """Write `record`'s state to the last tier: the disk file (its metadata carries
        `record.remembered`), or Redis, compare-and-set on `expected`, with `entry` added to the
        remembered Idempotency-Keys. A Redis write that times out is settled (`_settle`)."""
        blob = encode(data, self._metadata(record))
        if self.redis is None:
            self._wrap_io(lambda: self.disk.write(record.id, blob))
            return
        meta = {"model": record.model, "owner": record.owner, "tokens": record.tokens, "nbytes": record.nbytes,
                "created_at": record.created_at, "last_used_at": record.last_used_at}
        write_id = secrets.token_hex(8)
        try:
            written = self.redis.put(record.id, expected, record.version, meta, blob, write_id, entry,
                                     IDEMPOTENCY_KEYS_PER_SESSION)
        except StoreFull as error:  # refused before anything was written
            raise CacheFull(f"session storage is full: {error}") from None
        except StoreUnavailable as error:  # perhaps written, perhaps not, perhaps later
            written = self._settle(record, write_id, error)
        if written == -1:  # cannot happen before a settle; as settled, it was not written
            raise SessionUnavailable(f"session '{record.id}': the write was refused as settled; nothing was "
                                     "written", record.id)
        if written != 1:
            raise SessionConflict(record.id)

    def _settle(self, record: Record, write_id: str, error: StoreUnavailable) -> int:
        """After a Redis write failed without an answer: ask Redis, for up to `settle_s`, whether
        it landed (1), fencing it when it has not, so that it never will (then SessionUnavailable:
        nothing was written). CommitOutcomeUnknown when Redis stays silent all along."""
        deadline = time.monotonic() + self.settle_s
        delay = 0.05
        while True:
            try:
                landed = self.redis.settle(record.id, write_id)
            except StoreUnavailable:
                if time.monotonic() + delay >= deadline:
                    break
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if landed:
                log.warning("session %s: version %d was written although Redis did not answer in time (%s)",
                            record.id, record.version, error)
                return 1
            raise SessionUnavailable(f"session '{record.id}': the session store did not answer in time ({error}); "
                                     "nothing was written", record.id)
        log.error("session %s: whether version %d was written is unknown: Redis did not answer for %.1fs (%s)",
                  record.id, record.version, self.settle_s, error)
        raise CommitOutcomeUnknown(
            f"session '{record.id}': the session store did not answer in time, and whether this change was written "
            f"(as version {record.version}) is not known yet. GET /v1/sessions/{record.id} and compare its version "
            "and tokens, or retry with the same Idempotency-Key, which applies at most once", record.id)

    def _forget_local(self, record: Record) -> None:
        """Drop every local copy (they are stale); Redis keeps the truth."""
        for tier in [t for t in record.copies if t != "redis"]:
            self._drop_tier(record, tier)
            self.manager.drop_copy(record.id, tier)
        self.manager.add_copy(record.id, "redis")

    def _forget(self, record: Record) -> None:
        for tier in list(record.copies):
            self._drop_tier(record, tier)
        self.manager.remove(record.id)
        self._publish()

    def _metadata(self, record: Record) -> dict[str, str]:
        spec = self.models.get(record.model)
        return {
            "session_id": record.id, "model": record.model,
            "architecture": getattr(spec, "architecture", "") if spec is not None else "",
            "owner": record.owner or "", "version": str(record.version),
            "created_at": repr(record.created_at), "last_used_at": repr(record.last_used_at),
        } | ({"idempotency": "\n".join(entry_line(entry) for entry in record.remembered)} if record.remembered else {})

    @staticmethod
    def _record_from_meta(session_id: str, meta: dict, copies: set[str]) -> Record:
        return Record(
            id=session_id, model=str(meta["model"]), owner=meta.get("owner") or None,
            nbytes=int(meta["nbytes"]), tokens=int(meta["tokens"]), version=int(meta["version"]),
            created_at=float(meta.get("created_at", 0)), last_used_at=float(meta.get("last_used_at", 0)),
            copies=set(copies), remembered=entries_from_lines(meta.get("idempotency")),
        )

    def _refuse_never_fits(self, model: str, nbytes: int, session_id: str | None = None,
                           committing: bool = False) -> None:
        """SessionTooLarge when `nbytes` of state exceed the whole budget of the device (where
        every request runs it) or of the last tier (where it is kept): no wait could help."""
        for tier in dict.fromkeys(("device", self.durable)):
            budget = self.manager.budgets.get(tier)
            if budget is not None and nbytes > budget:
                if self.metrics is not None:
                    self.metrics.session_refusals.labels(model, tier).inc()
                subject = (f"this request would make session '{session_id}' hold" if committing
                           else f"session '{session_id}' holds" if session_id else "the new session would hold")
                raise SessionTooLarge(
                    f"{subject} {nbytes} bytes of state, more than the whole {tier} budget of {budget} bytes "
                    f"(XLSERVE_{tier.upper()}_STATE_BYTES): it could never be served, so nothing was changed. A "
                    "retry cannot help; the server's operator can raise the budget", session_id)

    def _full(self, tier: str, model: str, nbytes: int, session_id: str | None = None) -> CacheError:
        """CacheFull (503, retry later), or SessionTooLarge (413) when `nbytes` exceed the tier's
        whole budget."""
        budget = self.manager.budgets[tier]
        if budget is not None and nbytes > budget and tier in ("device", self.durable):
            self._refuse_never_fits(model, nbytes, session_id)
        if self.metrics is not None:
            self.metrics.session_refusals.labels(model, tier).inc()
        if tier == self.durable:
            return CacheFull(f"session storage is full: {tier} holds {self.manager.used(tier)} of {budget} bytes "
                             f"(XLSERVE_{tier.upper()}_STATE_BYTES) and {nbytes} more are needed; delete sessions", session_id)
        return CacheFull(f"no room for a {nbytes}-byte session state on the {tier}: {self.manager.used(tier)} of "
                         f"{budget} bytes are held by sessions in use; retry when a request finishes", session_id)

    @staticmethod
    def _redis(fn):
        """Run a store call; its failures become the cache's errors (both are 503s)."""
        try:
            return fn()
        except StoreFull as error:
            raise CacheFull(f"session storage is full: {error}") from None
        except StoreUnavailable as error:
            raise SessionUnavailable(str(error)) from None

    _wrap_io = _redis

    def _count_hit(self, model: str, tier: str) -> None:
        if self.metrics is None:
            return
        self.metrics.session_cache_hits.labels(model, tier).inc()
        for above in self.manager.tiers[: self.manager.tiers.index(tier)]:
            self.metrics.session_cache_misses.labels(model, above).inc()

    def _publish(self) -> None:
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

