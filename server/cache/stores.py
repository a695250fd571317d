"""Stores move a session's bytes; they keep no bookkeeping (that is the manager's job).

- `MemoryStore(device)`: SessionData objects on one device (the model's device, or the host's
  RAM). A state is a value that requests replace rather than mutate, so storing is a reference.
- `DiskStore(directory)`: one safetensors file per session, `<id>.safetensors`, written to a
  temporary name in the same directory, fsynced, renamed over the old file, and the directory
  fsynced, so a crash at any point leaves either the old file or the new one. Stray temporary
  files are removed when the directory is opened. A session deleted with an Idempotency-Key
  leaves `<id>.deleted` (JSON: owner, remembered keys), removed when the directory is opened a
  day later.
  As the durable tier, a session whose model's state grows or slides by appending also has
  `<id>.log`: its commits since the base file, as delta blocks (codec.py `encode_delta`) appended
  and fsynced, each framed with the length, the base file's id (a hash of its checksum), its place
  in the chain after that base and a SHA-256 over the frame (`append`, `read_chain`). A block
  torn by a crash (never acknowledged) is cut off when the directory is opened; a block of
  another base (left by a crash between a compaction's rename and the log's removal) is ignored.
  A whole write (a compaction) renames the new base in, then removes the log. A fork's base is
  a hard link to its source's (`fork`), with a copy of the source's log blocks.
- `RedisStore(url)`: one hash per session, `xlserve:session:<id>` = {version, meta (JSON),
  blob (the same safetensors bytes), idempotency (the remembered Idempotency-Keys), writes (the
  ids of the latest writes), and for a session committed by deltas `log:1` .. `log:<logn>` (its
  delta blocks since `blob`), `logn`, `logbytes`}. Writes are compare-and-set on `version` in a
  Lua script, so a replica holding a stale version can never overwrite a newer one; a delta
  commit appends its block in the same script (`append`), a whole write clears the log, and a
  read takes the hash in one HGETALL (`get_chain`), so it never sees half a change. The URL may name one Redis,
  a Sentinel-managed master or a Redis Cluster (redis_client.py).

Redis Cluster: a script runs on one node, so every key it touches must hash to one slot. The only
key a session's scripts touch besides its hash is a write's fence, named
`{xlserve:session:<id>}:fence:<write id>`: its hash tag is the session's whole key, so it lands
in the session's slot (a key without braces hashes whole). Session keys are the same in every
deployment, so a single Redis's data can move into a cluster as it is. Nothing else here spans
keys: listing scans every primary (redis-py's scan_iter) and reads what it found in a pipeline
that is not a transaction, which a cluster client splits by node; the prefix store's pipelines are
the same kind.

Every Redis call is bounded by the store's timeout (socket, connect, and the wait for one of
the pool's connections), and nothing is retried blindly: redis-py's own retries are off, since a
write retried after a timeout may be a second write. Reads, which are safe to repeat, are retried
with backoff while the timeout lasts when a connection fails outright.

A write that timed out may still land (its command waits in a paused server's socket). So each
write carries a random write id, kept in the session's `writes`; `settle(id)` answers, atomically
on the server, whether that write landed, and if it has not, fences it (a `...fence:<write id>`
key kept for a day) so that it never will: after `settle` the outcome is final either way.

The Idempotency-Keys a session remembers are lines of JSON, newest first, at most a given number;
the write scripts add a line and drop the oldest on the server, within the same atomic write as
the state they belong to. A delete that carries a key leaves a tombstone (`deleted` = owner, and
the keys) that expires after a day, so that its retry can be answered.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy
import torch

from xlserve.server.cache.codec import (MAX_HEADER_BYTES, Blob, CorruptState, SessionData, blob_bytes, blob_parts,
                                        check_record_metadata, entries_from_lines, metadata_of, unlocked_buffer)
from xlserve.server.cache.ledger import REMEMBERED_BYTES_PER_SESSION, entry_line
from xlserve.server.cache.redis_client import connect
from xlserve.server.cache.state_directory import sync_directory
from xlserve.server.redis_urls import masked_url, parse_redis_url

log = logging.getLogger("xlserve.cache")

SESSION_ID = re.compile(r"^sess_[0-9a-f]{32}$")  # also what makes an id safe as a file name


# Tests of kill -9 (tests/server/test_cache_deltas.py) stop a process at a chosen point of a log
# write or a compaction: XLSERVE_TEST_CRASH_AT names the point, and the process kills itself
# there (SIGKILL, as `kill -9` would), after writing part of the frame at "log-write-torn".
_CRASH_AT = os.environ.get("XLSERVE_TEST_CRASH_AT", "")


def _crash_point(point: str, frame: bytes = b"", f=None) -> None:
    if not _CRASH_AT or not _CRASH_AT.startswith(point):
        return
    if _CRASH_AT == point + "-torn" and f is not None:
        f.write(frame[: len(frame) // 2])
        f.flush()
    elif _CRASH_AT != point:
        return
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


class StoreUnavailable(RuntimeError):
    """A store cannot be reached or written (Redis down, disk error)."""


class StoreFull(StoreUnavailable):
    """A store refused a write for lack of space (disk full, Redis at maxmemory)."""


class StoreWriteInDoubt(StoreUnavailable):
    """A disk write failed after its bytes may have reached the session's files (the rename
    landed but the directory sync failed; an append's block could not be cut off again): the
    files may hold the version the caller is told failed."""


class MemoryStore:
    def __init__(self, device: torch.device | str | None = None):
        self.device = None if device is None else torch.device(device)
        self._data: dict[str, SessionData] = {}

    def put(self, session_id: str, data: SessionData, device: torch.device | None = None) -> None:
        target = device or self.device
        self._data[session_id] = data if target is None else data.to(target)

    def get(self, session_id: str) -> SessionData:
        return self._data[session_id]

    def drop(self, session_id: str) -> None:
        self._data.pop(session_id, None)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._data


class DiskStore:
    SUFFIX = ".safetensors"
    TOMBSTONE_SUFFIX = ".deleted"

    LOG_SUFFIX = ".log"
    # a log block's frame: magic, the delta blob's length, the base's id, the block's place after
    # that base (from 1); then the blob, then a SHA-256 over all of it
    FRAME = struct.Struct("<4sQ32sQ")
    BLOCK_MAGIC = b"xlsD"
    DIGEST_BYTES = 32

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stray in self.directory.glob(".*.tmp"):  # a write that a crash interrupted
            stray.unlink(missing_ok=True)
        for log in self.directory.glob("sess_*" + self.LOG_SUFFIX):  # a fork that a crash interrupted
            if not log.with_suffix(self.SUFFIX).exists():
                log.unlink(missing_ok=True)
        # bytes written to the disk since this store was made, by kind ("whole", "delta", "fork"):
        # what a benchmark reads as the cost of a commit
        self.bytes_written: dict[str, int] = {}
        self._count_lock = threading.Lock()

    def path(self, session_id: str) -> Path:
        if not SESSION_ID.match(session_id):
            raise ValueError(f"not a session id: {session_id!r}")
        return self.directory / (session_id + self.SUFFIX)

    def write(self, session_id: str, blob: Blob) -> None:
        """A whole write: the blob (bytes, or its parts: codec.py `encode_parts`) becomes the
        session's base, and its log (the deltas on the old base, which no longer apply) goes. A
        crash between the two leaves a log whose blocks name the old base: they are ignored."""
        self._write_file(self.path(session_id), session_id, blob)
        self._count("whole", blob_bytes(blob))
        _crash_point("compaction-renamed")
        try:
            self.log_path(session_id).unlink(missing_ok=True)
        except OSError as error:  # the write is done: blocks that name the old base are never read
            log.warning("session %s: its old log could not be removed (%s); its blocks are ignored", session_id, error)

    def _count(self, kind: str, nbytes: int) -> None:
        with self._count_lock:  # sessions are written from several threads at once
            self.bytes_written[kind] = self.bytes_written.get(kind, 0) + nbytes

    def _write_file(self, final: Path, session_id: str, blob: Blob) -> None:
        temporary = self.directory / f".{session_id}.{secrets.token_hex(4)}.tmp"
        renamed = False
        try:
            with open(temporary, "wb") as f:
                for part in blob_parts(blob):
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            _crash_point("compaction-temp")
            os.replace(temporary, final)
            renamed = True
            self._sync_directory()
        except OSError as error:
            if renamed:
                raise StoreWriteInDoubt(f"session state written to {final}, but its directory could not be synced "
                                        f"({error})") from error
            temporary.unlink(missing_ok=True)
            kind = StoreFull if error.errno in (errno.ENOSPC, errno.EDQUOT) else StoreUnavailable
            raise kind(f"cannot write session state to {final}: {error}") from error

    def read(self, session_id: str) -> bytes:
        return self.path(session_id).read_bytes()

    def delete(self, session_id: str) -> None:
        """Remove the session's base and log, the removal synced to the directory (a deleted
        session must not come back after a power loss); OSError when they cannot be removed
        (callers that sweep leave the file for later, a client's delete answers 503: durable.py
        `delete`)."""
        self.path(session_id).unlink(missing_ok=True)
        self.log_path(session_id).unlink(missing_ok=True)
        self._sync_directory()

    # -- the log of delta blocks ----------------------------------------------------------------

    def log_bytes(self, session_id: str) -> int:
        """Bytes of the session's log of delta blocks (0 without one): what the disk holds of it
        beside its base. 0 when it cannot be read either: the books never fail a write."""
        try:
            return self.log_path(session_id).stat().st_size
        except OSError:
            return 0

    def log_path(self, session_id: str) -> Path:
        return self.path(session_id).with_suffix(self.LOG_SUFFIX)

    @staticmethod
    def _base_id(meta: dict[str, str]) -> bytes:
        return hashlib.sha256(meta.get("checksum", "").encode()).digest()

    def _read_head(self, path: Path) -> dict[str, str]:
        """A safetensors file's metadata, from its header only."""
        with open(path, "rb") as f:
            return self._head_at(f, 0)

    @staticmethod
    def _head_at(f, offset: int) -> dict[str, str]:
        """The metadata of the safetensors blob at `offset` of an open file, from its header only
        (its 8-byte length, then at most MAX_HEADER_BYTES of header)."""
        f.seek(offset)
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        return metadata_of(head + f.read(min(length, MAX_HEADER_BYTES)))

    def _frames(self, f, size: int) -> tuple[list[tuple[int, int, bytes, int]], int]:
        """(offset, blob length, base id, place) of each whole frame of an open log, from the
        frames' headers only, and where the last whole frame ends (short of `size`: a torn tail)."""
        frames, offset = [], 0
        while offset + self.FRAME.size <= size:
            f.seek(offset)
            magic, length, base, place = self.FRAME.unpack(f.read(self.FRAME.size))
            end = offset + self.FRAME.size + length + self.DIGEST_BYTES
            if magic != self.BLOCK_MAGIC or end > size:
                break
            frames.append((offset, length, base, place))
            offset = end
        if offset < size:
            self._check_tail(lambda at, n: (f.seek(at), f.read(n))[1], size, offset)
        return frames, offset

    def _check_tail(self, read: Callable[[int, int], bytes], size: int, offset: int) -> None:
        """CorruptState when the log's bytes from `offset` on (where no whole frame starts) hold
        a frame that passes its checksum: an append writes at the end and is acknowledged once
        synced, so the one thing a crash can leave unfinished is the last frame, and a damaged
        frame with a verified one after it is damage to acknowledged blocks, which must not be
        cut off as a torn tail (the session would silently go back to an older version). `read(at,
        n)` gives n bytes of the log from `at`. Reads the rest of the log only when it is
        damaged."""
        tail = read(offset, size - offset)
        start = 1
        while (found := tail.find(self.BLOCK_MAGIC, start)) >= 0:
            start = found + 1
            end = self._frame_end(tail, found)
            if end is not None and self._digest_matches(tail, found, end):
                raise CorruptState(f"the log block at byte {offset} is damaged, and a whole block follows it "
                                   f"at byte {offset + found}")

    def _frame_end(self, data: bytes, offset: int) -> int | None:
        """Where the frame whose header starts at `offset` of `data` ends; None when no frame
        header is there or the frame runs past the end of `data`."""
        if offset + self.FRAME.size > len(data):
            return None
        magic, length, _, _ = self.FRAME.unpack_from(data, offset)
        end = offset + self.FRAME.size + length + self.DIGEST_BYTES
        return end if magic == self.BLOCK_MAGIC and end <= len(data) else None

    def _digest_matches(self, data: bytes, offset: int, end: int) -> bool:
        """Whether the frame data[offset:end] passes its SHA-256 (read in place: a slice of bytes
        is a copy, made holding Python's interpreter lock)."""
        view = memoryview(data)
        return hashlib.sha256(view[offset : end - self.DIGEST_BYTES]).digest() == view[end - self.DIGEST_BYTES : end]

    @classmethod
    def framed_bytes(cls, nbytes: int) -> int:
        """Bytes a blob of `nbytes` takes in a log: its frame's header, itself, its digest."""
        return cls.FRAME.size + nbytes + cls.DIGEST_BYTES

    def _frame(self, base: bytes, place: int, blob: bytes) -> bytes:
        frame = self.FRAME.pack(self.BLOCK_MAGIC, len(blob), base, place) + blob
        return frame + hashlib.sha256(frame).digest()

    @staticmethod
    def _chain(frames: list, base: bytes) -> list:
        """The frames that follow `base`, in order; CorruptState when their places skip."""
        chain = [frame for frame in frames if frame[2] == base]
        for expected, frame in enumerate(chain, start=1):
            if frame[3] != expected:
                raise CorruptState(f"log block {frame[3]} where block {expected} was expected")
        return chain

    def append(self, session_id: str, blob: bytes, ratio: float, due_ratio: float,
               version: int) -> tuple[int, bool] | None:
        """Append a delta block, the change from the session's `version`, after its base and log,
        fsynced before this returns; the bytes written, and whether the log is now past
        `due_ratio` times the base (a compaction is due, as `RedisStore.append` answers 3). None,
        writing nothing, when there is no base to append to, when the log would outgrow `ratio`
        times the base, when the stored session is not at `version` (a write that landed though
        it was reported failed: a rename whose directory sync failed, a block whose sync failed
        and could not be cut off), or when the log is damaged: the caller writes the session whole
        instead, which replaces base and log. A torn tail (a crash in an earlier append, never
        acknowledged) is cut off first. The caller holds the session: nothing else writes its
        files meanwhile."""
        base_path, log_path = self.path(session_id), self.log_path(session_id)
        try:
            base_meta = self._read_head(base_path)
            base = self._base_id(base_meta)
            base_size = base_path.stat().st_size
        except (OSError, CorruptState):
            return None
        created = not log_path.exists()
        size = None
        try:
            with open(log_path, "ab+") as f:
                size = f.seek(0, os.SEEK_END)
                try:
                    frames, end = self._frames(f, size)
                    chain = self._chain(frames, base)
                    last = self._block_meta(f, chain[-1]) if chain else base_meta
                except CorruptState as error:
                    log.warning("session %s: its log is damaged (%s); written whole instead", session_id, error)
                    return None
                if last.get("version") != str(version):
                    log.warning("session %s: stored at version %s, not %d as this change expects; written whole "
                                "instead", session_id, last.get("version"), version)
                    return None
                if end < size:
                    log.warning("session %s: a torn log block (%d bytes) is cut off", session_id, size - end)
                    f.truncate(end)
                    size = end
                frame = self._frame(base, len(chain) + 1, blob)
                if size + len(frame) > ratio * base_size:
                    return None
                _crash_point("log-write", frame, f)
                f.write(frame)
                f.flush()
                os.fsync(f.fileno())
                _crash_point("log-synced")
            if created:
                self._sync_directory()
        except OSError as error:
            if size is not None:
                try:
                    os.truncate(log_path, size)  # no half block stays behind a failed append
                except OSError:  # the block may stay, whole: the log may hold the failed version
                    raise StoreWriteInDoubt(f"cannot append to the session log {log_path} ({error}), nor cut the "
                                            "block off again") from error
            kind = StoreFull if error.errno in (errno.ENOSPC, errno.EDQUOT) else StoreUnavailable
            raise kind(f"cannot append to the session log {log_path}: {error}") from error
        self._count("delta", len(frame))
        return len(frame), size + len(frame) > due_ratio * base_size

    def _read_log(self, session_id: str, base: bytes) -> tuple[list[memoryview], list[memoryview]]:
        """(the delta blobs that follow `base`, in order; every verified frame's raw bytes that
        follow it), each a view of the log read once: at real size a log holds up to
        XLSERVE_COMPACT_RATIO times a 237 MB state, and slicing it into blobs and frames copied it
        twice more, holding Python's interpreter lock (every stream's decode step waited up to
        88 ms). A last frame that is torn or fails its checksum was never acknowledged and is
        left out; one that fails with frames after it is CorruptState."""
        try:
            data = self.log_path(session_id).read_bytes()
        except FileNotFoundError:
            return [], []
        frames, offset = [], 0
        while (end := self._frame_end(data, offset)) is not None:
            if not self._digest_matches(data, offset, end):
                if end < len(data):
                    raise CorruptState(f"log block at byte {offset} fails its checksum")
                break
            _, length, frame_base, place = self.FRAME.unpack_from(data, offset)
            frames.append((offset, length, frame_base, place, end))
            offset = end
        if offset < len(data):
            self._check_tail(lambda at, n: data[at : at + n], len(data), offset)
        chain, view = self._chain(frames, base), memoryview(data)
        blobs = [view[o + self.FRAME.size : o + self.FRAME.size + n] for o, n, _, _, _ in chain]
        raw = [view[o:e] for o, _, _, _, e in chain]
        return blobs, raw

    def read_chain(self, session_id: str) -> tuple[bytes, list[memoryview]]:
        """The session's base blob and the delta blobs that follow it (codec.py `materialise`)."""
        base = self.read(session_id)
        try:
            base_id = self._base_id(metadata_of(base))
        except CorruptState:
            return base, []  # decoding the base says what is wrong with it
        return base, self._read_log(session_id, base_id)[0]

    def fork(self, source_id: str, session_id: str, blob: bytes, version: int) -> int:
        """A new session `session_id` from `source_id`'s base and log: its base a hard link to the
        source's (a later whole write of either renames a new file over its own name and leaves
        the other's alone), its log a copy of the source's blocks and then `blob`, the delta block
        that gives it its own metadata. Bytes written. The log is in place before the base, so a
        crash in between leaves a log without a base, removed when the directory is opened.
        StoreUnavailable, nothing written, when the source is not stored at `version` (the
        version the caller holds): a write answered as failed may have landed all the same (a
        rename whose directory sync failed), and a fork must not share it."""
        base_path, log_path = self.path(source_id), self.log_path(session_id)
        temporary = self.directory / f".{session_id}.{secrets.token_hex(4)}.tmp"
        try:
            base_meta = self._read_head(base_path)
            base = self._base_id(base_meta)
            blobs, raw = self._read_log(source_id, base)
            stored = metadata_of(blobs[-1]).get("version") if blobs else base_meta.get("version")
            if stored != str(version):
                raise StoreUnavailable(f"session {source_id} is stored at version {stored}, not {version}")
            # the source's frames written from the log read once, as views: joining them and the
            # new frame copied the log twice, holding the interpreter lock (197 ms at real size)
            body = [*raw, self._frame(base, len(raw) + 1, blob)]
            with open(temporary, "wb") as f:
                for part in body:
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, log_path)
            _crash_point("fork-log")
            os.link(base_path, self.path(session_id))
            self._sync_directory()
        except (OSError, CorruptState) as error:
            temporary.unlink(missing_ok=True)
            log_path.unlink(missing_ok=True)
            kind = StoreFull if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) else StoreUnavailable
            raise kind(f"cannot fork session {source_id} on disk: {error}") from error
        written = sum(len(part) for part in body)
        self._count("fork", written)
        return written

    def _scan_log(self, session_id: str, meta: dict[str, str]) -> dict[str, str]:
        """On open: cut off a torn or unverifiable last block, and return the metadata of the
        session's last block (its base's when it has none)."""
        path = self.log_path(session_id)
        if not path.exists():
            return meta
        base = self._base_id(meta)
        with open(path, "rb+") as f:
            while True:
                size = f.seek(0, os.SEEK_END)
                frames, end = self._frames(f, size)
                if frames and end == size:  # the last whole frame: a crash may have left it unwritten
                    offset, length, _, _ = frames[-1]
                    f.seek(offset)
                    body = f.read(self.FRAME.size + length)
                    if hashlib.sha256(body).digest() != f.read(self.DIGEST_BYTES):
                        end = offset
                if end == size:
                    break
                log.warning("session %s: a torn log block (%d bytes) is cut off", session_id, size - end)
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
            chain = self._chain(frames, base)
            return self._block_meta(f, chain[-1]) if chain else meta

    def _block_meta(self, f, frame: tuple[int, int, bytes, int]) -> dict[str, str]:
        """The session's metadata as a log block (a frame of `_frames`) of the open log records
        it, from the block's safetensors header only (not the whole block: an append reads it)."""
        block_meta = self._head_at(f, frame[0] + self.FRAME.size)
        return {k: v for k, v in block_meta.items() if k not in ("delta", "next_log_probs")}

    def exists(self, session_id: str) -> bool:
        return self.path(session_id).is_file()

    # A deleted session's tombstone: its owner and remembered Idempotency-Keys, so that a delete
    # retried with its key gets the first answer. JSON, removed by `prune_tombstones`.

    def tombstone_path(self, session_id: str) -> Path:
        return self.path(session_id).with_suffix(self.TOMBSTONE_SUFFIX)

    def write_tombstone(self, session_id: str, owner: str | None, remembered: list[dict]) -> None:
        body = json.dumps({"owner": owner, "idempotency": remembered, "deleted_at": time.time()})
        self._write_file(self.tombstone_path(session_id), session_id, body.encode())

    def read_tombstone(self, session_id: str, lifetime_s: float | None = None) -> tuple[str | None, list[dict]] | None:
        """(owner, remembered keys) of a tombstone; None when there is none, it is unreadable, or
        it is older than `lifetime_s` (a server that runs for days prunes only now and then)."""
        try:
            body = json.loads(self.tombstone_path(session_id).read_text())
            if lifetime_s is not None and time.time() - float(body.get("deleted_at", 0)) > lifetime_s:
                return None
            return body.get("owner"), list(body.get("idempotency") or [])
        except (OSError, ValueError, TypeError, AttributeError):  # none, or unreadable: as good as none
            return None

    def prune_tombstones(self, older_than_s: float) -> None:
        cutoff = time.time() - older_than_s
        for path in self.directory.glob("sess_*" + self.TOMBSTONE_SUFFIX):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
            except OSError:
                pass

    def _sync_directory(self) -> None:
        sync_directory(self.directory)

    def files(self, suffix: str) -> list[tuple[str, Path]]:
        """(session id, path) of every file of one kind in the directory (SUFFIX: sessions,
        TOMBSTONE_SUFFIX: keyed deletes' tombstones), in order; a name that holds no session id
        is none of them."""
        named = ((path.name[: -len(suffix)], path) for path in sorted(self.directory.glob("sess_*" + suffix)))
        return [(session_id, path) for session_id, path in named if SESSION_ID.match(session_id)]

    def scan(self) -> Iterator[tuple[str, dict[str, str]]]:
        """(session id, metadata) of every session file, read from headers only. A file whose
        contents do not read (CorruptState) is renamed to *.corrupt, its log with it, and skipped,
        with a warning. One the system could not read (an I/O error, too many open files, no
        permission: nothing says its contents are bad) is left where it is and skipped, with an
        error: a later start may read it. A rename that fails skips the file too; neither stops
        the start, whose other sessions are served."""
        for session_id, path in self.files(self.SUFFIX):
            try:
                meta = self._scan_log(session_id, self._read_head(path))
                if meta.get("session_id") != session_id:
                    raise CorruptState(f"file holds session {meta.get('session_id')!r}")
                check_record_metadata(meta, ("model", "nbytes", "tokens", "version"))
            except CorruptState as error:
                self._move_aside(session_id, path, error)
                continue
            except OSError as error:
                log.error("session file %s could not be read (%s); left where it is and not served until a start "
                          "reads it", path, error)
                continue
            yield session_id, meta

    def _move_aside(self, session_id: str, path: Path, error: Exception) -> None:
        """Rename a session file whose contents do not read, and its log, to *.corrupt (kept for
        a person to look at); a rename that fails leaves them where they are."""
        log.warning("session file %s is unreadable (%s); moved aside as .corrupt", path, error)
        log_path = self.log_path(session_id)  # kept beside it: a log without its base is removed on open
        try:
            path.rename(path.with_suffix(".corrupt"))
        except OSError as rename_error:
            log.error("session file %s could not be moved aside (%s); it and its log are left where they are",
                      path, rename_error)
            return
        try:
            if log_path.exists():
                log_path.rename(log_path.with_name(log_path.name + ".corrupt"))
        except OSError as rename_error:  # a log without its base is removed at the next start
            log.error("the log %s of a session file moved aside could not be moved with it (%s); the next start "
                      "removes it", log_path, rename_error)


