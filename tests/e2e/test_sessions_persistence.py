"""Sessions outlive the server: kill -9 mid-request, restart, every committed session continues
exactly (one of them stored as a base file and a log of delta commits, and forked from there);
a graceful SIGTERM and restart likewise."""

import signal
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import load

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
            logs = [create(client) for _ in range(3)]
            for session in logs:
                append(client, session, document(5))
            for text in ("x = 1\n", "y = 2\n", "z = 3\n"):  # short appends to full memories, at once: delta blocks
                with ThreadPoolExecutor(len(logs)) as pool:
                    list(pool.map(lambda session: appended(first, session, text), logs))
            logged = logs[0]
            assert all((tmp_path / "state" / f"{session}.log").stat().st_size > 0 for session in logs)  # base + log
            exported = {session: state_of(client, session) for session in logs}  # as the server holds them
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
            for session, tensors in exported.items():  # read back from the base file and its log
                assert same_tensors(state_of(client, session), tensors)
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


def appended(server: ServerProcess, session_id: str, text: str) -> dict:
    with server.client() as client:
        return append(client, session_id, text)


def state_of(client, session_id: str) -> dict:
    """The session's exported tensors (its metadata left out: it records when it was last used)."""
    response = client.get(f"/v1/sessions/{session_id}/state")
    assert response.status_code == 200, response.text
    return load(response.content)


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
                                        and a[name].view(-1).view(torch.uint8).equal(b[name].view(-1).view(torch.uint8))
                                        for name in a)
