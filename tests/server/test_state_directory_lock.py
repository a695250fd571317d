"""One server per state directory (server/cache/state_directory.py `hold_state_directory`): a second
server on a directory another holds is refused at start naming the setting and the holder, a
directory that cannot be written is refused at start, and the hold ends with its process, so
an engine process restarted after a crash takes the directory again."""

import os
import subprocess
import sys

import pytest

from xlserve.server.cache.state_directory import StateDirectoryRefused, hold_state_directory

HOLD_THEN_WAIT = """
import sys, time
from xlserve.server.cache.state_directory import hold_state_directory
hold = hold_state_directory(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


def test_a_directory_another_process_holds_is_refused_until_that_process_ends(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THEN_WAIT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirectoryRefused) as refused:
            hold_state_directory(tmp_path)
        message = str(refused.value)
        assert f"XLSERVE_STATE_DIR {tmp_path} is in use by another xlserve server (pid {holder.pid}, child of pid {os.getpid()}, on " in message
        assert "XLSERVE_REDIS_URL" in message
    finally:
        holder.kill()  # as kill -9 would: the kernel ends the hold
        holder.wait(10)
    hold = hold_state_directory(tmp_path)
    hold.close()
    hold_state_directory(tmp_path).close()  # closed, it is free again in this process too


def test_a_directory_that_cannot_be_made_or_written_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("")  # a path through a file: not a directory anyone can write
    with pytest.raises(StateDirectoryRefused, match="XLSERVE_STATE_DIR .* cannot be written"):
        hold_state_directory(tmp_path / "a-file" / "state")


def test_two_engine_processes_on_one_directory(tmp_path):
    """The second is refused before it touches a file; once the first closes, a third starts."""
    import socket

    from xlserve.server.engine.process import EngineProcess
    from tests.server.engine_process_helpers import tiny_settings

    settings = tiny_settings(tmp_path)
    sockets = [socket.socketpair() for _ in range(3)]
    first = EngineProcess(settings, sockets[0][1])
    stray = tmp_path / "state" / ".sess_0.tmp"  # a write in flight in the first: a second start would delete it
    stray.write_bytes(b"in flight")
    try:
        with pytest.raises(StateDirectoryRefused, match="in use by another xlserve server"):
            EngineProcess(settings, sockets[1][1])
        assert stray.exists()
    finally:
        first.close()
    EngineProcess(settings, sockets[2][1]).close()
    for pair in sockets:
        for end in pair:
            end.close()