# Lua shared by the scripts: `list` (lines, newest first) with `item` in front, at most `limit`
# lines and, when `max_bytes` is given, at most that many bytes of lines but the first (the
# remembered Idempotency-Keys: ledger.py `kept`, which keeps the same ones without Redis).
_PREPEND = "local REMEMBERED_BYTES = " + str(REMEMBERED_BYTES_PER_SESSION) + """
local function prepend(list, item, limit, max_bytes)
  local out, total = {item}, string.len(item)
  if list then
    for line in string.gmatch(list, '[^\\n]+') do
      if #out >= limit then break end
      if max_bytes and total + string.len(line) > max_bytes then break end
      total = total + string.len(line)
      out[#out + 1] = line
    end
  end
  return table.concat(out, '\\n')
end
-- the commit id in a session's `meta` ('' when it has none, or none that reads: manager.py commit_of)
local function commit_of(meta)
  if not meta then return '' end
  local ok, parsed = pcall(cjson.decode, meta)
  if ok and type(parsed) == 'table' and type(parsed['commit']) == 'string' then return parsed['commit'] end
  return ''
end
-- whether the session's hash holds version `version` made by commit `commit`
local function holds(key, version, commit)
  local stored = redis.call('HMGET', key, 'version', 'meta')
  return stored[1] == version and commit_of(stored[2]) == commit
end
"""

