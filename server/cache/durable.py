"""The durable store: the last tier, which holds every session's committed state (docs/design.md
section 6, "Persistence is write-through" and "A commit's answer is never wrong").

Without Redis it is the disk: one safetensors file per session (stores.py `DiskStore`: temporary
name, fsync, rename, directory fsync). With Redis it is Redis, shared by every replica and the
truth: writes are compare-and-set on the version the writer started from, so a replica holding a
stale version never overwrites a newer one (SessionConflict), and a write that gets no answer is
settled (`_settle`): Redis is asked whether it landed, and it is fenced if it has not, so that the
answer is final either way; only a Redis silent for the whole settle wait makes it
CommitOutcomeUnknown.

Commits that cost the new tokens: a model whose state grows or slides by appending (its State
class names the axes of its positions, models/interface.py `delta_axes`) has each commit written
as a delta block (codec.py `encode_delta`: the positions added, dropped or overwritten, checked bit
for bit) appended to the session's log, on disk (stores.py `DiskStore.append`: fsynced, framed,
checksummed) or in Redis (`RedisStore.append`: the same compare-and-set, fences and settle as a
whole write). Once the log holds more than `compact_ratio` times its base's bytes, the commit
says so (`Written.compaction_due`) and the session cache compacts the session after answering
(session_cache.py `compact`, under the session's hold: `compact` here writes the same version
whole, a new base with the log removed, compare-and-set on the version with Redis). A log may
grow to LOG_SLACK times that while its compaction waits (a session busy with one request after
another); a commit that would pass it is written whole instead, which compacts it then and there.
A read gets the base and the log and applies the blocks in order (codec.py `materialise`). `written` counts the writes
and bytes of each kind (delta, whole, compaction, fork), as does the metric
xlserve_session_commit_bytes_total{model,kind}.

Also here: the session's metadata as it is written (`metadata`) and read back (`record_from_meta`,
`decode`, which checks a stored state against its record and its model), Redis's view of a session
(`head`, `heads`), and the deleted sessions' tombstones.

Every method does I/O (or may): none is ever called under the session cache's lock. The caller
holds the session (leases.py) while its bytes are written or read, so nothing else of this replica
changes it meanwhile.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from xlserve.models.allocation import out_of_memory
from xlserve.server.cache.codec import (Blob, CorruptState, SessionData, blob_bytes, check_record_metadata,
                                        encode_parts, entries_from_lines, floating_dtypes, joined, materialise,
                                        session_data)
from xlserve.server.cache.errors import (
    CacheError,
    CacheFull,
    CommitOutcomeUnknown,
    SessionConflict,
    SessionInfo,
    SessionNotFound,
    SessionReadOutOfMemory,
    SessionUnavailable,
)
from xlserve.server.cache.ledger import IDEMPOTENCY_KEYS_PER_SESSION, TOMBSTONE_SECONDS, entry_line, kept
from xlserve.server.cache.manager import Record, commit_of
from xlserve.server.cache.state_directory import (LAST_TIER, REDIS_SPILL, StateDirectoryRefused, check_role,
                                                  directory_role, record_role)
from xlserve.server.cache.stores import (
    SESSION_ID,
    DiskStore,
    Head,
    RedisStore,
    StoreFull,
    StoreUnavailable,
    StoreWriteInDoubt,
)

log = logging.getLogger("xlserve.cache")

# A session's log is compacted once it holds more than this times its base (XLSERVE_COMPACT_RATIO;
# server/settings.py says the same). Over a cycle a commit then costs its block plus 1/n of a whole
# write, n being the commits the log takes to pass the ratio: at transfo-xl-wt103's shape with its
# memory full (a 20 MB block for 128 tokens, a 237 MB base) 18 commits and 33.1 MB a commit,
# 1.75x its new positions, where a ratio of 1 gave 12 commits and 39.7 MB (2.10x, over the 2x
# issue 36 allows); the price is a log of up to 1.5x its base on the last tier before its
# compaction (3x, LOG_SLACK times the ratio, while compactions wait) (`bench real-size`,
# docs/benchmarks.md).
DEFAULT_COMPACT_RATIO = 1.5

# How far past `compact_ratio` times its base a session's log may grow while its compaction waits
# in the background: past this a commit compacts in its own write, as every compaction did before
# they moved behind the answer.
LOG_SLACK = 2.0


@dataclass(frozen=True)
class Written:
    """What `DurableStore.write` wrote: its kind ("delta", "whole" or "compaction"), and whether
    the session's log has passed `compact_ratio` times its base with it, so that the session is
    to be compacted (`DurableStore.compact`) once the commit has been answered."""

    kind: str
    compaction_due: bool = False


def store_call(fn):
    """Run a store call; its failures become the cache's errors (both are 503s). A write whose
    bytes may have reached the files although it failed is a SessionUnavailable whose
    `stored_copy_in_doubt` is True (the commit path stops counting that copy: session_cache.py)."""
    try:
        return fn()
    except StoreFull as error:
        raise CacheFull(f"session storage is full: {error}") from None
    except StoreUnavailable as error:
        unavailable = SessionUnavailable(str(error))
        unavailable.stored_copy_in_doubt = isinstance(error, StoreWriteInDoubt)
        raise unavailable from None


class DurableStore:
    def __init__(self, disk: DiskStore, redis: RedisStore | None, models: dict[str, object], settle_s: float,
                 compact_ratio: float = DEFAULT_COMPACT_RATIO, metrics=None):
        """`models`: name -> LanguageModel (architecture, state_class, init_state, check_session), shared with
        the cache; `settle_s`: how long a Redis write without an answer is settled; `compact_ratio`:
        a session's log of delta blocks is compacted into a new base once it would hold more than
        this times the base's bytes (XLSERVE_COMPACT_RATIO)."""
        self.disk = disk
        self.redis = redis
        self.models = models
        self.settle_s = settle_s
        self.compact_ratio = compact_ratio
        self.metrics = metrics
        self.tier = "disk" if redis is None else "redis"
        # (writes, bytes) to the last tier by kind ("delta", "whole", "compaction", "fork"): what
        # a benchmark reads as the cost of a commit (also xlserve_session_commit_bytes_total{kind})
        self.written: dict[str, list[int]] = {}
        self._written_lock = threading.Lock()  # commits of different sessions count at once

    # -- start and stop -----------------------------------------------------------------------

    def open(self) -> list[tuple[str, dict]]:
        """The sessions already written down on disk, least recently used first (their
        headers; the checksum is verified when one is loaded). With Redis, Redis is pinged
        first: a server that cannot reach it does not start. The directory's role is checked and
        recorded (state_directory.py): without Redis a spill cache of Redis's is refused
        (StateDirectoryRefused); with Redis the sessions of a directory that was the last tier
        are moved to Redis first (`_move_to_redis`), since as a spill cache it would let them go."""
        check_role(self.disk.directory, with_redis=self.redis is not None)
        if self.redis is not None:
            self.redis.ping()
            self._check_eviction_policy()
        self.prune_tombstones()
        found = sorted(self.disk.scan(), key=lambda item: float(item[1].get("last_used_at", 0)))
        if self.redis is not None and directory_role(self.disk.directory) == LAST_TIER:
            # a file the scan could not read (an I/O error: it is left for a later start) would be
            # let go of as a spill of a session Redis does not hold: none may be left behind
            scanned = {session_id for session_id, _ in found}
            unread = [path.name for session_id, path in self.disk.files(DiskStore.SUFFIX) if session_id not in scanned]
            if unread:
                raise StateDirectoryRefused(
                    f"XLSERVE_STATE_DIR {self.disk.directory} holds sessions written without Redis, and {unread[0]} "
                    f"({len(unread)} in all) could not be read to move it to Redis; nothing was let go of: mend it "
                    "(the error is logged above) and start again")
            if found:
                self._move_to_redis(found)
            self._move_tombstones_to_redis()
        record_role(self.disk.directory, LAST_TIER if self.redis is None else REDIS_SPILL)
        return found

    def _move_to_redis(self, found: list[tuple[str, dict]]) -> None:
        """Write each session of a directory that was the last tier into Redis, as it is (its
        version, commit id and remembered Idempotency-Keys), compare-and-set on Redis holding no
        such session; its file stays, now a spill copy. A session Redis already holds at the same
        version and commit was moved by a start that stopped part way. Anything else (another
        session of that id in Redis, a Redis that refuses or does not answer, a file that does
        not read) stops the start with StateDirectoryRefused, the directory's role unchanged, so
        that nothing is let go of before it is in Redis; a start after the cause is mended goes on
        where this one stopped."""
        log.warning("XLSERVE_STATE_DIR %s holds %d sessions written without Redis: moving them to Redis at %s "
                    "before serving (with Redis the directory is a spill cache)", self.disk.directory, len(found),
                    self.redis._safe_url())
        moved = 0
        for session_id, meta in found:
            record = self.record_from_meta(session_id, meta, {"disk"})
            try:
                head = self.redis.head(session_id, remembered=True)
                if head is not None:
                    if head.version == record.version and commit_of(head.meta) == record.commit_id:
                        # moved by a start that stopped part way, perhaps before its keys went too
                        for entry in reversed(record.remembered):
                            if entry not in (head.remembered or []):
                                self.remember(session_id, record.version, entry, record.commit_id)
                        continue
                    raise StateDirectoryRefused(
                        f"XLSERVE_STATE_DIR {self.disk.directory} holds session {session_id} (version {record.version}), "
                        f"written without Redis, and Redis holds another session of that id (version {head.version}); "
                        "move the file out of the directory, or delete the one in Redis, then start again")
                data = self.read_disk(record)
                self.write(record, encode_parts(data, self.metadata(record)), expected=None)
                for entry in reversed(record.remembered):  # oldest first: Redis's list is newest first
                    self.remember(session_id, record.version, entry, record.commit_id)
            except CacheError as error:
                raise StateDirectoryRefused(
                    f"XLSERVE_STATE_DIR {self.disk.directory}: session {session_id}, written without Redis, could not "
                    f"be moved to Redis ({error}); nothing was let go of, and a start after the cause is mended goes "
                    f"on where this one stopped ({moved} of {len(found)} moved)") from None
            except StoreUnavailable as error:
                raise StateDirectoryRefused(
                    f"XLSERVE_STATE_DIR {self.disk.directory}: Redis did not answer while session {session_id} was "
                    f"moved to it ({error}); nothing was let go of ({moved} of {len(found)} moved)") from None
            moved += 1
        log.warning("moved %d sessions of XLSERVE_STATE_DIR %s to Redis", moved, self.disk.directory)

    def _move_tombstones_to_redis(self) -> None:
        """The tombstones of keyed deletes on the disk (TOMBSTONE_SECONDS young), into Redis, so a
        retried keyed delete is answered as the first was, not 404, after the switch: each of its
        remembered keys that Redis's tombstone lacks, oldest first. A session id Redis holds alive
        keeps Redis's (moving the tombstone would delete it). Redis not answering stops the start
        with StateDirectoryRefused, as a session's move does."""
        for session_id, _ in self.disk.files(DiskStore.TOMBSTONE_SUFFIX):
            stone = self.disk.read_tombstone(session_id, TOMBSTONE_SECONDS)
            if stone is None:
                continue
            owner, entries = stone
            try:
                if self.redis.head(session_id) is not None:
                    log.warning("session %s: a keyed delete's tombstone on disk is not moved to Redis, which holds "
                                "a session of that id", session_id)
                    continue
                held = (self.redis.tombstone(session_id) or (owner, []))[1]
                for entry in reversed(entries):  # oldest first: a tombstone's list is newest first
                    if entry not in held:
                        self.redis.delete(session_id, owner, entry, IDEMPOTENCY_KEYS_PER_SESSION)
            except StoreUnavailable as error:
                raise StateDirectoryRefused(
                    f"XLSERVE_STATE_DIR {self.disk.directory}: Redis did not answer while the tombstone of session "
                    f"{session_id} was moved to it ({error}); nothing was let go of") from None

    def _check_eviction_policy(self) -> None:
        """An error in the log when Redis may evict keys: under any maxmemory-policy but noeviction
        a full Redis drops committed sessions (allkeys-*) or the fences and tombstones that keep
        settled writes out and deletes remembered (volatile-*), where noeviction refuses the
        commit (503). The server still starts: the Redis may be shared on purpose."""
        try:
            policies = self.redis.eviction_policies()
        except StoreUnavailable as error:
            log.warning("Redis's maxmemory-policy could not be read (%s)", error)
            return
        if policies - {"noeviction"}:
            log.error("Redis at %s evicts keys when full (maxmemory-policy %s): committed sessions, or the fences and "
                      "tombstones that guard them, can vanish. Set maxmemory-policy noeviction for the sessions' Redis "
                      "(deploy/README.md); then a full Redis refuses commits with 503 instead",
                      self.redis._safe_url(), ", ".join(sorted(policies)))

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()

    # -- records and metadata ------------------------------------------------------------------

    def metadata(self, record: Record) -> dict[str, str]:
        """The metadata a session's blob carries (with its remembered Idempotency-Keys)."""
        spec = self.models.get(record.model)
        return {
            "session_id": record.id, "model": record.model,
            "architecture": getattr(spec, "architecture", "") if spec is not None else "",
            "owner": record.owner or "", "version": str(record.version),
            "created_at": repr(record.created_at), "last_used_at": repr(record.last_used_at),
        } | ({"idempotency": "\n".join(entry_line(entry) for entry in record.remembered)} if record.remembered else {}) \
          | ({"made_by": record.made_by} if record.made_by else {}) | ({"commit": record.commit_id} if record.commit_id else {})

    @staticmethod
    def record_from_meta(session_id: str, meta: dict, copies: set[str]) -> Record:
        return Record(
            id=session_id, model=str(meta["model"]), owner=meta.get("owner") or None,
            nbytes=int(meta["nbytes"]), tokens=int(meta["tokens"]), version=int(meta["version"]),
            created_at=float(meta.get("created_at", 0)), last_used_at=float(meta.get("last_used_at", 0)),
            copies=set(copies), remembered=entries_from_lines(meta.get("idempotency")),
            made_by=str(meta.get("made_by") or ""), commit_id=commit_of(meta),
        )

    @staticmethod
    def info_from_head(session_id: str, version: int, meta: dict, in_use: bool) -> SessionInfo:
        """A session as Redis describes it (one this replica holds no current copy of)."""
        return SessionInfo(
            id=session_id, model=str(meta["model"]), owner=meta.get("owner") or None, tokens=int(meta["tokens"]),
            version=version, state_bytes=int(meta["nbytes"]), tier="redis",
            created_at=float(meta.get("created_at", 0)), last_used_at=float(meta.get("last_used_at", 0)),
            in_use=in_use)

    def decode(self, record: Record, tier: str, blob: bytes, deltas: list[bytes] = ()) -> SessionData:
        """A stored blob (and the delta blocks of its log after it) back into the session's state,
        checked against the record and its model."""
        spec = self.spec(record)
        try:
            meta, tensors, next_log_probs = materialise(blob, list(deltas))
            if meta.get("session_id") != record.id or int(meta.get("version", -1)) != record.version:
                raise CorruptState(f"{tier} holds session {meta.get('session_id')} version {meta.get('version')}, "
                                   f"expected version {record.version}")
            if commit_of(meta) != record.commit_id:  # the same number, another state (manager.py)
                raise CorruptState(f"{tier} holds session {record.id} version {record.version} from commit "
                                   f"'{commit_of(meta)}', expected commit '{record.commit_id}'")
            data = session_data(spec.state_class, meta, tensors, next_log_probs)
            # the model's whole check, as an import gets it (finite, consistent, fits the token
            # count), on the state in the dtypes the model computes in: it is stored in the cache's
            # state dtype (a copy only where the two differ, dropped after the check)
            computed = data.cast_state(floating_dtypes(spec.init_state(1)))
            spec.check_session(computed.state, computed.tokens, computed.next_log_probs)
        except (CorruptState, ValueError, RuntimeError, MemoryError) as error:
            if out_of_memory(error):  # host RAM, or the device, for this read alone: the copy is fine
                log.warning("session %s: no memory to read its %s copy: %s", record.id, tier, error)
                raise SessionReadOutOfMemory(f"session '{record.id}': the server ran out of memory reading its "
                                             "state; retry shortly", record.id) from None
            if isinstance(error, (NotImplementedError, RecursionError)):  # a bug of the server's, not damage
                raise
            if isinstance(error, RuntimeError):  # torch on a tensor that is not what the record says
                error = CorruptState(str(error))
            log.error("session %s: %s copy is unusable: %s", record.id, tier, error)
            raise SessionUnavailable(f"session '{record.id}': the stored state is unusable ({error})", record.id) from None
        return data

    def spec(self, record: Record):
        """The served model of `record`'s session; SessionUnavailable when this server serves none."""
        spec = self.models.get(record.model)
        if spec is None:
            raise SessionUnavailable(f"session '{record.id}' belongs to model '{record.model}', "
                                     "which this server does not serve", record.id)
        return spec

    # -- reads ---------------------------------------------------------------------------------

    def head(self, session_id: str, remembered: bool = False) -> Head | None:
        """Redis's view of the session (with its remembered keys when asked), or None without
        Redis; Head(-1, ...) when Redis has no such session (deleted, perhaps by another replica)."""
        if self.redis is None:
            return None
        if not SESSION_ID.match(session_id):
            raise SessionNotFound(session_id)
        head = store_call(lambda: self.redis.head(session_id, remembered))
        if head is None:
            return Head(-1, {}, None)
        self._check_head(session_id, head.meta)
        return head

    def heads(self, unreadable: set[str] | None = None) -> dict[str, tuple[int, dict]] | None:
        """(version, meta) of every session Redis holds whose metadata reads (one that does not
        is left out, with a warning: it fails its own session, never the listing; its id is added
        to `unreadable` when given); None without Redis."""
        if self.redis is None:
            return None
        heads = store_call(lambda: self.redis.heads(unreadable))
        for session_id, (_, meta) in list(heads.items()):
            try:
                self._check_head(session_id, meta)
            except SessionUnavailable as error:
                log.warning("%s; left out of the listing", error)
                del heads[session_id]
                if unreadable is not None:
                    unreadable.add(session_id)
        return heads

    def _check_head(self, session_id: str, meta: dict) -> None:
        """SessionUnavailable, for this session alone, when the metadata Redis holds for it lacks a
        field the books are built from, or one does not read (written by something else)."""
        try:
            check_record_metadata(meta)
        except CorruptState as error:
            raise SessionUnavailable(f"Redis holds session {session_id} with unreadable metadata ({error})",
                                     session_id) from None

    def fetch(self, record: Record) -> SessionData:
        """The committed state from Redis, checked: SessionNotFound when Redis no longer has it,
        SessionConflict when another replica committed since `record` was read."""
        got = store_call(lambda: self.redis.get_chain(record.id))
        if got is None:
            raise SessionNotFound(record.id)
        if got[0] != record.version or commit_of(got[1]) != record.commit_id:  # another replica committed a moment ago
            raise SessionConflict(record.id)
        return self.decode(record, "redis", got[2], got[3])

    def read_disk(self, record: Record) -> SessionData:
        """The session's disk copy (its base file and log), checked."""
        try:
            base, deltas = self.disk.read_chain(record.id)
        except CorruptState as error:
            log.error("session %s: disk copy is unusable: %s", record.id, error)
            raise SessionUnavailable(f"session '{record.id}': the stored state is unusable ({error})", record.id) from None
        except OSError as error:  # gone or unreadable: this request fails, as a store that does not answer
            log.error("session %s: disk copy cannot be read: %s", record.id, error)
            raise SessionUnavailable(f"session '{record.id}': the stored state cannot be read ({error})",
                                     record.id) from None
        return self.decode(record, "disk", base, deltas)

    def deleted_place(self, session_id: str) -> tuple[str | None, float] | None:
        """With Redis, (owner, created_at) of a session some replica deleted lately (stores.py
        `deleted_place`); None without Redis or for any other."""
        if self.redis is None or not SESSION_ID.match(session_id):
            return None
        return store_call(lambda: self.redis.deleted_place(session_id))

    def tombstone(self, session_id: str) -> tuple[str | None, list[dict]] | None:
        """(owner, remembered keys) of a session deleted with an Idempotency-Key, or None."""
        if not SESSION_ID.match(session_id):
            return None
        if self.redis is not None:
            return store_call(lambda: self.redis.tombstone(session_id))
        return self.disk.read_tombstone(session_id, TOMBSTONE_SECONDS)

    def prune_tombstones(self) -> None:
        """Remove the disk's tombstones past TOMBSTONE_SECONDS (at start, and every
        SessionCache.forget_deleted_every_s: a keyed delete's file may hold 2 MiB of answers,
        outside the disk budget). Redis expires its own."""
        self.disk.prune_tombstones(TOMBSTONE_SECONDS)

    # -- writes --------------------------------------------------------------------------------

    def write(self, record: Record, blob: Blob | Callable[[], Blob], expected: int | None,
              entry: dict | None = None, delta: bytes | None = None, expected_commit: str = "") -> Written:
        """Write `record`'s state (`blob`, encoded with `metadata(record)` as bytes or in parts
        (codec.py `encode_parts`, joined only for Redis), or a function that encodes it, called
        only when a whole write is needed) to the last tier: the disk file (its
        metadata carries `record.remembered`), or Redis, compare-and-set on `expected` (None: a new
        session) and on `expected_commit`, the commit that made that version (manager.py
        `Record.commit_id`), with `entry` added to the remembered Idempotency-Keys. With `delta` (a block of
        codec.py `encode_delta` from the version `expected` to this one) only the block is
        appended to the session's log, unless the log would outgrow LOG_SLACK * `compact_ratio`
        times its base: then the session is written whole, which compacts it. Durable when this
        returns. A Redis write that gets no answer is settled (`_settle`). Returns the kind of
        write made and whether the session is due a compaction (`Written`). A store too full for
        it (Redis at its maxmemory, a full disk) is counted as a refusal of the last tier
        (xlserve_session_refusals_total), as the faster tiers' budgets are, and raises CacheFull."""
        try:
            return self._write(record, blob, expected, entry, delta, expected_commit)
        except CacheFull:
            if self.metrics is not None:
                self.metrics.session_refusals.labels(record.model, self.tier).inc()
            raise

    def _write(self, record: Record, blob: Blob | Callable[[], Blob], expected: int | None, entry: dict | None,
               delta: bytes | None, expected_commit: str) -> Written:
        whole = blob if callable(blob) else (lambda: blob)
        most = LOG_SLACK * self.compact_ratio
        if self.redis is None:
            if delta is not None:
                # the block changes the version the lease read (a commit's), or keeps it (`remember`)
                since = record.version if expected is None else expected
                appended = store_call(lambda: self.disk.append(record.id, delta, most, self.compact_ratio, since))
                if appended is not None:
                    written, due = appended
                    return Written(self._count(record, "delta", written), due)
            encoded = whole()
            store_call(lambda: self.disk.write(record.id, encoded))
            return Written(self._count(record, "whole" if delta is None else "compaction", blob_bytes(encoded)))
        meta = self._redis_meta(record)
        kind = "whole"
        written = None
        due = False
        if delta is not None and expected is not None:
            write_id = secrets.token_hex(8)
            try:
                written = self.redis.append(record.id, expected, record.version, meta, delta, most, self.compact_ratio,
                                            write_id, entry, IDEMPOTENCY_KEYS_PER_SESSION, expected_commit)
            except StoreFull as error:  # refused before anything was written
                raise CacheFull(f"session storage is full: {error}") from None
            except StoreUnavailable as error:  # perhaps written, perhaps not, perhaps later
                written = self._settle(record, write_id, error)
            kind = "delta"
            if written == 2:  # the log would outgrow its slack: written whole instead, nothing appended
                written, kind = None, "compaction"
            elif written == 3:  # appended, and the log is past compact_ratio times its base
                written, due = 1, True
        if written is None:
            encoded = joined(whole())
            write_id = secrets.token_hex(8)
            try:
                written = self.redis.put(record.id, expected, record.version, meta, encoded, write_id, entry,
                                         IDEMPOTENCY_KEYS_PER_SESSION, expected_commit)
            except StoreFull as error:  # refused before anything was written
                raise CacheFull(f"session storage is full: {error}") from None
            except StoreUnavailable as error:  # perhaps written, perhaps not, perhaps later
                written = self._settle(record, write_id, error)
            nbytes = len(encoded)
        else:
            nbytes = len(delta)
        if written == -1:  # cannot happen before a settle; as settled, it was not written
            raise SessionUnavailable(f"session '{record.id}': the write was refused as settled; nothing was "
                                     "written", record.id)
        if written != 1:
            raise SessionConflict(record.id)
        return Written(self._count(record, kind, nbytes), due)

    @staticmethod
    def _redis_meta(record: Record) -> dict:
        """The `meta` field a session's Redis hash carries (`head` and `record_from_meta` read it)."""
        return {"model": record.model, "owner": record.owner, "tokens": record.tokens, "nbytes": record.nbytes,
                "created_at": record.created_at, "last_used_at": record.last_used_at} \
            | ({"made_by": record.made_by} if record.made_by else {}) | ({"commit": record.commit_id} if record.commit_id else {})

    def compact(self, record: Record, blob: Callable[[], Blob]) -> str:
        """Write the session whole at its version (`blob()`, encoded from its committed state): a
        new base, its log of delta blocks gone. The caller holds the session. On disk this is a
        whole write (kill -9 leaves the old base and log, or the new base). With Redis it is
        compare-and-set on the version, written back unchanged, so that a replica that committed
        meanwhile is never overwritten and a late write is harmless (it can only land on the
        version it holds). Returns "compacted"; "moved_on" when another replica committed first;
        "failed" when Redis did not answer (whether it landed does not matter: both hashes hold
        this version). The state's bytes are the same either way: a compaction not made leaves a
        longer log, which a later commit asks to compact again."""
        if self.redis is None:
            encoded = blob()
            store_call(lambda: self.disk.write(record.id, encoded))
            self._count(record, "compaction", blob_bytes(encoded))
            return "compacted"
        meta = self._redis_meta(record)
        encoded = joined(blob())
        try:
            written = self.redis.put(record.id, record.version, record.version, meta, encoded, secrets.token_hex(8),
                                     expected_commit=record.commit_id)
        except StoreUnavailable as error:
            log.warning("session %s: compaction not written (%s); its log stays", record.id, error)
            return "failed"
        if written != 1:
            return "moved_on"
        self._count(record, "compaction", len(encoded))
        return "compacted"

    def disk_log_bytes(self, session_id: str) -> int:
        """Bytes of the session's log on disk, where the disk is the last tier (with Redis the
        disk holds whole spills only, no logs): `Record.disk_log_bytes`, which its budget counts."""
        return 0 if self.redis is not None else self.disk.log_bytes(session_id)

    def _count(self, record: Record, kind: str, nbytes: int) -> str:
        with self._written_lock:
            counts = self.written.setdefault(kind, [0, 0])
            counts[0] += 1
            counts[1] += nbytes
        if self.metrics is not None:
            self.metrics.session_commit_bytes.labels(record.model, kind).inc(nbytes)
            self.metrics.session_commit_writes.labels(record.model, kind).inc()
        return kind

    def fork(self, source_id: str, source_version: int, record: Record, blob: Callable[[], Blob],
             meta_block: bytes) -> Written:
        """Write the new session `record`, a fork of `source` at `source_version` (which the
        caller holds), to the last tier. On disk it shares the source's base file (a hard link)
        and copies the source's log, then `meta_block` (a delta block that changes only the
        metadata); with Redis, when the disk cannot link, or when the source's files are not at
        `source_version`, it is written whole (`blob()`): a Redis hash is one key, in one cluster
        slot, and another key's value cannot be shared."""
        if self.redis is None:
            try:
                nbytes = self.disk.fork(source_id, record.id, meta_block, source_version)
            except StoreUnavailable as error:
                log.warning("session %s: fork of %s written whole (%s)", record.id, source_id, error)
            else:
                return Written(self._count(record, "fork", nbytes))
        return self.write(record, blob, expected=None)

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

    def remember(self, session_id: str, version: int, entry: dict, commit_id: str = "") -> bool:
        """With Redis: add an Idempotency-Key entry to a session still at `version` from the commit
        `commit_id`, without a new version (False when it is not). Without Redis the caller
        rewrites the file with the entry in its metadata (`write`)."""
        return store_call(lambda: self.redis.remember(session_id, version, entry, IDEMPOTENCY_KEYS_PER_SESSION,
                                                      commit_id))

    def delete_unreadable(self, session_id: str, owner: str | None, entry: dict | None) -> bool:
        """Delete a session whose record in Redis does not read (`head` said SessionUnavailable)
        when its metadata still parses and names `owner`: such a session can never be served,
        and without this it would stay for good. False, doing nothing, when the record reads
        after all (the 503 had another cause), when its owner cannot be read, or is another's."""
        if self.redis is None or not SESSION_ID.match(session_id):
            return False
        meta = store_call(lambda: self.redis.raw_metadata(session_id))
        if meta is None or (meta.get("owner") or None) != owner:
            return False
        try:
            check_record_metadata(meta, ("model", "nbytes", "tokens", "version"))
            return False
        except CorruptState:
            pass
        store_call(lambda: self.redis.delete(session_id, owner, entry, IDEMPOTENCY_KEYS_PER_SESSION))
        log.warning("session %s: its record in Redis did not read; deleted by its owner", session_id)
        return True

    def delete(self, record: Record, entry: dict | None, head: Head | None = None) -> None:
        """Delete the session's durable copy. With `entry` (a delete's Idempotency-Key) leave a
        tombstone that remembers it with the session's keys for TOMBSTONE_SECONDS: in Redis, in
        the same script; on disk, a file written before the session's file goes (on a disk too
        full for it, after: a crash in between then leaves no tombstone, and the delete's retry
        gets 404 as after a delete without a key). With Redis only
        the version the deleting request saw (`head`, read for it) is deleted: SessionConflict,
        nothing deleted, when another replica committed since (a retry reads the new version)."""
        if self.redis is not None:
            holding = (record.version, record.commit_id) if head is None else (head.version, commit_of(head.meta))
            deleted = store_call(lambda: self.redis.delete(record.id, record.owner, entry, IDEMPOTENCY_KEYS_PER_SESSION,
                                                           created_at=record.created_at, holding=holding))
            if not deleted:
                raise SessionConflict(record.id)
            return
        remembered = None if entry is None else kept(entry, record.remembered)
        full = False
        if remembered is not None:
            try:
                store_call(lambda: self.disk.write_tombstone(record.id, record.owner, remembered))
            except CacheFull:  # a full disk: the session's own bytes go first, then its tombstone
                full = True
        try:
            self.disk.delete(record.id)
        except OSError as error:
            raise SessionUnavailable(f"session '{record.id}': its stored state could not be removed ({error})",
                                     record.id) from None
        if full:  # the delete stands; its key is remembered where the freed room allows it
            try:
                store_call(lambda: self.disk.write_tombstone(record.id, record.owner, remembered))
            except CacheError as error:
                log.warning("session %s: deleted on a full disk, and its Idempotency-Key could not be remembered "
                            "(%s): a retry of the delete gets 404", record.id, error)
