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
