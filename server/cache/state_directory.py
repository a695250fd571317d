"""The state directory held by one server at a time (`hold_state_directory`). Torch-free: the
CLI checks the directory before the port opens, in the API process, which never imports torch;
the engine process takes it for good when it starts (server/engine/process.py)."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO


class StateDirectoryRefused(RuntimeError):
    """Another server holds the state directory, or it cannot be written."""


def hold_state_directory(directory: str | Path) -> IO[str]:
    """Take the state directory for this process (`<directory>/.lock`, flock'ed; the open file is
    the hold, which the kernel ends when the process ends, however it ends). Two servers on one
    directory would each delete the other's writes in flight when they start (stray temporary
    files, logs without a base, the prefix cache's files) and overwrite each other's sessions
    without a version check: without Redis, a server reads the files only at start. Refused
    with StateDirectoryRefused naming the holder and the setting; a directory that cannot be
    written is refused too, at start rather than at the first commit."""
    directory = Path(directory).absolute()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = open(directory / ".lock", "a+")
    except OSError as error:
        raise StateDirectoryRefused(f"XLSERVE_STATE_DIR {directory} cannot be written: {error}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise StateDirectoryRefused(
            f"XLSERVE_STATE_DIR {directory} is in use by another xlserve server ({holder}); give each replica "
            "its own state directory, and share sessions between them through XLSERVE_REDIS_URL") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}, child of pid {os.getppid()}, on {socket.gethostname()}\n")
    handle.flush()
    return handle


# -- what the directory's session files are ----------------------------------------------------
#
# Without Redis the directory's files are the sessions' only durable copy (the last tier); with
# Redis they are a spill cache of what Redis holds, let go of at will. The same files read
# differently in the two roles, so the directory records the role it was last written in: a server
# that starts with Redis over a directory of last-tier sessions moves them to Redis first (a spill
# cache would let them go, and with them the only copy: session_cache.py `open`), and one that
# starts without Redis over a spill cache is refused, since its files may be older than Redis's
# versions and would become the truth. A directory written before the role was recorded is read in
# the role of the server that opens it.

ROLE_FILE = ".role"
LAST_TIER, REDIS_SPILL = "last-tier", "redis-spill"


def directory_role(directory: str | Path) -> str | None:
    """The role the directory's session files were last written in (LAST_TIER or REDIS_SPILL),
    or None when it records none (new, or written before roles were recorded).
    StateDirectoryRefused when the role file is there but cannot be read or names no role: taken
    as no role, a damaged file would let a last-tier directory's sessions go, or make a spill
    cache's files the truth."""
    path = Path(directory) / ROLE_FILE
    try:
        role = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise StateDirectoryRefused(f"{path} cannot be read ({error}); it says whether the directory's sessions are "
                                    "their only copy: mend or remove it (a directory without it is read in the role "
                                    "of the server that opens it)") from None
    if role not in (LAST_TIER, REDIS_SPILL):
        raise StateDirectoryRefused(f"{path} names no role ({role[:40]!r}, not {LAST_TIER!r} or {REDIS_SPILL!r}); it "
                                    "says whether the directory's sessions are their only copy: mend or remove it")
    return role


def record_role(directory: str | Path, role: str) -> None:
    """Record the directory's role, durably (a temporary file renamed over it, then the directory
    synced): a crash leaves the old role or the new one."""
    directory = Path(directory)
    if directory_role(directory) == role:  # (a damaged role file is refused there, never overwritten)
        return
    temporary = directory / f"{ROLE_FILE}.tmp"
    with open(temporary, "w", encoding="ascii") as f:
        f.write(role + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, directory / ROLE_FILE)
    sync_directory(directory)


def sync_directory(directory: str | Path) -> None:
    """fsync a directory, so that a rename or removal in it survives a power loss (the session
    files' own writes sync the same way: stores.py `DiskStore`)."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def holds_sessions(directory: str | Path) -> bool:
    return any(Path(directory).glob("sess_*.safetensors"))


def check_role(directory: str | Path, with_redis: bool) -> None:
    """StateDirectoryRefused when a server without Redis would start over a directory that holds
    a Redis spill cache (its files may be older than what Redis holds)."""
    directory = Path(directory).absolute()
    if not with_redis and directory_role(directory) == REDIS_SPILL and holds_sessions(directory):
        raise StateDirectoryRefused(
            f"XLSERVE_STATE_DIR {directory} holds a spill cache of the sessions in Redis (it was last served with "
            "XLSERVE_REDIS_URL), whose files may be older than Redis's versions; start with XLSERVE_REDIS_URL set, "
            "or give this server another directory (or empty this one) to serve without Redis")
