"""Certain commits against a real server and a real redis-server that the test pauses (SIGSTOP)
in the middle of a request's commit and resumes (SIGCONT).

- The client's answer matches what Redis holds once it has resumed and the commit is settled:
  never "failed" for a change that landed, never "done" for one that did not.
- When Redis stays silent past the settle wait, the answer is 503 `commit_outcome_unknown`,
  and a retry with the same Idempotency-Key applies the request exactly once.
- While Redis hangs, other session requests each answer within their own store timeout (plus a
  margin), instead of queueing behind the hung commit and each other.

The pause starts after the first streamed chunk of a generation of GENERATED tokens (LONG in the
test whose commit must hang: seconds of decoding), so it comes before that request's commit.
HTTP only: the test process runs no model."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import MODEL, append, create, document, info, metric
from tests.redis_server import redis_server  # noqa: F401 (a fixture)

STORE_TIMEOUT = 1.0  # XLSERVE_STORE_TIMEOUT_SECONDS
SETTLE = 4.0  # XLSERVE_COMMIT_SETTLE_SECONDS
MARGIN = 4.0  # seconds of slack on a loaded machine, for the one timing claim
GENERATED = 400
# the generation whose commit must hang: Redis is paused after its first chunk, and 4000 tokens
# (seconds of decoding) leave that pause time to land before the commit on a loaded machine,
# where the test process can stall for a second or more
LONG = 4000
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


def request(session_id: str, stream: bool, max_tokens: int = GENERATED) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "session_id": session_id}


def stream_paused_at_commit(client, redis_server, session_id: str, key: str, while_paused=None,
                            max_tokens: int = GENERATED, ended_at: list | None = None) -> list[dict]:
    """Stream a generation on the session; pause Redis once the first chunk is here (so before the
    commit), call `while_paused` (in a thread), and return the stream's events; `ended_at` gets
    the time its last line came (before `while_paused` is waited for)."""
    with client.stream("POST", "/v1/completions", json=request(session_id, True, max_tokens),
                       headers={"Idempotency-Key": key}) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        pause(redis_server)
        helper = threading.Thread(target=while_paused) if while_paused else None
        if helper:
            helper.start()
        rest = [line for line in lines if line.startswith("data: ")]
        if ended_at is not None:
            ended_at.append(time.monotonic())
    if helper:
        helper.join(60)
    return [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]


def retry_until_answered(client, session_id: str, key: str, max_tokens: int = GENERATED):
    """The client's retry with the same key, repeated while the server cannot answer yet."""
    for _ in range(30):
        response = client.post("/v1/completions", json=request(session_id, False, max_tokens),
                               headers={"Idempotency-Key": key})
        if response.status_code == 200:
            return response
        assert response.status_code in (409, 503), response.text  # busy, a conflict, or the store catching up
        time.sleep(0.2)
    raise AssertionError("the retry was never answered")


def test_a_commit_paused_then_resumed_is_answered_as_it_landed(served, redis_server):
    """Redis pauses after the stream's first chunk and resumes STORE_TIMEOUT * 2.5 after the
    engine finished the generation: during its commit's settle wait, so the commit was surely
    held (a short generation on a loaded machine could commit before the pause, and the test
    would pass without holding anything)."""
    with served.client() as client, served.client() as watcher:
        session = create(client)
        append(client, session, document(0))
        before = info(client, session)
        finished_before = finished_generations(watcher)
        resumed_at = []

        def resume_during_the_settle_wait():
            deadline = time.monotonic() + 60
            while finished_generations(watcher) == finished_before and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(STORE_TIMEOUT * 2.5)
            resume(redis_server)
            resumed_at.append(time.monotonic())

        answered_at = []
        try:
            events = stream_paused_at_commit(client, redis_server, session, "paused-a", resume_during_the_settle_wait,
                                             LONG, answered_at)
        finally:
            resume(redis_server)
        # the stream's end waited for the resume: the commit was held
        assert resumed_at and answered_at and answered_at[0] >= resumed_at[0]
        error = next((event["error"] for event in events if "error" in event), None)
        after = info(client, session)
        if error is None:  # told it is done: it is, once
            assert (after["version"], after["tokens"]) == (before["version"] + 1, before["tokens"] + 1 + LONG)
        else:  # told it is not: it is not (and it was settled, not left unknown)
            assert error["code"] == "session_unavailable" and "nothing was written" in error["message"], error
            assert (after["version"], after["tokens"]) == (before["version"], before["tokens"])

        retried = retry_until_answered(client, session, "paused-a", LONG)
        assert (retried.headers.get("idempotent-replayed") == "true") == (error is None)
        final = info(client, session)
        assert (final["version"], final["tokens"]) == (before["version"] + 1, before["tokens"] + 1 + LONG)


