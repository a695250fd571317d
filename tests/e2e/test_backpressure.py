"""Backpressure, limits, auth and graceful shutdown against a real server with small limits.

Load stays on loopback and is bounded: one burst of BURST requests, each with a timeout."""

from __future__ import annotations

import asyncio
import json
import re
import select
import signal
import socket
import time

import httpx
import pytest
from websockets.sync.client import connect

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import full_state_bytes, metric

MODEL = "txl-tiny"
KEY = "test-key"
SECOND_KEY, THIRD_KEY = "second-key", "third-key"  # other clients': the bounds per key leave each its share
BURST = 24
LIMITS = {
    "XLSERVE_MAX_BATCH_SIZE": "2",
    "XLSERVE_MAX_QUEUED_REQUESTS": "2",
    "XLSERVE_MAX_REQUEST_BODY_BYTES": "4096",
    "XLSERVE_MAX_TOKENS_LIMIT": "5000",
    "XLSERVE_API_KEYS": f"{KEY},{SECOND_KEY},{THIRD_KEY}",
    "XLSERVE_METRICS_REQUIRE_KEY": "true",
}


@pytest.fixture(scope="module")
def limited(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess([tiny_checkpoint], env=LIMITS,
                            log_path=tmp_path_factory.mktemp("logs") / "limited.log").start()
    yield process
    process.stop()


def authed(server, key: str = KEY, **kwargs) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer {key}"}, **kwargs)


def test_a_burst_past_the_queue_gets_429s_and_no_5xx(limited):
    """2 running + 2 queued long generations; everything else in the burst is refused with
    429 + Retry-After. Closing the accepted streams frees the slots; then the server serves."""

    async def burst():
        async with httpx.AsyncClient(base_url=limited.url, timeout=60,
                                     headers={"Authorization": f"Bearer {KEY}"},
                                     limits=httpx.Limits(max_connections=BURST)) as client:
            body = {"model": MODEL, "prompt": "while True:\n", "max_tokens": 5000, "stream": True}
            streams = [client.stream("POST", "/v1/completions", json=body) for _ in range(BURST)]
            responses = await asyncio.wait_for(
                asyncio.gather(*(s.__aenter__() for s in streams), return_exceptions=True), timeout=60)
            statuses, retry_after, errors = [], [], []
            for response in responses:
                assert not isinstance(response, BaseException), repr(response)
                statuses.append(response.status_code)
                if response.status_code == 429:
                    retry_after.append(response.headers.get("retry-after"))
                    errors.append(json.loads(await response.aread())["error"])
            for stream in streams:  # hang up on the accepted streams: cancels them
                await stream.__aexit__(None, None, None)
            return statuses, retry_after, errors

    statuses, retry_after, errors = asyncio.run(burst())
    assert all(status in (200, 429) for status in statuses), statuses
    assert statuses.count(200) >= 4 and statuses.count(429) >= 1
    assert all(value and int(value) >= 1 for value in retry_after)
    assert all(e["type"] == "rate_limit_error" and "XLSERVE_MAX_QUEUED_REQUESTS" in e["message"] for e in errors)

    with authed(limited) as client:
        assert wait_until_idle(client) == 0  # hanging up cancelled the accepted ones and freed their slots
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 3})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        metrics = client.get("/metrics").text
    assert 'xlserve_request_errors_total{code="queue_full",model="txl-tiny",type="rate_limit_error"}' in metrics
    assert 'xlserve_requests_total{finish_reason="cancelled",model="txl-tiny"}' in metrics


def test_a_list_of_prompts_that_could_never_be_queued_is_400_naming_the_limits(limited):
    """Each prompt of a list is queued as a request of its own, n rows wide, and the list's first
    prompts count against the queue while its last ones wait: past what an idle server takes (2
    rows at once, 2 waiting here), the answer was 429 with Retry-After on every try, which the
    OpenAI SDK retries by itself. It is a 400 naming the limits; a list that fits goes through."""
    with authed(limited) as client:
        for prompts, n in ((4, 1), (3, 2)):
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * prompts, "n": n,
                                                            "max_tokens": 1})
            assert response.status_code == 200 and len(response.json()["choices"]) == prompts * n, response.text
        for prompts, n in ((5, 1), (4, 2)):
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * prompts, "n": n,
                                                            "max_tokens": 1})
            error = response.json()["error"]
            assert response.status_code == 400 and "retry-after" not in response.headers, response.text
            assert error["code"] == "too_many_prompts" and error["param"] == "prompt"
            assert "XLSERVE_MAX_BATCH_SIZE" in error["message"] and "XLSERVE_MAX_QUEUED_REQUESTS" in error["message"]


