"""Sessions outlive the server: kill -9 mid-request, restart, every committed session continues
exactly (one of them stored as a base file and a log of delta commits, and forked from there);
a graceful SIGTERM and restart likewise."""

import signal

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import append, create, document, info, ok, score


def test_sessions_survive_kill_and_graceful_restart(tiny_checkpoint, tmp_path):
    env = {"XLSERVE_STATE_DIR": str(tmp_path / "state")}
    log = tmp_path / "server.log"
    first = ServerProcess([tiny_checkpoint], env=env, log_path=log).start()
    try:
        with first.client() as client:
            growing = create(client)
            append(client, growing, document(1))
            append(client, growing, document(2))  # version 2
            busy = create(client)
            append(client, busy, document(3))  # version 1
            empty = create(client)  # version 0, no state yet
            logged = create(client)
            append(client, logged, document(5))
            for text in ("x = 1\n", "y = 2\n"):  # short appends to a full memory: delta blocks in its log
                append(client, logged, text)
            assert (tmp_path / "state" / f"{logged}.log").stat().st_size > 0  # version 3 = base + log
            twins = {s: ok(client.post(f"/v1/sessions/{s}/fork"))["id"] for s in (growing, busy, logged)}
            expected = {s: score(client, twin) for s, twin in twins.items()}  # computed before the crash
            before = {s: info(client, s) for s in (growing, busy, empty, logged)}
            with first.client() as streaming, streaming.stream("POST", "/v1/completions", json={
                    "model": "txl-tiny", "prompt": "x", "max_tokens": 4000, "stream": True, "session_id": busy}) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                assert info(client, busy)["in_use"]
                first.stop(signal.SIGKILL)  # in the middle of a request on `busy`
    finally:
        first.stop(signal.SIGKILL)

    second = ServerProcess([tiny_checkpoint], env=env, log_path=log).start()
    try:
        with second.client() as client:
            for session, old in before.items():
                now = info(client, session)
                assert (now["version"], now["tokens"], now["state_bytes"]) == (old["version"], old["tokens"], old["state_bytes"])
                assert now["tier"] == "disk" and not now["in_use"]
            for session, logprobs in expected.items():
                assert score(client, session) == logprobs  # bit-identical continuation
            assert info(client, twins[growing])["version"] == 1
            append(client, empty, document(4))
            after_graceful = {s: info(client, s) for s in (growing, busy, empty, logged)}
        assert second.stop(signal.SIGTERM) == 0
    finally:
        second.stop(signal.SIGKILL)

    third = ServerProcess([tiny_checkpoint], env=env, log_path=log).start()
    try:
        with third.client() as client:
            for session, old in after_graceful.items():
                now = info(client, session)
                assert (now["version"], now["tokens"]) == (old["version"], old["tokens"])
            assert append(client, empty, "x")["version"] == 2
    finally:
        third.stop()
