"""Real Redis deployments on loopback for tests: a three-node Redis Cluster, and a Sentinel with
one master and one replica. Debian's redis-server and redis-cli, no persistence, every process
stopped when the fixture ends (also when the test or the start-up failed).

Import the `redis_cluster` or `redis_sentinel` fixture into a test module to use one. Tests skip,
saying why, only when the binaries are absent (`make test` installs the Debian package).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _need(*binaries: str) -> None:
    missing = [b for b in binaries if shutil.which(b) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian: apt-get install redis-server; `make test` does it)")


class _Processes:
    """redis-server processes started by a fixture, stopped together."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.processes: dict[int, subprocess.Popen] = {}  # port -> process

    def start(self, port: int, *args: str) -> subprocess.Popen:
        log = open(self.directory / f"redis-{port}.log", "ab")
        process = subprocess.Popen([shutil.which("redis-server"), *args], cwd=self.directory,
                                   stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.processes[port] = process
        return process

    def kill(self, port: int) -> None:
        process = self.processes.get(port)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def log_tail(self, port: int, lines: int = 20) -> str:
        path = self.directory / f"redis-{port}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _wait(condition, timeout: float, what: str, processes: _Processes) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [port for port, p in processes.processes.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"redis-server on port {dead[0]} exited:\n{processes.log_tail(dead[0])}")
        try:
            if condition():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} within {timeout}s")


def _client(port: int):
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1)


class RedisClusterNodes(_Processes):
    """Three masters, no replicas, the 16384 slots spread over them by `redis-cli --cluster create`."""

    def __init__(self, directory: Path, nodes: int = 3):
        super().__init__(directory)
        self.ports = [_free_port() for _ in range(nodes)]
        self.bus_ports = [_free_port() for _ in range(nodes)]  # not port + 10000, which may be out of range

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start_all(self, timeout: float = 30) -> "RedisClusterNodes":
        for port, bus_port in zip(self.ports, self.bus_ports):
            self.start(port, "--bind", "127.0.0.1", "--port", str(port), "--cluster-enabled", "yes",
                       "--cluster-port", str(bus_port),
                       "--cluster-config-file", str(self.directory / f"nodes-{port}.conf"), "--cluster-node-timeout",
                       "2000", "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                       "--daemonize", "no", "--loglevel", "warning")
        for port in self.ports:
            _wait(lambda: _client(port).ping(), timeout, f"redis-server on port {port} did not answer", self)
        created = subprocess.run(
            [shutil.which("redis-cli"), "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
             "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=timeout)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout[-2000:]}{created.stderr[-2000:]}")
        for port in self.ports:  # every node agrees the cluster is whole
            _wait(lambda: _client(port).execute_command("CLUSTER INFO").get("cluster_state") == "ok", timeout,
                  f"the cluster's node {port} did not reach cluster_state:ok", self)
        return self

    def node_of(self, key: str) -> int:
        """The port of the master that holds `key`'s slot."""
        import redis
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        for start, end, (host, port, *_), *_ in _client(self.ports[0]).execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return int(port)
        raise redis.exceptions.RedisError(f"no node holds slot {slot}")


class RedisSentinelSetup(_Processes):
    """A master, a replica of it and one sentinel (quorum 1) watching it as `service`; the
    sentinel declares the master down after `down_after_ms` and promotes the replica."""

    def __init__(self, directory: Path, service: str = "xlserve", down_after_ms: int = 500):
        super().__init__(directory)
        self.service = service
        self.down_after_ms = down_after_ms
        self.master_port, self.replica_port, self.sentinel_port = (_free_port() for _ in range(3))

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.service}/0"

    def start_all(self, timeout: float = 30) -> "RedisSentinelSetup":
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                  "--daemonize", "no", "--loglevel", "warning"]
        self.start(self.master_port, "--port", str(self.master_port), *common)
        self.start(self.replica_port, "--port", str(self.replica_port), "--replicaof", "127.0.0.1",
                   str(self.master_port), *common)
        _wait(lambda: _client(self.replica_port).info("replication")["master_link_status"] == "up", timeout,
              "the replica did not sync with the master", self)
        config = self.directory / "sentinel.conf"  # a sentinel rewrites its configuration file
        config.write_text(f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.directory}\n"
                          f"sentinel monitor {self.service} 127.0.0.1 {self.master_port} 1\n"
                          f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                          f"sentinel failover-timeout {self.service} 10000\n")
        self.start(self.sentinel_port, str(config), "--sentinel", "--loglevel", "warning")
        _wait(lambda: self.master() == self.master_port and _client(self.sentinel_port).sentinel_slaves(self.service),
              timeout, "the sentinel did not find the master and its replica", self)
        return self

    def master(self) -> int:
        host, port = _client(self.sentinel_port).sentinel_get_master_addr_by_name(self.service)
        return int(port)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    _need("redis-server", "redis-cli")
    nodes = RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield nodes.start_all()
    finally:
        nodes.stop()


@pytest.fixture(scope="module")
def redis_sentinel(tmp_path_factory):
    _need("redis-server")
    setup = RedisSentinelSetup(tmp_path_factory.mktemp("redis-sentinel"))
    try:
        yield setup.start_all()
    finally:
        setup.stop()