def test_limits_name_themselves(limited):
    with authed(limited) as client:
        big = client.post("/v1/completions", content=b'{"model": "txl-tiny", "prompt": "' + b"x" * 5000 + b'"}',
                          headers={"content-type": "application/json"})
        assert big.status_code == 413 and "XLSERVE_MAX_REQUEST_BODY_BYTES" in big.json()["error"]["message"]

        def chunked():
            yield b'{"model": "txl-tiny", "prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        streamed = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413 and "4096" in streamed.json()["error"]["message"]

        small = client.post("/v1/completions", content=chunked_small(), headers={"content-type": "application/json"})
        assert small.status_code == 200, small.text

        tokens = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5001})
        assert tokens.status_code == 400 and "XLSERVE_MAX_TOKENS_LIMIT" in tokens.json()["error"]["message"]


def test_a_session_state_has_a_body_limit_of_its_own_sized_to_the_models(limited, tiny_checkpoint):
    """A state is larger than the 4,096-byte JSON limit here, as a real-size state (237 MB) is
    larger than the default 8 MB: import and PUT state take it under XLSERVE_MAX_STATE_BODY_BYTES,
    by default the largest served model's full state in float32 plus 1 MiB, while JSON bodies keep
    their limit; past it, by Content-Length or chunked, a 413 names the state's setting."""
    with authed(limited) as client:
        session = client.post("/v1/sessions", json={"model": MODEL})
        assert session.status_code == 200, session.text
        session_id = session.json()["id"]
        appended = client.post(f"/v1/sessions/{session_id}/append", json={"text": "def main():\n    pass\n"})
        assert appended.status_code == 200, appended.text
        state = client.get(f"/v1/sessions/{session_id}/state").content
        assert len(state) > 4096
        imported = client.post("/v1/sessions/import", content=state)
        assert imported.status_code == 200, imported.text
        assert imported.json()["tokens"] == appended.json()["tokens"]
        replaced = client.put(f"/v1/sessions/{session_id}/state", content=iter([state[:1000], state[1000:]]))
        assert replaced.status_code == 200, replaced.text  # chunked: measured as it is read

        limit = full_state_bytes(tiny_checkpoint) + (1 << 20)
        too_large = b"\0" * (limit + 1)
        for answer in (client.post("/v1/sessions/import", content=too_large),
                       client.put(f"/v1/sessions/{session_id}/state", content=iter([too_large[:limit], b"\0"]))):
            assert answer.status_code == 413, answer.text
            message = answer.json()["error"]["message"]
            assert str(limit) in message and "XLSERVE_MAX_STATE_BODY_BYTES" in message, message
        # JSON bodies elsewhere under the sessions path keep theirs
        big = client.post(f"/v1/sessions/{session_id}/append", json={"text": "x" * 5000})
        assert big.status_code == 413 and "XLSERVE_MAX_REQUEST_BODY_BYTES" in big.json()["error"]["message"]


def slow_uploads(server, state: bytes, uploads: list[tuple[str, str | None]]) -> list[socket.socket]:
    """For each (key, target session or None for an import): a PUT state or an import sending the
    first 100 bytes of its body only."""
    sockets = []
    for key, target in uploads:
        method, path = ("PUT", f"/v1/sessions/{target}/state") if target else ("POST", "/v1/sessions/import")
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}"
                     f"\r\nContent-Length: {len(state)}\r\nConnection: close\r\n\r\n".encode() + state[:100])
        sockets.append(sock)
    return sockets


def answer_of(sock: socket.socket) -> tuple[int, str, bytes]:
    received = b""
    while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < int(
            re.search(rb"content-length: (\d+)", received.lower()).group(1)):
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode(), body


