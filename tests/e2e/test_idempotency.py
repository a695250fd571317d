"""Idempotency-Key against the real server without Redis (the disk tier keeps the keys): every
request that changes a session applies at most once per key, a retry gets the first answer
(with `Idempotent-Replayed: true`), and the same key with another request is refused (422)."""

from __future__ import annotations

import json

from websockets.sync.client import connect

from tests.e2e.session_tools import MODEL, append, create, document, info, ok


def keyed(name: str) -> dict:
    return {"Idempotency-Key": name}


def replayed(response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


def test_append_applies_once_per_key_and_a_different_body_is_refused(client):
    session = create(client)
    chunk = {"text": document(2), "score": True}
    first = client.post(f"/v1/sessions/{session}/append", json=chunk, headers=keyed("append-1"))
    again = client.post(f"/v1/sessions/{session}/append", json=chunk, headers=keyed("append-1"))
    assert first.status_code == again.status_code == 200, again.text
    assert again.json() == first.json() and replayed(again) and not replayed(first)
    assert (info(client, session)["version"], info(client, session)["tokens"]) == (1, len(document(2)))

    other = client.post(f"/v1/sessions/{session}/append", json={"text": "else"}, headers=keyed("append-1"))
    assert other.status_code == 422, other.text
    error = other.json()["error"]
    assert error["code"] == "idempotency_key_reused" and error["type"] == "invalid_request_error"
    assert info(client, session)["version"] == 1  # nothing applied
    bad = client.post(f"/v1/sessions/{session}/append", json=chunk, headers=keyed("x" * 256))
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_idempotency_key"


def test_a_completion_on_a_session_applies_once_streamed_or_not(client):
    session = create(client)
    append(client, session, document(3))
    body = {"model": MODEL, "prompt": "def f(", "max_tokens": 8, "temperature": 0.9, "seed": 5,
            "session_id": session}
    first = client.post("/v1/completions", json=body, headers=keyed("completion-1"))
    assert first.status_code == 200, first.text
    after_first = info(client, session)
    again = client.post("/v1/completions", json=body, headers=keyed("completion-1"))
    assert again.json() == first.json() and replayed(again)  # the same answer, id included
    with client.stream("POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                       headers=keyed("completion-1")) as streamed:
        assert streamed.status_code == 200 and replayed(streamed)
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == first.json()["choices"][0]["text"]
    assert chunks[-1]["usage"] == first.json()["usage"]
    assert info(client, session)["version"] == after_first["version"]  # three requests, one change

    # a streamed request with a key, retried without streaming: the same request, applied once
    streamed_body = {**body, "prompt": "class C:", "stream": True}
    with client.stream("POST", "/v1/completions", json=streamed_body, headers=keyed("completion-2")) as streamed:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed.iter_lines()
                       if line.startswith("data: {"))
    retried = client.post("/v1/completions", json={**streamed_body, "stream": False}, headers=keyed("completion-2"))
    assert replayed(retried) and retried.json()["choices"][0]["text"] == text
    assert info(client, session)["version"] == after_first["version"] + 1


def test_an_answer_too_large_to_remember_is_a_413_and_commits_nothing(client):
    """A keyed completion whose answer (echo and logprobs over a long prompt) passes what a session
    remembers under an Idempotency-Key is refused before its commit, 413 naming the limit: the
    session is as it was, and the engine process serves on (the answer once travelled whole in a
    frame header past its bound and stopped the engine process for every session)."""
    session = create(client)
    append(client, session, document(1))
    before = info(client, session)
    body = {"model": MODEL, "prompt": document(2, repeat=150), "max_tokens": 1, "echo": True, "logprobs": 5,
            "temperature": 0, "session_id": session}
    refused = client.post("/v1/completions", json=body, headers=keyed("large-1"))
    assert refused.status_code == 413, refused.text
    error = refused.json()["error"]
    assert error["code"] == "remembered_answer_too_large" and error["param"] == "Idempotency-Key"
    assert "Idempotency-Key" in error["message"] and str(1 << 20) in error["message"]
    assert info(client, session)["version"] == before["version"]  # nothing committed
    answered = client.post("/v1/completions", json=body)  # without the key: answered and committed
    assert answered.status_code == 200, answered.text
    assert info(client, session)["version"] == before["version"] + 1


def test_fork_replace_and_delete_answer_their_retry_the_same(client):
    source = create(client)
    append(client, source, document(4))
    fork = client.post(f"/v1/sessions/{source}/fork", headers=keyed("fork-1"))
    again = client.post(f"/v1/sessions/{source}/fork", headers=keyed("fork-1"))
    assert fork.status_code == again.status_code == 200
    assert again.json()["id"] == fork.json()["id"] and replayed(again)

    blob = client.get(f"/v1/sessions/{source}/state").content
    target = create(client)
    put = client.put(f"/v1/sessions/{target}/state", content=blob, headers=keyed("put-1"))
    put_again = client.put(f"/v1/sessions/{target}/state", content=blob, headers=keyed("put-1"))
    assert put.status_code == put_again.status_code == 200 and replayed(put_again)
    assert put_again.json()["version"] == put.json()["version"] == 1 == info(client, target)["version"]

    fork_id = fork.json()["id"]
    deleted = client.delete(f"/v1/sessions/{fork_id}", headers=keyed("delete-1"))
    deleted_again = client.delete(f"/v1/sessions/{fork_id}", headers=keyed("delete-1"))
    assert deleted.status_code == deleted_again.status_code == 200 and replayed(deleted_again)
    assert deleted_again.json() == deleted.json()
    assert client.delete(f"/v1/sessions/{fork_id}").status_code == 404  # gone, for anything else
    assert client.delete(f"/v1/sessions/{fork_id}", headers=keyed("delete-2")).status_code == 404


def test_websocket_append_and_generate_take_a_key(server, client):
    session = create(client)
    url = server.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url) as ws:
        for attempt in range(2):
            ws.send(json.dumps({"type": "append", "id": f"a{attempt}", "session_id": session, "text": document(5),
                                "idempotency_key": "ws-append"}))
            done = json.loads(ws.recv(timeout=60))
            assert done["type"] == "done" and done["version"] == 1, done
            assert done.get("replayed", False) == (attempt == 1)
        texts = []
        for attempt in range(2):
            ws.send(json.dumps({"type": "generate", "id": f"g{attempt}", "model": MODEL, "prompt": "", "max_tokens": 6,
                                "temperature": 0, "session_id": session, "idempotency_key": "ws-generate"}))
            tokens = []
            while (frame := json.loads(ws.recv(timeout=60)))["type"] == "token":
                tokens.append(frame["text"])
            assert frame["type"] == "done" and frame["version"] == 2, frame
            texts.append("".join(tokens) + frame["text"])
            assert frame.get("replayed", False) == (attempt == 1)
        assert texts[0] == texts[1]  # the replay's done frame carries the whole text
    assert ok(client.get(f"/v1/sessions/{session}"))["tokens"] == len(document(5)) + 6