# KEYS: the session's hash, this write's fence. ARGV: the version expected ('' = none: a new
# session), the new version, meta, blob, the write id, an Idempotency-Key entry ('' = none), how
# many keys and write ids to keep, the commit that made the version expected (manager.py
# `Record.commit_id`). Returns 1 written, 0 another writer got there first (or the version
# expected is another state's: a session made anew under the same id), -1 this write was settled
# as not written (fenced) before it arrived.
_CAS_SCRIPT = _PREPEND + """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
if ARGV[1] == '' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end  -- a session, or a delete's tombstone
elseif not holds(KEYS[1], ARGV[1], ARGV[9]) then
  return 0
end
local fields = {'version', ARGV[2], 'meta', ARGV[3], 'blob', ARGV[4],
                'writes', prepend(redis.call('HGET', KEYS[1], 'writes'), ARGV[5], tonumber(ARGV[8]))}
if ARGV[6] ~= '' then
  fields[#fields + 1] = 'idempotency'
  fields[#fields + 1] = prepend(redis.call('HGET', KEYS[1], 'idempotency'), ARGV[6], tonumber(ARGV[7]), REMEMBERED_BYTES)
end
local blocks = tonumber(redis.call('HGET', KEYS[1], 'logn') or '0')
for i = 1, blocks do redis.call('HDEL', KEYS[1], 'log:' .. i) end
if blocks > 0 then redis.call('HDEL', KEYS[1], 'logn', 'logbytes') end
redis.call('HSET', KEYS[1], unpack(fields))
return 1
"""

