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
next-token distribution). A running request's working copy is the engine's business. Every
operation runs under one lock, I/O included: simple and exact, at the price of serialising
commits (one fsync or Redis round trip each).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

from xlserve.server.cache.codec import CorruptState, SessionData, decode, encode, session_data
from xlserve.server.cache.errors import (
    CacheFull,
    SessionConflict,
    SessionInfo,
    SessionLocked,
    SessionNotFound,
    SessionUnavailable,
)
from xlserve.server.cache.manager import CacheManager, Move, Record
from xlserve.server.cache.stores import SESSION_ID, DiskStore, MemoryStore, RedisStore, StoreFull, StoreUnavailable

log = logging.getLogger("xlserve.cache")


@dataclass
class Lease:
    """A request's hold on a session: `data` is the committed state it starts from."""

    session_id: str
    version: int
    data: SessionData
    info: SessionInfo
    done: bool = field(default=False)


def new_session_id() -> str:
    return "sess_" + secrets.token_hex(16)  # 128 random bits


def _info(record: Record) -> SessionInfo:
    return SessionInfo(
        id=record.id, model=record.model, owner=record.owner, tokens=record.tokens, version=record.version,
        state_bytes=record.nbytes, tier=record.tier, created_at=record.created_at,
        last_used_at=record.last_used_at, in_use=record.pinned,
    )


