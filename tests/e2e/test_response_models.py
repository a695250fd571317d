"""Against a real server, the answers a stand-in engine cannot give (tests/server/
test_response_models.py covers the stateless ones): the session routes, completions and
appends on a session, their remembered answers (Idempotency-Key), and the websocket's frames.
Each body, SSE chunk and frame is exactly an answer of its model in server/api/protocol.py:
valid, with nothing the model does not know and nothing it would leave out. The test process
runs no model."""

from __future__ import annotations

import json

from pydantic import TypeAdapter
from websockets.sync.client import connect

from tests.e2e.session_tools import MODEL, create, document
from xlserve.server.api.protocol import (
    AppendResponse,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorResponse,
    ForkedSession,
    SessionDeleted,
    SessionList,
    SessionObject,
    server_frame,
)


def fitting(model, response, status: int = 200) -> dict:
    """The JSON body of `response`, checked to be exactly an answer of `model`."""
    assert response.status_code == status, response.text
    body = response.json()
    adapter = TypeAdapter(model)
    assert adapter.dump_python(adapter.validate_python(body), mode="json", exclude_unset=True) == body
    return body


def streamed_chunks(client, body: dict, headers: dict | None = None) -> list[dict]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers or {}) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    adapter = TypeAdapter(CompletionStreamResponse)
    for chunk in chunks:
        assert adapter.dump_python(adapter.validate_python(chunk), mode="json", exclude_unset=True) == chunk
    return chunks


def test_session_routes_answer_with_their_models(client):
    session = fitting(SessionObject, client.post("/v1/sessions", json={"model": MODEL}))["id"]
    scored = fitting(AppendResponse, client.post(f"/v1/sessions/{session}/append",
                                                 json={"text": document(1), "score": True}))
    assert {"logprob", "scored_tokens", "bits_per_byte"} <= set(scored)
    plain = fitting(AppendResponse, client.post(f"/v1/sessions/{session}/append", json={"text": "x = 1\n"}))
    assert not {"logprob", "scored_tokens", "bits_per_byte"} & set(plain)  # only when asked for
    keyed = {"Idempotency-Key": "models-append"}
    first = client.post(f"/v1/sessions/{session}/append", json={"text": "y = 2\n", "score": True}, headers=keyed)
    again = client.post(f"/v1/sessions/{session}/append", json={"text": "y = 2\n", "score": True}, headers=keyed)
    assert fitting(AppendResponse, again) == fitting(AppendResponse, first)
    assert again.headers["idempotent-replayed"] == "true"

    info = fitting(SessionObject, client.get(f"/v1/sessions/{session}"))
    fork = fitting(ForkedSession, client.post(f"/v1/sessions/{session}/fork"))
    assert fork["forked_from"] == session and fork["tokens"] == info["tokens"]
    listed = fitting(SessionList, client.get("/v1/sessions", params={"limit": 1}))
    assert listed["first_id"] == listed["last_id"] == listed["data"][0]["id"] and listed["has_more"]

    exported = client.get(f"/v1/sessions/{session}/state")
    assert exported.status_code == 200 and exported.headers["content-type"] == "application/octet-stream"
    fitting(SessionObject, client.put(f"/v1/sessions/{fork['id']}/state", content=exported.content))
    imported = fitting(SessionObject, client.post("/v1/sessions/import", content=exported.content))
    assert imported["tokens"] == info["tokens"]
    assert fitting(SessionDeleted, client.delete(f"/v1/sessions/{imported['id']}")) == {
        "id": imported["id"], "object": "session", "deleted": True}
    fitting(ErrorResponse, client.get(f"/v1/sessions/{imported['id']}"), status=404)


def test_completions_on_a_session_and_their_remembered_answers_fit(client):
    session = create(client)
    body = {"model": MODEL, "prompt": document(2), "max_tokens": 4, "logprobs": 1, "echo": True,
            "session_id": session}
    answer = fitting(CompletionResponse, client.post("/v1/completions", json=body))
    assert answer["session_id"] == session and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    chunks = streamed_chunks(client, {**body, "prompt": "def f(", "stream_options": {"include_usage": True}})
    assert all(chunk["session_id"] == session for chunk in chunks) and chunks[-1]["usage"]["total_tokens"] > 0
    keyed = {"Idempotency-Key": "models-completion"}
    first = fitting(CompletionResponse, client.post("/v1/completions", json={**body, "prompt": "x"}, headers=keyed))
    again = client.post("/v1/completions", json={**body, "prompt": "x"}, headers=keyed)
    assert fitting(CompletionResponse, again) == first and again.headers["idempotent-replayed"] == "true"
    replayed = streamed_chunks(client, {**body, "prompt": "x", "stream_options": {"include_usage": True}}, keyed)
    assert replayed[-1]["usage"] == first["usage"]
    busy_or_missing = client.post("/v1/completions", json={**body, "session_id": "sess_missing"})
    fitting(ErrorResponse, busy_or_missing, status=404)


def test_websocket_frames_fit_server_frame(server):
    session = create_with(server)
    requests = [
        {"type": "generate", "id": "g", "model": MODEL, "prompt": "def f(", "max_tokens": 3, "logprobs": 2,
         "session_id": session},
        {"type": "generate", "id": "k", "model": MODEL, "prompt": "x", "max_tokens": 2, "session_id": session,
         "idempotency_key": "models-ws"},
        {"type": "generate", "id": "k2", "model": MODEL, "prompt": "x", "max_tokens": 2, "session_id": session,
         "idempotency_key": "models-ws"},  # remembered: one done frame, replayed
        {"type": "append", "id": "a", "session_id": session, "text": document(3), "score": True},
        {"type": "append", "id": "a2", "session_id": session, "text": "z = 3\n"},
        {"type": "generate", "id": "bad", "model": MODEL, "prompt": "x", "max_tokens": -1},
        {"type": "cancel"},
    ]
    frames = []
    with connect(server.url.replace("http://", "ws://") + "/v1/stream") as ws:
        for request in requests:
            ws.send(json.dumps(request))
            while True:
                frames.append(json.loads(ws.recv(timeout=60)))
                if frames[-1]["type"] != "token":
                    break
    for frame in frames:
        assert server_frame.dump_python(server_frame.validate_python(frame), mode="json", exclude_unset=True) == frame
    ends = [frame for frame in frames if frame["type"] != "token"]
    assert [(frame["id"], frame["type"]) for frame in ends] == [
        ("g", "done"), ("k", "done"), ("k2", "done"), ("a", "done"), ("a2", "done"), ("bad", "error"),
        (None, "error")]
    assert ends[2]["replayed"] is True and "replayed" not in ends[1]
    assert "bits_per_byte" in ends[3] and "bits_per_byte" not in ends[4]
    assert all("top_logprobs" in frame for frame in frames if frame["type"] == "token" and frame["id"] == "g")


def create_with(server) -> str:
    with server.client() as client:
        return create(client)
