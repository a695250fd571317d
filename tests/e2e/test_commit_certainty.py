"""Certain commits against a real server and a real redis-server that the test pauses (SIGSTOP)
in the middle of a request's commit and resumes (SIGCONT).

- The client's answer matches what Redis holds once it has resumed and the commit is settled:
  never "failed" for a change that landed, never "done" for one that did not.
- When Redis stays silent past the settle wait, the answer is 503 `commit_outcome_unknown`,
  and a retry with the same Idempotency-Key applies the request exactly once.
- While Redis hangs, other session requests each answer within their own store timeout (plus a
  margin), instead of queueing behind the hung commit and each other.

The pause starts after the first streamed chunk of a generation of GENERATED tokens, so it
always comes before that request's commit. HTTP only: the test process runs no model."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import MODEL, append, create, document, info
from tests.redis_server import redis_server  # noqa: F401 (a fixture)

STORE_TIMEOUT = 1.0  # XLSERVE_STORE_TIMEOUT_SECONDS
SETTLE = 4.0  # XLSERVE_COMMIT_SETTLE_SECONDS
MARGIN = 4.0  # seconds of slack on a loaded machine, for the one timing claim
GENERATED = 400
PROMPT = "x"



@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory, redis_server):
    server = ServerProcess([tiny_checkpoint], env={
        "XLSERVE_REDIS_URL": redis_server.url, "XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp("state")),
        "XLSERVE_STORE_TIMEOUT_SECONDS": str(STORE_TIMEOUT), "XLSERVE_COMMIT_SETTLE_SECONDS": str(SETTLE),
    }, log_path=tmp_path_factory.mktemp("logs") / "certainty.log").start()
    yield server
    server.stop()


def pause(redis_server) -> None:
    os.kill(redis_server.process.pid, signal.SIGSTOP)


def resume(redis_server) -> None:
    os.kill(redis_server.process.pid, signal.SIGCONT)


def request(session_id: str, stream: bool) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": GENERATED, "temperature": 0, "stream": stream,
            "session_id": session_id}


def stream_paused_at_commit(client, redis_server, session_id: str, key: str, while_paused=None) -> list[dict]:
    """Stream a generation on the session; pause Redis once the first chunk is here (so before the
    commit), call `while_paused` (in a thread), and return the stream's events."""
    with client.stream("POST", "/v1/completions", json=request(session_id, True),
                       headers={"Idempotency-Key": key}) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        pause(redis_server)
        helper = threading.Thread(target=while_paused) if while_paused else None
        if helper:
            helper.start()
        rest = [line for line in lines if line.startswith("data: ")]
    if helper:
        helper.join(60)
    return [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]


def retry_until_answered(client, session_id: str, key: str):
    """The client's retry with the same key, repeated while the server cannot answer yet."""
    for _ in range(30):
        response = client.post("/v1/completions", json=request(session_id, False), headers={"Idempotency-Key": key})
        if response.status_code == 200:
            return response
        assert response.status_code in (409, 503), response.text  # busy, a conflict, or the store catching up
        time.sleep(0.2)
    raise AssertionError("the retry was never answered")


def test_a_commit_paused_then_resumed_is_answered_as_it_landed(served, redis_server):
    with served.client() as client:
        session = create(client)
        append(client, session, document(0))
        before = info(client, session)
        resumer = threading.Timer(STORE_TIMEOUT * 2.5, resume, args=(redis_server,))  # during the settle wait
        try:
            events = stream_paused_at_commit(client, redis_server, session, "paused-a", resumer.start)
        finally:
            resume(redis_server)
            resumer.cancel()
        error = next((event["error"] for event in events if "error" in event), None)
        after = info(client, session)
        if error is None:  # told it is done: it is, once
            assert (after["version"], after["tokens"]) == (before["version"] + 1, before["tokens"] + 1 + GENERATED)
        else:  # told it is not: it is not (and it was settled, not left unknown)
            assert error["code"] == "session_unavailable" and "nothing was written" in error["message"], error
            assert (after["version"], after["tokens"]) == (before["version"], before["tokens"])

        retried = retry_until_answered(client, session, "paused-a")
        assert (retried.headers.get("idempotent-replayed") == "true") == (error is None)
        final = info(client, session)
        assert (final["version"], final["tokens"]) == (before["version"] + 1, before["tokens"] + 1 + GENERATED)


def test_outcome_unknown_a_keyed_retry_applies_once_and_others_answer_within_their_timeout(served, redis_server):
    with served.client() as client:
        session = create(client)
        append(client, session, document(1))
        before = info(client, session)
        others = [create(client) for _ in range(8)]
        answers = []

        def other_requests():  # all at once, while the commit hangs on the paused Redis
            def one(pair):
                index, other = pair
                started = time.monotonic()
                with served.client() as own:
                    if index % 2:
                        response = own.get(f"/v1/sessions/{other}")
                    else:
                        response = own.post(f"/v1/sessions/{other}/append", json={"text": "y"})
                return response.status_code, response.json().get("error", {}).get("code"), time.monotonic() - started

            with ThreadPoolExecutor(len(others)) as pool:
                answers.extend(pool.map(one, enumerate(others)))

        try:
            events = stream_paused_at_commit(client, redis_server, session, "paused-b", other_requests)
            error = next((event["error"] for event in events if "error" in event), None)
            # Redis stayed silent for the whole settle wait: the honest answer is "not known"
            assert error is not None and error["code"] == "commit_outcome_unknown", events[-1:]
            assert f"GET /v1/sessions/{session}" in error["message"] and "Idempotency-Key" in error["message"]
        finally:
            resume(redis_server)
        for status, code, seconds in answers:  # each answered on its own, within its own timeout
            assert (status, code) == (503, "session_unavailable")
            assert seconds < STORE_TIMEOUT + MARGIN

        retry_until_answered(client, session, "paused-b")  # the client retries with the same key
        again = retry_until_answered(client, session, "paused-b")
        assert again.headers.get("idempotent-replayed") == "true"
        final = info(client, session)
        assert (final["version"], final["tokens"]) == (before["version"] + 1, before["tokens"] + 1 + GENERATED)
        for other in others:  # Redis is back: the others are served again
            assert info(client, other)["version"] == 0
