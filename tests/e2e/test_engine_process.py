"""The server is two processes (server/engine/process.py): a kill -9 of the server takes both,
a dead engine process is replaced, and /metrics shows both halves once. Processes are looked up
in /proc (Linux)."""

import os
import re
import signal
import time

from tests.e2e.process_tools import engine_pid, gone_within
from tests.e2e.server_process import ServerProcess

GENERATE = {"prompt": "def main(", "max_tokens": 8, "temperature": 0}


def test_kill_9_of_the_server_takes_the_engine_process_with_it(tiny_checkpoint):
    server = ServerProcess([tiny_checkpoint]).start()
    engine = engine_pid(server)
    server.stop(signal.SIGKILL)
    assert gone_within(engine, 10)


def test_a_dead_engine_process_is_replaced_and_requests_meanwhile_get_503_engine_restarting(tiny_checkpoint):
    """A kill -9 of the engine process alone: the server starts a new one. Until it is ready,
    /ready is 503 and requests are refused with 503 `engine_restarting` (and Retry-After);
    /health stays 200 (the server heals itself: no orchestrator restart needed); then it serves
    again, from a new process, and the restart is counted."""
    server = ServerProcess([tiny_checkpoint]).start()
    try:
        with server.client() as client:
            assert client.post("/v1/completions", json={"model": tiny_checkpoint.name, **GENERATE}).status_code == 200
            dead = engine_pid(server)
            os.kill(dead, signal.SIGKILL)
            refusals, deadline = [], time.monotonic() + 60
            while time.monotonic() < deadline:
                response = client.post("/v1/completions", json={"model": tiny_checkpoint.name, **GENERATE})
                if response.status_code == 200:
                    break
                refusals.append(response)
                assert client.get("/health").status_code == 200
                time.sleep(0.05)
            assert response.status_code == 200, "the server did not serve again within 60s"
            assert refusals, "no request saw the engine process restarting"
            for refused in refusals:
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "engine_restarting"
                assert refused.headers["retry-after"]
            assert client.get("/ready").json()["status"] == "ready"
            assert engine_pid(server) != dead
            assert gone_within(dead, 10)
            text = client.get("/metrics").text
            assert re.search(rf'^xlserve_engine_restarts_total\{{model="{tiny_checkpoint.name}"\}} 1\.0$', text,
                             flags=re.MULTILINE)
    finally:
        assert server.stop() == 0


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
