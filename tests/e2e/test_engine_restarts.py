"""The engine process heals: a kill -9 of it under load costs the requests in flight (each told
so: an SSE error event, a websocket error frame, a 503), never a committed session, and the
server serves again from a new engine process; one that keeps dying makes the server exit
non-zero, for a supervisor to take over. Processes are looked up in /proc (Linux)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from websockets.sync.client import connect

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import MODEL, append, create, document, info, ok, wait_idle
from tests.e2e.process_tools import (
    PlainCompletion, Stream, committed_content, engine_pid, error_of_stream, gone_within, replaced,
)

LONG = 100_000  # tokens: a generation that is still running whenever the test acts


def test_kill_9_of_the_engine_process_under_load_keeps_every_committed_session(tiny_checkpoint):
    model = tiny_checkpoint.name
    server = ServerProcess([tiny_checkpoint], env={"XLSERVE_MAX_TOKENS_LIMIT": str(LONG)}).start()
    try:
        with server.client() as client:
            # committed before the kill: appends, and a generation continuing a session
            sessions = [create(client, model) for _ in range(3)]
            for i, session_id in enumerate(sessions):
                append(client, session_id, document(i))
            ok(client.post("/v1/completions", json={"model": model, "prompt": "x = ", "max_tokens": 4,
                                                    "session_id": sessions[0]}))
            before = {s: committed_content(client.get(f"/v1/sessions/{s}/state").content) for s in sessions}
            committed = {s: (info(client, s)["tokens"], info(client, s)["version"]) for s in sessions}

            # in flight at the kill: SSE streams (one continuing a session), a websocket
            # generation and a plain completion
            long = {"model": model, "prompt": "def main(", "max_tokens": LONG}
            plain = PlainCompletion(server, long)
            plain.start()
            streams = [Stream(server, long), Stream(server, {**long, "session_id": sessions[1]}),
                       Stream(server, {**long, "temperature": 0})]
            for stream in streams:
                stream.start()
            with connect(server.url.replace("http://", "ws://") + "/v1/stream") as ws:
                ws.send(json.dumps({"type": "generate", "id": "w", **long}))
                assert json.loads(ws.recv(timeout=60))["type"] == "token"
                for stream in streams:
                    assert stream.started.wait(60) and stream.events, "a stream did not start"
                dead = engine_pid(server)
                os.kill(dead, signal.SIGKILL)

                frame = json.loads(ws.recv(timeout=60))
                while frame["type"] == "token":
                    frame = json.loads(ws.recv(timeout=60))
                assert frame["type"] == "error" and frame["id"] == "w", frame
                assert frame["error"]["code"] == "engine_restarting" and frame["retry_after"] > 0
            for stream in streams:
                stream.join(60)
                assert not stream.is_alive()
                error = error_of_stream(stream)
                assert error["code"] == "engine_restarting" and error["type"] == "service_unavailable", error
            plain.join(60)
            assert plain.response is not None and plain.response.status_code == 503, plain.response
            assert plain.response.json()["error"]["code"] == "engine_restarting"
            assert plain.response.headers["retry-after"]

            replaced(server, dead)
            assert gone_within(dead, 10)
            for session_id in sessions:  # as last committed: the cut stream's session too
                current = wait_idle(client, session_id)
                assert (current["tokens"], current["version"]) == committed[session_id]
                assert committed_content(client.get(f"/v1/sessions/{session_id}/state").content) == before[session_id]
            # and the new engine process serves them
            continued = ok(client.post("/v1/completions", json={"model": model, "prompt": "y", "max_tokens": 3,
                                                                "session_id": sessions[1]}))
            assert continued["usage"]["prompt_tokens_details"]["cached_tokens"] == committed[sessions[1]][0]
            assert info(client, sessions[1])["version"] == committed[sessions[1]][1] + 1
    finally:
        assert server.stop() == 0


def test_an_engine_process_that_keeps_dying_makes_the_server_exit_non_zero(tiny_checkpoint, tmp_path):
    """XLSERVE_ENGINE_RESTART_LIMIT=1: the first death is healed, the second within the window
    stops the server, non-zero, saying why in one line (no traceback)."""
    log_path = tmp_path / "server.log"
    server = ServerProcess([tiny_checkpoint], env={"XLSERVE_ENGINE_RESTART_LIMIT": "1"}, log_path=log_path).start()
    try:
        first = engine_pid(server)
        os.kill(first, signal.SIGKILL)
        os.kill(replaced(server, first), signal.SIGKILL)
        code = server.process.wait(60)
    finally:
        server.stop(signal.SIGKILL)
    assert code not in (0, None)
    output = log_path.read_text()
    assert "Traceback" not in output
    last = output.strip().splitlines()[-1]
    assert last.startswith("xlserve serve: the engine process") and "XLSERVE_ENGINE_RESTART_LIMIT=1" in last, last


# XLSERVE_ENGINE_STALL_SECONDS of the frozen-engine test: well past the 1-3 s a loaded machine can
# stall a live engine process for (which would be killed as frozen while its request waits)
STALL_SECONDS = 8


def names_the_stall(reasons: list[str]) -> bool:
    return any("made no progress" in reason for reason in reasons)


def test_a_frozen_engine_process_is_noticed_and_restarted_like_a_dead_one(tiny_checkpoint, tmp_path):
    """SIGSTOP keeps the engine process's socket open, so nothing dies: the watchdog notices that
    it says nothing (not even its heartbeat) while a request waits, for XLSERVE_ENGINE_STALL_SECONDS,
    says so on /ready (503) and in /health's body (still 200: the API process lives), kills it and
    starts a new one; the waiting request is told to retry."""
    server = ServerProcess([tiny_checkpoint], env={"XLSERVE_ENGINE_STALL_SECONDS": f"{STALL_SECONDS:g}"},
                           log_path=tmp_path / "server.log").start()
    frozen = engine_pid(server)
    try:
        body = {"model": MODEL, "prompt": "def main(",
                "max_tokens": 4, "temperature": 0}
        ok(httpx.post(server.url + "/v1/completions", json=body, timeout=60))
        time.sleep(STALL_SECONDS + 2)  # idle beyond the stall setting: the heartbeat keeps a running engine from counting as frozen
        assert engine_pid(server) == frozen
        os.kill(frozen, signal.SIGSTOP)
        # a scrape meanwhile answers with the API process's half at least, in time: it waited on
        # the frozen engine process until its scrape timed out, and Prometheus saw the server down
        started = time.monotonic()
        scraped = httpx.get(server.url + "/metrics", timeout=10)
        assert scraped.status_code == 200 and "xlserve_http_requests_total" in scraped.text
        assert time.monotonic() - started < 5
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60)
            reasons, health_bodies = [], []
            deadline = time.monotonic() + STALL_SECONDS + 30
            while time.monotonic() < deadline and not (names_the_stall(reasons) and names_the_stall(health_bodies)):
                ready = httpx.get(server.url + "/ready", timeout=5)
                if ready.status_code == 503:
                    reasons.append(ready.json().get("reason", ""))
                    # liveness meanwhile: still 200 (the server heals itself), its body naming the stall
                    health = httpx.get(server.url + "/health", timeout=5)
                    assert health.status_code == 200, health.text
                    if health.json().get("engine") == "restarting":
                        health_bodies.append(health.json()["reason"])
                        assert health.json()["status"] == "ok", health.json()
                time.sleep(0.1)
            refused = waiting.result(timeout=60)
        setting = f"XLSERVE_ENGINE_STALL_SECONDS={STALL_SECONDS:g}"
        assert any("made no progress" in r and setting in r for r in reasons), reasons
        assert any("made no progress" in r and setting in r for r in health_bodies), health_bodies
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_restarting", refused.text
        assert gone_within(frozen, 30)
        replaced(server, frozen)
        assert ok(httpx.post(server.url + "/v1/completions", json=body, timeout=60))["choices"][0]["text"]
    finally:
        try:
            os.kill(frozen, signal.SIGCONT)  # should the test fail before the watchdog acts
        except ProcessLookupError:
            pass
        server.stop()


# XLSERVE_ENGINE_STEP_SECONDS of the hung-step test: past the 1-3 s a loaded machine can stall a
# live step for, and the tiny model's steps take milliseconds
STEP_SECONDS = 8


def test_a_step_that_never_returns_is_noticed_and_its_engine_process_restarted(tiny_checkpoint, tmp_path):
    """A forward that never returns (a hung GPU kernel) fails nothing and its process's heartbeat
    beats on, so the stall watchdog never fires: the heartbeat carries how long each model's step
    has run, and past XLSERVE_ENGINE_STEP_SECONDS the engine process is killed and restarted. The
    waiting request is told to retry, the log names the model's step, and a committed session is
    served as it was. The hang is XLSERVE_TEST_HANG_STEP_FILE's: the first step to find the
    file removes it and blocks for good."""
    hang, log_path = tmp_path / "hang-the-next-step", tmp_path / "server.log"
    server = ServerProcess([tiny_checkpoint], env={"XLSERVE_ENGINE_STEP_SECONDS": f"{STEP_SECONDS:g}",
                                                   "XLSERVE_TEST_HANG_STEP_FILE": str(hang)},
                           log_path=log_path).start()
    hung = engine_pid(server)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            session = create(client)
            append(client, session, document(0))
            before = info(client, session)
            body = {"model": MODEL, "prompt": "def main(", "max_tokens": 4, "temperature": 0}
            ok(client.post("/v1/completions", json=body))
            hang.touch()
            started = time.monotonic()
            refused = client.post("/v1/completions", json=body, timeout=STEP_SECONDS + 60)
            assert time.monotonic() - started >= STEP_SECONDS
            assert not hang.exists()  # the step found it
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_restarting", refused.text
            assert gone_within(hung, 30)
            replaced(server, hung)  # the restart is logged before the new process starts
            said = [line for line in log_path.read_text().splitlines() if f"model '{MODEL}''s step had run for" in line]
            assert said and f"(XLSERVE_ENGINE_STEP_SECONDS={STEP_SECONDS:g}): the engine process (pid {hung}) was " \
                "killed; starting a new one" in said[0], said
            assert ok(client.post("/v1/completions", json=body))["choices"][0]["text"]
            after = info(client, session)
            assert (after["version"], after["tokens"]) == (before["version"], before["tokens"])
    finally:
        server.stop()


def test_an_engine_process_that_never_gets_ready_is_a_failed_start_not_loading_for_good(tiny_checkpoint, tmp_path):
    """XLSERVE_ENGINE_START_SECONDS: an engine process not ready in time (here 0.2 s, less than it
    takes to import torch) is killed and its start fails; the server stops non-zero saying why in
    one line, instead of answering `loading` for good."""
    log_path = tmp_path / "server.log"
    server = ServerProcess([tiny_checkpoint], env={"XLSERVE_ENGINE_START_SECONDS": "0.2"}, log_path=log_path)
    with pytest.raises(RuntimeError, match="server exited"):
        server.start()
    output = log_path.read_text()
    assert "Traceback" not in output
    assert "not ready after 0.2s (XLSERVE_ENGINE_START_SECONDS)" in output.strip().splitlines()[-1], output[-2000:]