# A delta commit: the block appended to the session's log (`log:<n>`, `logn` blocks, `logbytes`
# in all), version, meta, writes and remembered keys as the CAS script sets them, in one atomic
# step. KEYS and ARGV[1..8] as the CAS script's (ARGV[4] the block; the expected version is never
# ''), ARGV[9]: the ratio of log bytes to the base's past which the log is compacted instead,
# ARGV[10]: the ratio past which a compaction is due, ARGV[11]: the commit that made the version
# expected (a block appended to another state would corrupt it). Returns 1, 0 and -1 as the CAS script; 2 when
# the block would outgrow the base (nothing written: the caller writes the session whole, with the
# CAS script, which clears the log); 3 when written and the log is past ARGV[10] times the base.
_APPEND_SCRIPT = _PREPEND + """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
if not holds(KEYS[1], ARGV[1], ARGV[11]) then return 0 end
local logbytes = tonumber(redis.call('HGET', KEYS[1], 'logbytes') or '0') + string.len(ARGV[4])
local base = redis.call('HSTRLEN', KEYS[1], 'blob')
if logbytes > tonumber(ARGV[9]) * base then return 2 end
local blocks = tonumber(redis.call('HGET', KEYS[1], 'logn') or '0') + 1
local fields = {'version', ARGV[2], 'meta', ARGV[3], 'log:' .. blocks, ARGV[4], 'logn', tostring(blocks),
                'logbytes', tostring(logbytes),
                'writes', prepend(redis.call('HGET', KEYS[1], 'writes'), ARGV[5], tonumber(ARGV[8]))}
if ARGV[6] ~= '' then
  fields[#fields + 1] = 'idempotency'
  fields[#fields + 1] = prepend(redis.call('HGET', KEYS[1], 'idempotency'), ARGV[6], tonumber(ARGV[7]), REMEMBERED_BYTES)
end
redis.call('HSET', KEYS[1], unpack(fields))
if logbytes > tonumber(ARGV[10]) * base then return 3 end
return 1
"""

