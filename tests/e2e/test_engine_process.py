"""The server is two processes (server/engine/process.py): they live and die together, and
/metrics shows both halves once. Processes are looked up in /proc (Linux)."""

import os
import re
import signal
import time
from pathlib import Path

from tests.e2e.server_process import ServerProcess

GENERATE = {"prompt": "def main(", "max_tokens": 8, "temperature": 0}


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


def test_kill_9_of_the_server_takes_the_engine_process_with_it(tiny_checkpoint):
    server = ServerProcess([tiny_checkpoint]).start()
    engine = engine_pid(server)
    server.stop(signal.SIGKILL)
    assert gone_within(engine, 10)


def test_a_dead_engine_process_turns_health_and_requests_into_503(tiny_checkpoint):
    server = ServerProcess([tiny_checkpoint]).start()
    try:
        with server.client() as client:
            assert client.post("/v1/completions", json={"model": tiny_checkpoint.name, **GENERATE}).status_code == 200
            os.kill(engine_pid(server), signal.SIGKILL)
            deadline = time.monotonic() + 10
            while client.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
            assert client.get("/ready").status_code == 503
            response = client.post("/v1/completions", json={"model": tiny_checkpoint.name, **GENERATE})
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "engine_gone"
            response = client.post("/v1/sessions", json={"model": tiny_checkpoint.name})
            assert response.status_code == 503
    finally:
        server.stop()


def test_ctrl_c_reaches_only_the_api_process_which_drains_and_stops_both(tiny_checkpoint):
    """A terminal's Ctrl-C signals the whole process group: the engine process ignores it and
    keeps serving until the API process has drained and tells it to stop."""
    server = ServerProcess([tiny_checkpoint]).start()
    engine = engine_pid(server)
    os.kill(engine, signal.SIGINT)
    os.kill(engine, signal.SIGTERM)
    with server.client() as client:
        assert client.post("/v1/completions", json={"model": tiny_checkpoint.name, **GENERATE}).status_code == 200
    assert server.stop(signal.SIGINT) == 0
    assert gone_within(engine, 10)


def test_metrics_show_each_family_once_with_both_processes_counting(server):
    with server.client() as client:
        body = {"model": server.models[0].name, **GENERATE, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert "[DONE]" in "".join(response.iter_text())
        text = client.get("/metrics").text
    types = re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE)
    assert len(types) == len(set(types)), "a family is rendered twice"

    def value(sample: str) -> float:
        match = re.search(rf"^{re.escape(sample)}\{{[^}}]*\}} (\S+)$", text, flags=re.MULTILINE)
        assert match, f"{sample} missing from /metrics"
        return float(match.group(1))

    assert value("xlserve_generation_tokens_total") >= 8  # counted in the engine process
    assert value("xlserve_batch_size_count") >= 1
    assert value("xlserve_time_to_first_token_seconds_count") >= 1  # counted in the API process
    assert value("xlserve_inter_token_latency_seconds_count") >= 1


def test_the_api_process_never_loads_torch():
    """The API process holds no model: importing the app and serving must not pull in torch
    (a second copy costs about a second of every start and a few hundred MB)."""
    import subprocess
    import sys

    from tests.e2e.server_process import REPO

    code = ("import sys, xlserve.server.app, xlserve.server.cli; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