def finished_generations(client) -> float:
    """Generations of the model the engine has finished (each counted before its commit starts)."""
    return metric(client.get("/metrics").text, "xlserve_requests_total", model=MODEL, finish_reason="length")


def test_outcome_unknown_a_keyed_retry_applies_once_and_others_answer_within_their_timeout(served, redis_server):
    with served.client() as client, ExitStack() as clients:
        session = create(client)
        append(client, session, document(1))
        before = info(client, session)
        others = [create(client) for _ in range(8)]
        # a connection each, made now: a request's clock starts when it is sent
        own = [clients.enter_context(served.client()) for _ in others]
        watcher = clients.enter_context(served.client())
        finished_before = finished_generations(client)
        answers = []

        def other_requests():
            """All at once, once the engine has finished the generation (its commit now hangs on
            the paused Redis for STORE_TIMEOUT + SETTLE), so that they come while it hangs, not
            during the seconds of decoding before it. /metrics asks nothing of Redis."""
            deadline = time.monotonic() + 60
            while finished_generations(watcher) == finished_before:
                if time.monotonic() > deadline:
                    return  # answers stays empty: the test fails below
                time.sleep(0.02)

            def one(index: int):
                other = others[index]
                started = time.monotonic()
                if index % 2:
                    response = own[index].get(f"/v1/sessions/{other}")
                else:
                    response = own[index].post(f"/v1/sessions/{other}/append", json={"text": "y"})
                seconds = time.monotonic() - started
                return response.status_code, response.json().get("error", {}).get("code"), seconds

            with ThreadPoolExecutor(len(others)) as pool:
                answers.extend(pool.map(one, range(len(others))))

        try:
            events = stream_paused_at_commit(client, redis_server, session, "paused-b", other_requests, LONG)
            error = next((event["error"] for event in events if "error" in event), None)
            # Redis stayed silent for the whole settle wait: the honest answer is "not known"
            assert error is not None and error["code"] == "commit_outcome_unknown", events[-1:]
            assert f"GET /v1/sessions/{session}" in error["message"] and "Idempotency-Key" in error["message"]
        finally:
            resume(redis_server)
        assert len(answers) == len(others), "the other requests were not all answered (or never sent)"
        # each answered on its own, within its own timeout: one queued behind the hung commit
        # (sent as it began: its STORE_TIMEOUT + SETTLE, then its own STORE_TIMEOUT) or behind
        # the others (8 x STORE_TIMEOUT for the last) would take longer than the bound
        assert STORE_TIMEOUT + MARGIN < min(2 * STORE_TIMEOUT + SETTLE, len(others) * STORE_TIMEOUT)
        for status, code, seconds in answers:
            assert (status, code) == (503, "session_unavailable")
            assert seconds < STORE_TIMEOUT + MARGIN

        retry_until_answered(client, session, "paused-b", LONG)  # the client retries with the same key
        again = retry_until_answered(client, session, "paused-b", LONG)
        assert again.headers.get("idempotent-replayed") == "true"
        final = info(client, session)
        assert (final["version"], final["tokens"]) == (before["version"] + 1, before["tokens"] + 1 + LONG)
        for other in others:  # Redis is back: the others are served again
            assert info(client, other)["version"] == 0