# KEYS: the session's hash, the write's fence. ARGV: the write id, the fence's lifetime (s).
# 1: the write landed. 0: it did not, and now never will.
_SETTLE_SCRIPT = """
local writes = redis.call('HGET', KEYS[1], 'writes')
if writes and string.find('\\n' .. writes .. '\\n', '\\n' .. ARGV[1] .. '\\n', 1, true) then return 1 end
redis.call('SET', KEYS[2], '1', 'EX', tonumber(ARGV[2]))
return 0
"""

# Remember an Idempotency-Key without a new version (a fork remembers its key on its source).
# KEYS: the session's hash. ARGV: the version expected, the entry, how many keys to keep, the
# commit that made the version expected.
_REMEMBER_SCRIPT = _PREPEND + """
if not holds(KEYS[1], ARGV[1], ARGV[4]) then return 0 end
redis.call('HSET', KEYS[1], 'idempotency', prepend(redis.call('HGET', KEYS[1], 'idempotency'), ARGV[2], tonumber(ARGV[3]), REMEMBERED_BYTES))
return 1
"""

# Delete a session, leaving a tombstone with its keys and this delete's when given one. KEYS: the
# session's hash. ARGV: the owner ('' = none), the entry ('' = none: no tombstone), how many keys to
# keep, the tombstone's lifetime (s), and, unless ARGV[5] is '', the version and commit the
# deleting replica read (ARGV[5], ARGV[6]): a session that holds another version (a commit that
# landed after that read, acknowledged to its client) is not deleted, whenever this script
# arrives (a delete whose answer was lost cannot land on a later commit); one already gone (no
# hash, or another delete's tombstone) keeps that tombstone's keys, this delete's entry added.
# Returns 1 deleted (or already gone), 0 it holds another version: nothing changed.
_TOMBSTONE_SCRIPT = _PREPEND + """
if ARGV[5] ~= '' then
  if redis.call('HEXISTS', KEYS[1], 'version') == 0 then
    if ARGV[2] == '' then return 1 end
    redis.call('HSET', KEYS[1], 'deleted', ARGV[1], 'idempotency',
               prepend(redis.call('HGET', KEYS[1], 'idempotency'), ARGV[2], tonumber(ARGV[3]), REMEMBERED_BYTES))
    redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
    return 1
  end
  if not holds(KEYS[1], ARGV[5], ARGV[6]) then return 0 end
end
local remembered = redis.call('HGET', KEYS[1], 'idempotency')
redis.call('DEL', KEYS[1])
if ARGV[2] == '' then return 1 end
redis.call('HSET', KEYS[1], 'deleted', ARGV[1], 'idempotency', prepend(remembered, ARGV[2], tonumber(ARGV[3]), REMEMBERED_BYTES))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
return 1
"""

# File a prefix entry under its block's slot n, returning the entry filed there before ('' = none).
# KEYS: the block's hash. ARGV: n, the entry's key, the TTL (s).
_PREFIX_SWAP_SCRIPT = """
local replaced = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return replaced or ''
"""

_SCRIPTS = {"cas": _CAS_SCRIPT, "append": _APPEND_SCRIPT, "settle": _SETTLE_SCRIPT, "remember": _REMEMBER_SCRIPT, "tombstone": _TOMBSTONE_SCRIPT,
            "prefix_swap": _PREFIX_SWAP_SCRIPT}


class Head(NamedTuple):
    """What Redis holds of a session, without its state: its version, metadata, (when asked
    for) its remembered Idempotency-Keys, newest first, and the bytes of its log of delta blocks."""

    version: int
    meta: dict
    remembered: list[dict] | None
    log_bytes: int = 0