def test_create_and_import_with_a_key_make_one_session_however_often_retried(client):
    made = client.post("/v1/sessions", json={"model": MODEL}, headers=keyed("create-1"))
    again = client.post("/v1/sessions", json={"model": MODEL}, headers=keyed("create-1"))
    assert made.status_code == again.status_code == 200 and not replayed(made) and replayed(again)
    session = made.json()["id"]
    assert again.json()["id"] == session
    append(client, session, document(5))
    later = client.post("/v1/sessions", json={"model": MODEL}, headers=keyed("create-1"))
    assert later.json()["id"] == session and later.json()["tokens"] == info(client, session)["tokens"] > 0
    other = client.post("/v1/sessions", json={"model": "no-such-model"}, headers=keyed("create-1"))
    assert other.status_code == 404  # the model is checked first, as without a key

    blob = client.get(f"/v1/sessions/{session}/state").content
    imported = client.post("/v1/sessions/import", content=blob, headers=keyed("import-1"))
    imported_again = client.post("/v1/sessions/import", content=blob, headers=keyed("import-1"))
    assert imported.status_code == imported_again.status_code == 200 and replayed(imported_again)
    assert imported_again.json()["id"] == imported.json()["id"] != session
    refused = client.post("/v1/sessions/import", content=blob, headers=keyed("create-1"))
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "idempotency_key_reused"
    ids = [s["id"] for s in ok(client.get("/v1/sessions", params={"limit": 100}))["data"]]
    assert ids.count(session) == 1 and ids.count(imported.json()["id"]) == 1

    assert client.delete(f"/v1/sessions/{session}").status_code == 200
    spent = client.post("/v1/sessions", json={"model": MODEL}, headers=keyed("create-1"))
    assert spent.status_code == 422 and "deleted since" in spent.json()["error"]["message"]
    bad = client.post("/v1/sessions", json={"model": MODEL}, headers=keyed("two words"))
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_idempotency_key"
