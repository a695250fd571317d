"""Helpers for tests of the server's two processes: the engine process found in /proc
(Linux), and requests run in threads while a test acts on the processes."""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path

import httpx

from tests.e2e.server_process import ServerProcess


def process_state_and_parent(pid: int | str) -> tuple[str, int]:
    """From /proc/<pid>/stat: the state letter and the parent's pid (the fields after the
    command name, which may hold spaces)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def engine_pid(server: ServerProcess) -> int:
    children = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if process_state_and_parent(entry.name)[1] == server.process.pid:
                children.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    assert len(children) == 1, f"expected one engine process under the server, found {children}"
    return children[0]


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if process_state_and_parent(pid)[0] == "Z":  # exited, not yet reaped
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def replaced(server: ServerProcess, dead: int, timeout: float = 60) -> int:
    """Wait until a new engine process has replaced `dead` and the server is ready; its pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.process.poll() is None, f"the server exited with {server.process.returncode}"
        try:
            current = engine_pid(server)
            if current != dead and httpx.get(server.url + "/ready", timeout=2).status_code == 200:
                return current
        except (AssertionError, httpx.TransportError):  # the dead one not reaped yet, or a new one starting
            pass
        time.sleep(0.05)
    raise AssertionError(f"no new engine process was ready within {timeout}s")


class Stream(threading.Thread):
    """One SSE completion read to its end in a thread: its data events, and a flag raised at the
    first one (the request is running in the engine by then)."""

    def __init__(self, server: ServerProcess, body: dict):
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.events: list[str] = []
        self.status: int | None = None
        self.started = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.server.url, timeout=60) as client:
                with client.stream("POST", "/v1/completions", json={**self.body, "stream": True}) as response:
                    self.status = response.status_code
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line[len("data: "):])
                            self.started.set()
        except BaseException as error:  # the main thread asserts on it
            self.failure = error
        finally:
            self.started.set()


class PlainCompletion(threading.Thread):
    """A non-streamed completion, its response kept."""

    def __init__(self, server: ServerProcess, body: dict):
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.response: httpx.Response | None = None

    def run(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=60) as client:
            self.response = client.post("/v1/completions", json=self.body)


def committed_content(blob: bytes) -> tuple[dict, dict, bytes]:
    """An exported state without what reading it changes: (tensor table, metadata but its last
    use and the checksum over it, tensor bytes)."""
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    metadata = header.pop("__metadata__")
    for volatile in ("last_used_at", "checksum"):
        metadata.pop(volatile)
    return header, metadata, blob[8 + length:]


def error_of_stream(stream: Stream) -> dict:
    """The error a cut stream ended with: `data: {"error": ...}` then `data: [DONE]`."""
    assert stream.failure is None, repr(stream.failure)
    assert stream.status == 200
    assert len(stream.events) >= 3 and stream.events[-1] == "[DONE]", stream.events[-3:]
    last = json.loads(stream.events[-2])
    assert "error" in last, last
    return last["error"]
