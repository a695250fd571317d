"""Stores move a session's bytes; they keep no bookkeeping (that is the manager's job).

- `MemoryStore(device)`: SessionData objects on one device (the model's device, or the host's
  RAM). A state is a value that requests replace rather than mutate, so storing is a reference.
- `DiskStore(directory)`: one safetensors file per session, `<id>.safetensors`, written to a
  temporary name in the same directory, fsynced, renamed over the old file, and the directory
  fsynced, so a crash at any point leaves either the old file or the new one. Stray temporary
  files are removed when the directory is opened.
- `RedisStore(url)`: one hash per session, `xlserve:session:<id>` = {version, meta (JSON),
  blob (the same safetensors bytes)}. Writes are compare-and-set on `version` in a Lua script,
  so a replica holding a stale version can never overwrite a newer one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import torch

from xlserve.server.cache.codec import CorruptState, SessionData, metadata_of, parse_header

log = logging.getLogger("xlserve.cache")

SESSION_ID = re.compile(r"^sess_[0-9a-f]{32}$")  # also what makes an id safe as a file name


class StoreUnavailable(RuntimeError):
    """A store cannot be reached or written (Redis down, disk error)."""


class StoreFull(StoreUnavailable):
    """A store refused a write for lack of space (disk full, Redis at maxmemory)."""


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

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stray in self.directory.glob(".*.tmp"):  # a write that a crash interrupted
            stray.unlink(missing_ok=True)

    def path(self, session_id: str) -> Path:
        if not SESSION_ID.match(session_id):
            raise ValueError(f"not a session id: {session_id!r}")
        return self.directory / (session_id + self.SUFFIX)

    def write(self, session_id: str, blob: bytes) -> None:
        final = self.path(session_id)
        temporary = self.directory / f".{session_id}.{secrets.token_hex(4)}.tmp"
        try:
            with open(temporary, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, final)
            self._sync_directory()
        except OSError as error:
            temporary.unlink(missing_ok=True)
            kind = StoreFull if error.errno in (errno.ENOSPC, errno.EDQUOT) else StoreUnavailable
            raise kind(f"cannot write session state to {final}: {error}") from error

    def read(self, session_id: str) -> bytes:
        return self.path(session_id).read_bytes()

    def delete(self, session_id: str) -> None:
        self.path(session_id).unlink(missing_ok=True)

    def exists(self, session_id: str) -> bool:
        return self.path(session_id).is_file()

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def scan(self) -> Iterator[tuple[str, dict[str, str]]]:
        """(session id, metadata) of every session file, read from headers only. A file whose
        header is unreadable is renamed to *.corrupt and skipped, with a warning."""
        for path in sorted(self.directory.glob("sess_*" + self.SUFFIX)):
            session_id = path.name[: -len(self.SUFFIX)]
            if not SESSION_ID.match(session_id):
                continue
            try:
                with open(path, "rb") as f:
                    head = f.read(8)
                    length = int.from_bytes(head, "little") if len(head) == 8 else 0
                    head += f.read(min(length, 64 << 20))
                parse_header(head)
                meta = metadata_of(head)
                if meta.get("session_id") != session_id:
                    raise CorruptState(f"file holds session {meta.get('session_id')!r}")
            except (OSError, CorruptState) as error:
                log.warning("session file %s is unreadable (%s); moved aside as .corrupt", path, error)
                path.rename(path.with_suffix(".corrupt"))
                continue
            yield session_id, meta


_CAS_SCRIPT = """
local current = redis.call('HGET', KEYS[1], 'version')
if ARGV[1] == '' then
  if current then return 0 end
elseif current ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'meta', ARGV[3], 'blob', ARGV[4])
return 1
"""


class RedisStore:
    """Committed sessions shared by every replica. Values are never written without a version
    check: `put(expected=v)` succeeds only while Redis still holds version v."""

    def __init__(self, url: str, prefix: str = "xlserve:session:", timeout_s: float = 5.0):
        try:
            import redis
        except ImportError:  # pragma: no cover - an install without the client
            raise RuntimeError("XLSERVE_REDIS_URL is set but the 'redis' package is not installed") from None
        self._exceptions = redis.exceptions
        self.url = url
        self.prefix = prefix
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._cas = self.client.register_script(_CAS_SCRIPT)

    def _key(self, session_id: str) -> str:
        return self.prefix + session_id

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except self._exceptions.ResponseError as error:
            if str(error).startswith("OOM") or "maxmemory" in str(error):  # full, under the noeviction policy
                raise StoreFull(f"Redis at {self._safe_url()} is full: {error}") from error
            raise StoreUnavailable(f"Redis at {self._safe_url()} refused a command: {error}") from error
        except self._exceptions.RedisError as error:
            raise StoreUnavailable(f"Redis at {self._safe_url()} is unreachable: {error}") from error

    def _safe_url(self) -> str:
        return re.sub(r"//[^@/]*@", "//***@", self.url)  # never print a password

    def ping(self) -> None:
        self._call(self.client.ping)

    def head(self, session_id: str) -> tuple[int, dict] | None:
        """(version, meta) without the blob, or None when Redis has no such session."""
        version, meta = self._call(self.client.hmget, self._key(session_id), "version", "meta")
        if version is None:
            return None
        return int(version), json.loads(meta)

    def get(self, session_id: str) -> tuple[int, dict, bytes] | None:
        version, meta, blob = self._call(self.client.hmget, self._key(session_id), "version", "meta", "blob")
        if version is None:
            return None
        return int(version), json.loads(meta), blob

    def put(self, session_id: str, expected: int | None, version: int, meta: dict, blob: bytes) -> bool:
        """Store `blob` as `version` if Redis holds `expected` (None: holds nothing). Returns
        False, changing nothing, when another writer got there first."""
        args = ["" if expected is None else str(expected), str(version), json.dumps(meta), blob]
        return bool(self._call(lambda: self._cas(keys=[self._key(session_id)], args=args)))

    def delete(self, session_id: str) -> None:
        self._call(self.client.delete, self._key(session_id))

    def close(self) -> None:
        self.client.close()