def test_session_states_in_flight_are_bounded(limited):
    """Each import, PUT state or export holds a whole state in the API process (237 MB at real
    size): MAX_STATES_IN_FLIGHT at once, and MAX_STATES_IN_FLIGHT_PER_KEY of one API key's. One
    more than that sending their bodies slowly, and exactly one is refused 429 states_in_flight
    with Retry-After, before its body is read; every place is given back, by a state that went
    through and by one that failed alike. Then one key's slow uploads take its share only: the
    other key's import goes through meanwhile."""
    from xlserve.server.api.serving.requests import MAX_STATES_IN_FLIGHT, MAX_STATES_IN_FLIGHT_PER_KEY

    with authed(limited) as client, authed(limited, SECOND_KEY) as second, authed(limited, THIRD_KEY) as third:
        session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
        assert client.post(f"/v1/sessions/{session}/append", json={"text": "def f():"}).status_code == 200
        state = client.get(f"/v1/sessions/{session}/state").content
        # imports and PUTs of three keys, none past its share, a session of its own for each PUT
        # (two on one session would race for it: 409): only the bound on all of them refuses
        keys = ([KEY, SECOND_KEY, THIRD_KEY] * MAX_STATES_IN_FLIGHT)[: MAX_STATES_IN_FLIGHT + 1]
        owners = {KEY: client, SECOND_KEY: second, THIRD_KEY: third}
        targets = [owners[key].post("/v1/sessions", json={"model": MODEL}).json()["id"] if index % 2 else None
                   for index, key in enumerate(keys)]
        uploads = slow_uploads(limited, state, list(zip(keys, targets)))
        try:
            # one of them is answered at once, its body unread: the others hold the places
            deadline, refused = time.monotonic() + 30, []
            while not refused:
                assert time.monotonic() < deadline, "no upload was refused"
                readable, _, _ = select.select(uploads, [], [], 0.1)
                refused = readable
            assert len(refused) == 1

            answers = {refused[0]: answer_of(refused[0])}  # read before its body is sent: it never will be
            for sock in uploads:  # the others' bodies' ends: they go through
                if sock is not refused[0]:
                    sock.sendall(state[100:])
                    answers[sock] = answer_of(sock)
            answers = [answers[sock] for sock in uploads]
        finally:
            for sock in uploads:
                sock.close()
        assert sorted(status for status, _, _ in answers) == [200] * MAX_STATES_IN_FLIGHT + [429], answers
        _, head, body = answers[uploads.index(refused[0])]
        assert "retry-after: 1" in head.lower() and json.loads(body)["error"]["code"] == "states_in_flight"
        assert f"at most {MAX_STATES_IN_FLIGHT} at once" in json.loads(body)["error"]["message"]
        # every place given back, by the failures too: as many at once again, one by one
        assert client.post("/v1/sessions/import", content=b"not a state").status_code == 400
        for _ in range(MAX_STATES_IN_FLIGHT + 1):
            assert client.post("/v1/sessions/import", content=state).status_code == 200
            assert client.get(f"/v1/sessions/{session}/state").status_code == 200

        # one key's share: its next slow upload is refused, the other key's import goes through
        uploads = slow_uploads(limited, state, [(KEY, None)] * (MAX_STATES_IN_FLIGHT_PER_KEY + 1))
        try:
            deadline, refused = time.monotonic() + 30, []
            while not refused:
                assert time.monotonic() < deadline, "no upload was refused"
                refused, _, _ = select.select(uploads, [], [], 0.1)
            status, _, body = answer_of(refused[0])
            assert status == 429 and f"at most {MAX_STATES_IN_FLIGHT_PER_KEY} of one key's" in body.decode()
            assert second.post("/v1/sessions/import", content=state).status_code == 200
            for sock in uploads:
                if sock is not refused[0]:
                    sock.sendall(state[100:])
                    assert answer_of(sock)[0] == 200
        finally:
            for sock in uploads:
                sock.close()