class RedisStore:
    """Committed sessions shared by every replica. Values are never written without a version
    check: `put(expected=v)` succeeds only while Redis still holds version v.

    `timeout_s` bounds each call (connecting, waiting for a pooled connection, each reply);
    `max_connections` bounds the pool (each node's, in a cluster), shared by the threads that
    call the store at once. The client is made on first use (redis_client.connect)."""

    WRITES_KEPT = 16  # write ids a session keeps, for `settle` (more than can land within one settle wait)
    FENCE_SECONDS = 24 * 3600  # how long a fenced write stays refused (a paused server may hold it that long)
    TOMBSTONE_SECONDS = 24 * 3600  # how long a delete's Idempotency-Key is remembered
    DELETED_PLACE_SECONDS = 3600  # how long a deleted session's place in its owner's listing is remembered

    # a value past SLOW_SEND_BYTES is sent on a client whose timeout is the store's plus the value's
    # bytes at SLOWEST_SEND_BYTES_PER_S (`_client_for`): a socket's timeout bounds a whole sendall,
    # so with the store's 5 s alone a 237 MB wt103 state needed 47 MB/s to Redis, and below it
    # every whole write failed, a healthy Redis reported as not answering
    SLOW_SEND_BYTES = 1 << 20
    SLOWEST_SEND_BYTES_PER_S = 16 << 20

    def __init__(self, url: str, prefix: str = "xlserve:session:", timeout_s: float = 5.0, max_connections: int = 64):
        try:
            import redis
        except ImportError:  # pragma: no cover - an install without the client
            raise RuntimeError("XLSERVE_REDIS_URL is set but the 'redis' package is not installed") from None
        if "{" in prefix or "}" in prefix:  # the fence keys' hash tag is the session's key (see above)
            raise ValueError(f"a Redis key prefix without braces, please: {prefix!r}")
        parse_redis_url(url)  # a URL that names no Redis deployment: ValueError now, not at first use
        self._exceptions = redis.exceptions
        self.url = url
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._client = None
        self._client_lock = threading.Lock()
        self._slow_clients: dict[float, object] = {}  # send timeout -> a client of its own (`_client_for`)
        self._slow_closes: list[Callable[[], None]] = []

    @property
    def client(self):
        """The redis-py client (made on first use: a cluster client reads the slot map when made)."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    # no retries inside the client: a write retried after a timeout could land twice
                    client, self._close = connect(self.url, self.timeout_s, self.max_connections)
                    self._client = client
        return self._client

    def _client_for(self, nbytes: int):
        """The client to send a value of `nbytes` on: the store's own, or past SLOW_SEND_BYTES one
        whose timeout also gives the value SLOWEST_SEND_BYTES_PER_S, rounded up to a power of two
        of seconds (a few such clients at most, each made on first use)."""
        if nbytes <= self.SLOW_SEND_BYTES:
            return self.client
        timeout = 2.0 ** math.ceil(math.log2(self.timeout_s + nbytes / self.SLOWEST_SEND_BYTES_PER_S))
        client = self._slow_clients.get(timeout)
        if client is None:
            with self._client_lock:
                client = self._slow_clients.get(timeout)
                if client is None:
                    client, close = connect(self.url, timeout, self.max_connections)
                    self._slow_clients[timeout] = client
                    self._slow_closes.append(close)
        return client

    def _script(self, name: str, keys: list[str], args: list, nbytes: int = 0):
        """Run one of the Lua scripts (its keys all in one cluster slot), sent with its source
        (EVAL, at most 1.2 kB), on the client for a value of `nbytes` (`_client_for`). Called by
        its hash (EVALSHA), a script the server does not know (a fresh server, a restart, a
        failover) is refused, and redis-py sends the call again after loading it, arguments
        included: here a session's whole blob or delta block (at transfo-xl-wt103's shape 237 or
        20 MB) would be sent twice."""
        return self._client_for(nbytes).eval(_SCRIPTS[name], len(keys), *keys, *args)

    def _key(self, session_id: str) -> str:
        return self.prefix + session_id

    def _fence_key(self, session_id: str, write_id: str) -> str:
        """A write's fence: in the session's cluster slot (its hash tag is the session's key)."""
        return "{" + self._key(session_id) + "}:fence:" + write_id

    def _call(self, fn: Callable, *args):
        try:
            return fn(*args)
        except self._exceptions.ResponseError as error:
            if str(error).startswith("OOM") or "maxmemory" in str(error):  # full, under the noeviction policy
                raise StoreFull(f"Redis at {self._safe_url()} is full: {error}") from error
            raise StoreUnavailable(f"Redis at {self._safe_url()} refused a command: {error}") from error
        except self._exceptions.RedisError as error:
            raise StoreUnavailable(f"Redis at {self._safe_url()} is unreachable: {error}") from error
        except self._exceptions.RedisClusterException as error:  # no node reachable, slots not covered
            raise StoreUnavailable(f"Redis Cluster at {self._safe_url()} is unavailable: {error}") from error

    def _read(self, fn: Callable, *args):
        """A call that is safe to repeat: retried with backoff (20 ms, doubling, at most 0.5 s)
        while the store's timeout lasts, when a connection fails (a timed-out attempt has used
        the time up, so it is not repeated)."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.02
        while True:
            try:
                return self._call(fn, *args)
            except StoreFull:
                raise
            except StoreUnavailable:
                if time.monotonic() + delay >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _safe_url(self) -> str:
        return masked_url(self.url)  # never print a password

    def ping(self) -> None:
        self._read(lambda: self.client.ping())

    def _info_memory(self) -> list[dict]:
        """INFO memory of each node: one for a server, each primary of a cluster (INFO goes to one
        node unless asked for all)."""

        def read():
            if hasattr(self.client, "get_primaries"):  # a cluster client
                return self.client.info("memory", target_nodes=self.client.PRIMARIES)
            return self.client.info("memory")

        info = self._read(read)
        return [info] if "used_memory" in info else [v for v in info.values() if isinstance(v, dict)]

    def eviction_policies(self) -> set[str]:
        """The maxmemory-policy of each node that has a maxmemory (one without never evicts), as
        INFO reports it (CONFIG may be disabled)."""
        return {str(node.get("maxmemory_policy", "")) for node in self._info_memory()
                if int(node.get("maxmemory", 0) or 0) > 0} - {""}

    def _version_and_meta(self, session_id: str, version, meta) -> tuple[int, dict]:
        """A record's version and metadata as Redis holds them; StoreUnavailable, for this session
        alone, when something other than xlserve wrote them and they do not read."""
        try:
            parsed = json.loads(meta)
            if not isinstance(parsed, dict):
                raise ValueError("the metadata is not an object")
            return int(version), parsed
        except (ValueError, TypeError) as error:
            raise StoreUnavailable(f"Redis at {self._safe_url()} holds session {session_id} with an unreadable "
                                   f"version or metadata ({error})") from None

    def head(self, session_id: str, remembered: bool = False) -> Head | None:
        """Version and metadata without the state (and the remembered keys when asked), or None
        when Redis has no such session."""
        fields = ["version", "meta", "logbytes"] + (["idempotency"] if remembered else [])
        values = self._read(lambda: self.client.hmget(self._key(session_id), *fields))
        if values[0] is None:
            return None
        version, meta = self._version_and_meta(session_id, values[0], values[1])
        try:
            log_bytes = int(values[2] or 0)
        except ValueError:  # written by something else: a compaction, if one is asked for, rewrites it
            log_bytes = 1
        return Head(version, meta, self._entries(session_id, values[3]) if remembered else None, log_bytes)

    def raw_metadata(self, session_id: str) -> dict | None:
        """The metadata Redis holds for a session as it parses, unchecked, with the record's
        version as written (a string) under "version"; None when there is no record or its
        metadata is not a JSON object: for deleting a record that does not read."""
        version, meta = self._read(lambda: self.client.hmget(self._key(session_id), "version", "meta"))
        if version is None or meta is None:
            return None
        try:
            parsed = json.loads(meta)
        except ValueError:
            return None
        if not isinstance(parsed, dict):
            return None
        return {**parsed, "version": version.decode(errors="replace") if isinstance(version, bytes) else str(version)}

    def get(self, session_id: str) -> tuple[int, dict, bytes] | None:
        version, meta, blob = self._read(lambda: self.client.hmget(self._key(session_id), "version", "meta", "blob"))
        if version is None:
            return None
        return *self._version_and_meta(session_id, version, meta), blob

    def get_chain(self, session_id: str) -> tuple[int, dict, bytes, list[bytes]] | None:
        """(version, meta, base blob, the log's delta blocks in order), read in one atomic
        command; None when Redis has no such session."""
        fields = self._read(lambda: self.client.hgetall(self._key(session_id)))
        fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in (fields or {}).items()}
        if fields.get("version") is None or fields.get("blob") is None:
            return None
        blocks = [fields.get(f"log:{i}") for i in range(1, int(fields.get("logn") or 0) + 1)]
        if any(block is None for block in blocks):
            raise StoreUnavailable(f"Redis at {self._safe_url()} holds session {session_id} with a log block missing")
        return *self._version_and_meta(session_id, fields["version"], fields.get("meta")), fields["blob"], blocks

    def heads(self, unreadable: set[str] | None = None) -> dict[str, tuple[int, dict]]:
        """(version, meta) of every session Redis holds (tombstones and fences left out; one whose
        record does not read is left out too, its id added to `unreadable` when given). In a
        cluster, scan_iter walks every primary; the pipeline is split by node."""

        def scan() -> dict[str, tuple[int, dict]]:
            keys = list(self.client.scan_iter(match=self.prefix + "sess_*", count=1000))
            found = {}
            for start in range(0, len(keys), 500):
                pipeline = self.client.pipeline(transaction=False)
                for key in keys[start : start + 500]:
                    pipeline.hmget(key, "version", "meta")
                for key, (version, meta) in zip(keys[start : start + 500], pipeline.execute()):
                    session_id = (key.decode() if isinstance(key, bytes) else key)[len(self.prefix):]
                    if version is not None and SESSION_ID.match(session_id):
                        try:  # one record that does not read must not hide every other from the listing
                            found[session_id] = self._version_and_meta(session_id, version, meta)
                        except StoreUnavailable as error:
                            log.warning("%s; left out of the listing", error)
                            if unreadable is not None:
                                unreadable.add(session_id)
            return found

        return self._read(scan)

    def put(self, session_id: str, expected: int | None, version: int, meta: dict, blob: bytes,
            write_id: str = "", entry: dict | None = None, keys_kept: int = 32, expected_commit: str = "") -> int:
        """Store `blob` as `version` if Redis holds `expected` (None: holds nothing) made by the
        commit `expected_commit`, with `entry` added to the remembered Idempotency-Keys. Returns 1 when written, 0 (changing
        nothing) when another writer got there first, -1 when this write id was fenced by
        `settle`. A StoreUnavailable leaves the outcome open: ask `settle(write_id)`."""
        write_id = write_id or secrets.token_hex(8)
        args = ["" if expected is None else str(expected), str(version), json.dumps(meta), blob, write_id,
                "" if entry is None else entry_line(entry), str(keys_kept), str(self.WRITES_KEPT), expected_commit]
        keys = [self._key(session_id), self._fence_key(session_id, write_id)]  # one slot
        return int(self._call(lambda: self._script("cas", keys, args, len(blob))))

    def append(self, session_id: str, expected: int, version: int, meta: dict, block: bytes, ratio: float,
               due_ratio: float, write_id: str = "", entry: dict | None = None, keys_kept: int = 32,
               expected_commit: str = "") -> int:
        """Append a delta block as `version` if Redis holds `expected` made by `expected_commit`
        (the state the block was computed from): 1, 0 and -1 as `put`; 2
        (nothing written) when the log would pass `ratio` times the base: write it whole with
        `put` (a compaction); 3 when written and the log is now past `due_ratio` times the base (a
        compaction is due: `put` of the same version, compare-and-set on it)."""
        write_id = write_id or secrets.token_hex(8)
        args = [str(expected), str(version), json.dumps(meta), block, write_id,
                "" if entry is None else entry_line(entry), str(keys_kept), str(self.WRITES_KEPT), repr(float(ratio)),
                repr(float(due_ratio)), expected_commit]
        keys = [self._key(session_id), self._fence_key(session_id, write_id)]  # one slot
        return int(self._call(lambda: self._script("append", keys, args, len(block))))

    def settle(self, session_id: str, write_id: str) -> bool:
        """Whether the write `write_id` landed; when it has not, it never will (it is fenced).
        Safe to repeat."""
        keys = [self._key(session_id), self._fence_key(session_id, write_id)]  # one slot
        return bool(self._read(lambda: self._script("settle", keys, [write_id, str(self.FENCE_SECONDS)])))

    def remember(self, session_id: str, version: int, entry: dict, keys_kept: int = 32, commit: str = "") -> bool:
        """Add an Idempotency-Key entry to a session still at `version` from `commit` (False when
        it is not)."""
        args = [str(version), entry_line(entry), str(keys_kept), commit]
        return bool(self._call(lambda: self._script("remember", [self._key(session_id)], args)))

    def delete(self, session_id: str, owner: str | None = None, entry: dict | None = None,
               keys_kept: int = 32, created_at: float | None = None, holding: tuple[int, str] | None = None) -> bool:
        """Delete a session; with `entry` (a delete's Idempotency-Key) leave a tombstone that
        remembers its keys for TOMBSTONE_SECONDS. With `created_at`, its place in its owner's
        listing is remembered first, for DELETED_PLACE_SECONDS (`deleted_place`). With `holding`
        (version, commit id) only that version is deleted: False, changing nothing, when Redis
        holds another (the script refuses it whenever it arrives, so a delete whose answer was
        lost never removes a commit made after it). True when deleted, or already gone."""
        if created_at is not None:  # a help to a listing, not part of the delete: it fails alone
            place = json.dumps({"owner": owner or "", "created_at": created_at})
            try:
                self._call(lambda: self.client.set(self._deleted_key(session_id), place, ex=self.DELETED_PLACE_SECONDS))
            except StoreUnavailable as error:
                log.warning("session %s: its place in its owner's listing was not remembered (%s)", session_id, error)
        args = [owner or "", "" if entry is None else entry_line(entry), str(keys_kept), str(self.TOMBSTONE_SECONDS),
                "" if holding is None else str(holding[0]), "" if holding is None else holding[1]]
        return bool(self._call(lambda: self._script("tombstone", [self._key(session_id)], args)))

    def deleted_place(self, session_id: str) -> tuple[str | None, float] | None:
        """(owner, created_at) of a session any replica deleted within DELETED_PLACE_SECONDS: a
        listing page that ends with it goes on from its place (session_cache.py `list_sessions`).
        None for any other, or a place that does not read."""
        text = self._read(lambda: self.client.get(self._deleted_key(session_id)))
        try:
            place = json.loads(text)
            return place["owner"] or None, float(place["created_at"])
        except (TypeError, ValueError, KeyError):
            return None

    def _deleted_key(self, session_id: str) -> str:
        """Outside what `heads` scans (prefix + "sess_*"); its own slot in a cluster (written apart
        from the session's scripts)."""
        return self.prefix + "deleted:" + session_id

    def tombstone(self, session_id: str) -> tuple[str | None, list[dict]] | None:
        """(owner, remembered keys) of a session deleted with a key, or None."""
        owner, remembered = self._read(lambda: self.client.hmget(self._key(session_id), "deleted", "idempotency"))
        if owner is None:
            return None
        return (owner.decode() if isinstance(owner, bytes) else owner) or None, self._entries(session_id, remembered)

    def _entries(self, session_id: str, text) -> list[dict]:
        """A record's remembered Idempotency-Keys; StoreUnavailable, for this session alone,
        when they do not read (written by something else)."""
        try:
            return entries_from_lines(text)
        except CorruptState as error:
            raise StoreUnavailable(f"Redis at {self._safe_url()} holds session {session_id} with {error}") from None

    def close(self) -> None:
        if self._client is not None:
            self._close()
        for close in self._slow_closes:
            close()


class RedisPrefixStore(RedisStore):
    """Prefix-cache entries shared by every replica (server/cache/prefix_cache.py): a string per
    entry, `xlserve:prefix:entry:<key>` = the entry's safetensors bytes, and a hash per block of
    the hash chain, `xlserve:prefix:block:<h_k>` = {n: entry key}, both expiring `ttl_s` after
    they were last written or read (Redis holds a cache here, not the truth: an entry that
    expired or was evicted by Redis's maxmemory policy is a miss, never an error). Keys are
    hashes of (scope, tokens): nothing in them names a tenant or a text. Each command touches one
    key and the pipelines are not transactions, so in a Redis Cluster entries and blocks simply
    spread over the slots (an entry or a block missing its other half, should a node fail in
    between, is a miss like an expired one)."""

    def __init__(self, url: str, prefix: str = "xlserve:prefix:", timeout_s: float = 5.0, ttl_s: int = 24 * 3600,
                 max_connections: int = 16):
        super().__init__(url, prefix=prefix, timeout_s=timeout_s, max_connections=max_connections)
        self.ttl_s = max(1, int(ttl_s))

    def put_entry(self, block: str, n: int, key: str, blob: bytes) -> None:
        """File the entry `key` (hex) for n tokens under block `block` (hex), both with the TTL.
        The entry the block filed for n before (another prompt's, the same up to this block) is
        deleted: unreachable, it would hold its bytes until its TTL."""

        def write():
            # the entry first, whole; then the block's slot swapped in one script, which returns the
            # entry it replaced. Two replicas filing (block, n) at once each delete what their own
            # swap replaced, so whichever swaps last is filed and the other deleted: read in the same
            # pipeline as the SET, the slot was read before a large entry had arrived, and the entry
            # filed in between was left unreachable for its whole TTL
            # only where none is: an entry's key names its prefix, so one there already is the same
            # state, and a reader slicing it (`get_entry`) must not see it change under it
            self._client_for(len(blob)).set(self.prefix + "entry:" + key, blob, ex=self.ttl_s, nx=True)
            replaced = self._script("prefix_swap", [self.prefix + "block:" + block], [str(n), key, str(self.ttl_s)])
            replaced = replaced.decode() if isinstance(replaced, bytes) else replaced
            if replaced and replaced != key:
                self.client.delete(self.prefix + "entry:" + replaced)

        self._call(write)

    def drop_entry(self, key: str, block: str, n: int) -> None:
        """Remove an entry that was refused, and its place in its block while it still names it."""

        def drop():
            self.client.delete(self.prefix + "entry:" + key)
            filed = self.client.hget(self.prefix + "block:" + block, str(n))
            if (filed.decode() if isinstance(filed, bytes) else filed) == key:
                self.client.hdel(self.prefix + "block:" + block, str(n))

        self._call(drop)

    def touch_entry(self, key: str, block: str) -> None:
        """A use: the entry's TTL renewed, and that of the block it was filed under, without
        which a prefix read every minute would still become unreachable a day after it was
        written."""

        def touch():
            pipeline = self.client.pipeline(transaction=False)
            pipeline.expire(self.prefix + "entry:" + key, self.ttl_s)
            pipeline.expire(self.prefix + "block:" + block, self.ttl_s)
            pipeline.execute()

        self._call(touch)

    def memory(self) -> list[tuple[int, int]]:
        """(used_memory, maxmemory) of each node as Redis reports them: one for a server, each
        primary of a cluster (INFO goes to one node unless asked for all); maxmemory 0: none set."""

        return [(int(node.get("used_memory", 0)), int(node.get("maxmemory", 0))) for node in self._info_memory()]

    def filed(self, blocks: list[str]) -> list[dict[int, str]]:
        """For each block (hex), its {n: entry key}: one round trip for the whole chain."""

        def read():
            pipeline = self.client.pipeline(transaction=False)
            for block in blocks:
                pipeline.hgetall(self.prefix + "block:" + block)
            return pipeline.execute()

        found = []
        for mapping in self._read(read):
            entries = {}
            for n, key in (mapping or {}).items():
                n, key = (v.decode() if isinstance(v, bytes) else v for v in (n, key))
                if n.isdigit():
                    entries[int(n)] = key
            found.append(entries)
        return found

    # an entry past this is read in slices of it (`get_entry`)
    ENTRY_SLICE_BYTES = 8 << 20

    def get_entry(self, key: str) -> bytes | memoryview | None:
        """The entry's bytes, or None when Redis no longer holds it. Its TTL is not renewed here:
        only a use of an entry that proved good renews it (`touch_entry`), so a damaged one
        expires, if its reader does not remove it first. An entry past ENTRY_SLICE_BYTES is read
        in slices of it into one buffer: redis-py's reader copies a reply three times holding
        Python's interpreter lock, 250 ms at once for a 236 MB entry, while every stream of the
        engine process waited. An entry replaced or gone between two slices reads short (None), or
        torn, which its checksum refuses as any damaged entry."""
        name = self.prefix + "entry:" + key

        def read():
            size = int(self.client.strlen(name))
            if size <= self.ENTRY_SLICE_BYTES:
                return self.client.get(name)
            buffer = unlocked_buffer(size)
            for start in range(0, size, self.ENTRY_SLICE_BYTES):
                part = self.client.getrange(name, start, min(size, start + self.ENTRY_SLICE_BYTES) - 1)
                if len(part) != min(size, start + self.ENTRY_SLICE_BYTES) - start:
                    return None
                buffer[start : start + len(part)] = numpy.frombuffer(part, numpy.uint8)
            return memoryview(buffer).toreadonly()

        return self._read(read)
