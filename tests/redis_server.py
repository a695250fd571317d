"""A real redis-server for tests: started on a free loopback port, no persistence, stopped after.

Import the `redis_url` fixture into a test module to use it. Tests skip, saying why, only when
the redis-server binary is absent (`make test` installs the Debian package when it is missing).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, directory):
        self.binary = shutil.which("redis-server")
        self.port = _free_port()
        self.directory = directory
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20) -> "RedisServer":
        import redis

        self.process = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}")
                try:
                    if client.ping():
                        return self
                except redis.exceptions.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise RuntimeError(f"redis-server did not answer within {timeout}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; `make test` does it)")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """The RedisServer itself, for tests that pause it (SIGSTOP): it is resumed before it stops,
    should a test have failed while it was paused."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; `make test` does it)")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    os.kill(server.process.pid, signal.SIGCONT)
    server.stop()