class SessionCache:
    def __init__(self, state_dir, device_bytes: int | None, host_bytes: int | None, disk_bytes: int | None,
                 redis_url: str = "", metrics=None):
        budgets = {"device": device_bytes, "host": host_bytes, "disk": disk_bytes}
        self.redis = RedisStore(redis_url) if redis_url else None
        if self.redis is not None:
            budgets["redis"] = None  # bounded by Redis's own maxmemory
        self.manager = CacheManager(budgets)
        self.durable = self.manager.last_tier
        self.device = MemoryStore()  # each state on its own model's device
        self.host = MemoryStore("cpu")
        self.disk = DiskStore(state_dir)
        self.metrics = metrics
        self.models: dict[str, object] = {}  # name -> LanguageModel (device, state_class, check_state)
        self._lock = threading.RLock()
        self._published: set[tuple[str, str]] = set()

    @classmethod
    def from_settings(cls, settings, metrics=None) -> "SessionCache":
        return cls(settings.state_dir, settings.device_state_bytes, settings.host_state_bytes,
                   settings.disk_state_bytes, settings.redis_url, metrics)

    # -- start and stop ---------------------------------------------------------------------

    def open(self, models: dict[str, object]) -> int:
        """Register the served models and index the sessions already written down. Returns how
        many were found."""
        with self._lock:
            self.models.update(models)
            if self.redis is not None:
                self.redis.ping()
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
        with self._lock:
            return self._admit_new(model, owner, data)

    def info(self, session_id: str, owner: str | None) -> SessionInfo:
        with self._lock:
            record = self._lookup(session_id, owner)
            self._sync_with_redis(record)
            return _info(record)

    def sessions(self) -> list[SessionInfo]:
        with self._lock:
            return [_info(r) for r in self.manager.records.values()]

    def acquire(self, session_id: str, owner: str | None) -> Lease:
        """Take the session for one request; its committed state comes back on its model's
        device. SessionLocked when another request holds it, CacheFull when the device has no
        room even after moving every idle session out of the way."""
        with self._lock:
            record = self._lookup(session_id, owner)
            if record.pinned:
                raise SessionLocked(session_id)
            self._sync_with_redis(record)
            data = self._promote(record)
            self.manager.pin(session_id)
            self.manager.touch(session_id, time.time())
            self._publish()
            info = _info(record)
            return Lease(session_id, record.version, data, info)

    def commit(self, lease: Lease, data: SessionData) -> SessionInfo:
        """Make `data` the session's state: durable when this returns, version + 1, lease ended.
        On CacheFull or SessionConflict nothing changed and the lease is still held (release it)."""
        with self._lock:
            if lease.done:
                raise RuntimeError("this lease has already ended")
            record = self.manager.get(lease.session_id)
            if record is None or not record.pinned:
                raise SessionNotFound(lease.session_id)
            data = data.compact()
            nbytes = data.nbytes()
            if self.manager.plan_room(self.durable, nbytes - record.nbytes) is None:
                raise self._full(self.durable, record.model, nbytes - record.nbytes, record.id)
            now = time.time()
            committed = Record(
                id=record.id, model=record.model, owner=record.owner, nbytes=nbytes, tokens=data.tokens,
                version=lease.version + 1, created_at=record.created_at, last_used_at=now,
            )
            try:
                self._write_durable(committed, data, expected=lease.version)
            except SessionConflict:
                # another replica committed first: our local copies are stale too
                self._forget_local(record)
                raise
            # the old copies are stale: only the durable one (just overwritten) and the device one remain
            for tier in [t for t in record.copies if t != self.durable]:
                self._drop_tier(record, tier)
                self.manager.drop_copy(record.id, tier)
            self.manager.resize(record.id, nbytes)
            record.tokens, record.version, record.last_used_at = data.tokens, committed.version, now
            self._put_tier(record, "device", data)
            self.manager.add_copy(record.id, "device")
            self.manager.touch(record.id)
            self.manager.unpin(record.id)
            lease.done = True
            self._rebalance("device")
            self._publish()
            return _info(record)

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

    def delete(self, session_id: str, owner: str | None) -> None:
        with self._lock:
            record = self._lookup(session_id, owner)
            if record.pinned:
                raise SessionLocked(session_id)
            if self.redis is not None:
                self._redis(lambda: self.redis.delete(session_id))
            self._forget(record)

    def fork(self, session_id: str, owner: str | None) -> SessionInfo:
        """A new session starting from this one's committed state; the two diverge independently."""
        with self._lock:
            lease = self.acquire(session_id, owner)
            try:
                return self._admit_new(lease.info.model, owner, lease.data.clone())
            finally:
                self.release(lease)

    def export(self, session_id: str, owner: str | None) -> tuple[SessionInfo, bytes]:
        """The committed state as safetensors bytes (metadata: model, tokens, version, ...; no owner)."""
        with self._lock:
            lease = self.acquire(session_id, owner)
            try:
                record = self.manager.get(session_id)
                meta = self._metadata(record)
                meta["owner"] = ""
                return lease.info, encode(lease.data, meta)
            finally:
                self.release(lease)

    def replace(self, session_id: str, owner: str | None, data: SessionData) -> SessionInfo:
        """Import into an existing session: its state becomes `data`, as one commit."""
        with self._lock:
            lease = self.acquire(session_id, owner)
            try:
                return self.commit(lease, data)
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
        if self.manager.plan_room(self.durable, record.nbytes) is None:
            raise self._full(self.durable, model, record.nbytes)
        self._write_durable(record, data, expected=None)
        record.copies = {self.durable}
        self.manager.add(record)
        self._put_tier(record, "device", data)
        self.manager.add_copy(record.id, "device")
        self._rebalance("device")
        self._publish()
        return _info(record)

    def _lookup(self, session_id: str, owner: str | None) -> Record:
        if not SESSION_ID.match(session_id):
            raise SessionNotFound(session_id)
        record = self.manager.get(session_id)
        if record is None and self.redis is not None:
            head = self._redis(lambda: self.redis.head(session_id))
            if head is not None:  # created by another replica
                version, meta = head
                record = self._record_from_meta(session_id, {**meta, "version": version}, {"redis"})
                self.manager.add(record)
        if record is None or record.owner != owner:  # another key's session does not exist for you
            raise SessionNotFound(session_id)
        return record

    def _sync_with_redis(self, record: Record) -> None:
        """With Redis: catch up with commits made by other replicas (or a delete)."""
        if self.redis is None:
            return
        head = self._redis(lambda: self.redis.head(record.id))
        if head is None:
            if not record.pinned:
                self._forget(record)
            raise SessionNotFound(record.id)
        version, meta = head
        if version != record.version:
            self._forget_local(record)
            self.manager.resize(record.id, int(meta["nbytes"]))
            record.version, record.tokens = version, int(meta["tokens"])
            record.last_used_at = float(meta.get("last_used_at", record.last_used_at))

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

    def _execute(self, moves: list[Move]) -> None:
        for move in moves:
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
        try:
            meta, tensors, next_log_probs = decode(blob)
            if meta.get("session_id") != record.id or int(meta.get("version", -1)) != record.version:
                raise CorruptState(f"{tier} holds session {meta.get('session_id')} version {meta.get('version')}, "
                                   f"expected version {record.version}")
            data = session_data(spec.state_class, meta, tensors, next_log_probs)
            spec.check_state(data.state)
        except (CorruptState, ValueError) as error:
            log.error("session %s: %s copy is unusable: %s", record.id, tier, error)
            raise SessionUnavailable(f"session '{record.id}': the stored state is unusable ({error})", record.id) from None
        return data.to(spec.device) if to_device else data

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

    def _write_durable(self, record: Record, data: SessionData, expected: int | None) -> None:
        blob = encode(data, self._metadata(record))
        if self.redis is None:
            self._wrap_io(lambda: self.disk.write(record.id, blob))
            return
        meta = {"model": record.model, "owner": record.owner, "tokens": record.tokens, "nbytes": record.nbytes,
                "created_at": record.created_at, "last_used_at": record.last_used_at}
        if not self._redis(lambda: self.redis.put(record.id, expected, record.version, meta, blob)):
            raise SessionConflict(record.id)

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
        }

    @staticmethod
    def _record_from_meta(session_id: str, meta: dict, copies: set[str]) -> Record:
        return Record(
            id=session_id, model=str(meta["model"]), owner=meta.get("owner") or None,
            nbytes=int(meta["nbytes"]), tokens=int(meta["tokens"]), version=int(meta["version"]),
            created_at=float(meta.get("created_at", 0)), last_used_at=float(meta.get("last_used_at", 0)),
            copies=set(copies),
        )

    def _full(self, tier: str, model: str, nbytes: int, session_id: str | None = None) -> CacheFull:
        if self.metrics is not None:
            self.metrics.session_refusals.labels(model, tier).inc()
        budget = self.manager.budgets[tier]
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