def test_a_client_that_leaves_while_sending_its_body_is_no_error_of_the_server_s(limited):
    """A state upload cut off (Ctrl-C, a dropped link) was answered and counted as a 500
    internal_error, with a traceback, and fed the 5xx alert; a JSON body cut off was a 400 counted
    against the client. Both are now 499, the client-closed answer no one reads, counted as no error."""
    from prometheus_client.parser import text_string_to_metric_families

    def counts() -> dict[tuple[str, str], float]:
        with authed(limited) as client:
            text = client.get("/metrics").text
        return {(sample.labels["route"], sample.labels["status"]): sample.value
                for family in text_string_to_metric_families(text) if family.name == "xlserve_http_requests"
                for sample in family.samples if sample.name.endswith("_total")}

    before = counts()
    for path, declared, sent in (("/v1/sessions/import", 1 << 20, b"x" * 100_000),
                                 ("/v1/completions", 1000, b'{"model": "' + MODEL.encode() + b'", "pro')):
        sock = socket.create_connection(("127.0.0.1", limited.port))
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {declared}\r\n\r\n".encode() + sent)
        time.sleep(0.5)  # the body is being read
        sock.close()
    deadline = time.monotonic() + 30
    while True:
        after = counts()
        left = {route: after.get((route, "499"), 0) - before.get((route, "499"), 0)
                for route in ("/v1/sessions/import", "/v1/completions")}
        if all(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert left == {"/v1/sessions/import": 1, "/v1/completions": 1}, (left, after)
    for route in ("/v1/sessions/import", "/v1/completions"):
        for status in ("400", "500"):
            assert after.get((route, status), 0) == before.get((route, status), 0), (route, status)


def chunked_small():
    yield b'{"model": "txl-tiny", "prompt": "abc", '
    yield b'"max_tokens": 2}'


def test_auth_keeps_health_open_and_metrics_keyed(limited):
    with limited.client() as anonymous:
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/ready").status_code == 200
        assert anonymous.get("/metrics").status_code == 401
        assert anonymous.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    with authed(limited) as client:
        assert client.get("/metrics").status_code == 200

    url = limited.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url) as ws:
        frame = json.loads(ws.recv(timeout=30))
        assert frame["type"] == "error" and frame["error"]["type"] == "authentication_error"
    with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps({"type": "generate", "model": MODEL, "prompt": "x", "max_tokens": 2}))
        frames = [json.loads(ws.recv(timeout=30)) for _ in range(3)]
        assert [f["type"] for f in frames] == ["token", "token", "done"]


def test_sigterm_drains_running_streams_commits_and_exits_zero(tiny_checkpoint, tmp_path):
    # the stream must still run while the checks below are made, on a loaded machine too: 4000
    # tokens are seconds of decoding, and the grace period is far longer than they take (the
    # drain ends as soon as the stream has finished, so it costs nothing)
    env = {"XLSERVE_STATE_DIR": str(tmp_path / "state"), "XLSERVE_SHUTDOWN_GRACE_SECONDS": "120"}
    server = ServerProcess([tiny_checkpoint], env=env, log_path=tmp_path / "server.log").start()
    prompt, max_tokens = "def f():\n", 4000
    try:
        with server.client() as client:
            session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "session_id": session}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                server.process.send_signal(signal.SIGTERM)
                # not admitting any more: new requests 503, readiness 503, liveness fine
                deadline = time.monotonic() + 30
                while client.get("/ready").status_code != 503 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert client.get("/ready").status_code == 503
                assert client.get("/health").status_code == 200
                refused = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
                assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
                # ... while the running stream finishes normally
                events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()
    # the stream committed before the cache closed: a new server finds the session with it
    again = ServerProcess([tiny_checkpoint], env=env, log_path=tmp_path / "again.log").start()
    try:
        with again.client() as client:
            info = client.get(f"/v1/sessions/{session}").json()
            assert info["tokens"] == len(prompt) + max_tokens and info["version"] == 1
    finally:
        again.stop()


def running(client) -> float:
    return metric(client.get("/metrics").text, "xlserve_requests_running", model=MODEL)


def wait_until_idle(client, seconds: float = 30) -> float:
    deadline = time.monotonic() + seconds
    while running(client) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return running(client)


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "plain"])
def test_client_disconnect_cancels_and_commits_nothing(server, client, stream):
    session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
    body = {"model": MODEL, "prompt": "while True:\n", "max_tokens": 4000, "session_id": session, "stream": stream}
    if stream:
        with server.client() as patient, patient.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # the stream has started; now hang up
    else:
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=0.5)) as impatient:
            with pytest.raises(httpx.ReadTimeout):  # gives up after 0.5 s and closes the connection
                impatient.post("/v1/completions", json=body)
    assert wait_until_idle(client) == 0  # cancelled within a step, its batch slot freed
    info = client.get(f"/v1/sessions/{session}").json()
    assert info["tokens"] == 0 and info["version"] == 0
    again = client.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False})
    assert again.status_code == 200  # the lease was released
