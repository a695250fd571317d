"""The real server over real HTTP: completions, streaming, sessions, errors."""

import json
import math

import httpx
import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import metric

MODEL = "txl-tiny"


def complete(client, **fields):
    response = client.post("/v1/completions", json={"model": MODEL, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def parse_sse(text: str) -> list:
    events = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_health_ready_models(client):
    assert client.get("/health").json() == {"status": "ok", "engine": "ready"}
    assert client.get("/ready").status_code == 200
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["architecture"] == "transformer-xl"


def test_completion_is_openai_shaped_and_greedy_is_deterministic(client):
    first = complete(client, prompt="def main():\n", max_tokens=12, temperature=0)
    second = complete(client, prompt="def main():\n", max_tokens=12, temperature=0)
    assert first["object"] == "text_completion"
    choice = first["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == second["choices"][0]["text"]
    usage = {key: value for key, value in first["usage"].items() if key != "prompt_tokens_details"}
    assert usage == {"prompt_tokens": 12, "completion_tokens": 12, "total_tokens": 24}
    # the server is shared by the module's tests: what its prefix cache held before is theirs
    assert 0 <= first["usage"]["prompt_tokens_details"]["cached_tokens"] <= 12
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 12}  # the first one's prompt


def test_seed_reproduces_sampling(client):
    a = complete(client, prompt="x = ", max_tokens=16, temperature=1.0, seed=7)
    b = complete(client, prompt="x = ", max_tokens=16, temperature=1.0, seed=7)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_prompt_as_token_ids_equals_prompt_as_text(client):
    by_text = complete(client, prompt="abc", max_tokens=5, temperature=0)
    by_ids = complete(client, prompt=[97, 98, 99], max_tokens=5, temperature=0)
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]


def test_echo_logprobs_max_tokens_zero_scores_the_prompt(client):
    result = complete(client, prompt="import os\n", max_tokens=0, echo=True, logprobs=1)
    choice = result["choices"][0]
    assert choice["text"] == "import os\n"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][:3] == ["i", "m", "p"]
    assert logprobs["token_logprobs"][0] is None and all(lp < 0 for lp in logprobs["token_logprobs"][1:])
    # the most likely token and always the prompt's own (OpenAI: up to logprobs + 1 entries)
    assert all(token in top and 1 <= len(top) <= 2 for token, top in zip(logprobs["tokens"][1:], logprobs["top_logprobs"][1:]))
    assert result["usage"]["completion_tokens"] == 0


def test_streamed_completion_matches_non_streamed(client):
    plain = complete(client, prompt="class A:\n", max_tokens=10, temperature=0)
    with client.stream("POST", "/v1/completions", json={
        "model": MODEL, "prompt": "class A:\n", "max_tokens": 10, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.read().decode())
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 10
    text = "".join(c["text"] for e in events[:-2] for c in e["choices"])
    assert text == plain["choices"][0]["text"]
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_stop_string_ends_generation_and_is_not_returned(client):
    text = complete(client, prompt="def f():\n", max_tokens=20, temperature=0)["choices"][0]["text"]
    stop = text[3:5]
    assert stop
    result = complete(client, prompt="def f():\n", max_tokens=20, temperature=0, stop=[stop])
    choice = result["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[: text.find(stop)]


def test_session_is_continued_without_recomputation(client):
    session = client.post("/v1/sessions", json={"model": MODEL}).json()
    assert session["tokens"] == 0 and session["version"] == 0 and len(session["id"]) >= 32
    document = "import sys\n\ndef main(argv):\n    return len(argv)\n\n" * 3
    half = len(document) // 2
    first = client.post(f"/v1/sessions/{session['id']}/append", json={"text": document[:half], "score": True}).json()
    second = client.post(f"/v1/sessions/{session['id']}/append", json={"text": document[half:], "score": True}).json()
    assert first["session_tokens"] == half and second["session_tokens"] == len(document)
    assert second["cached_tokens"] == half

    # chunked scoring equals scoring the document in one append
    whole = client.post("/v1/sessions", json={"model": MODEL}).json()
    one = client.post(f"/v1/sessions/{whole['id']}/append", json={"text": document, "score": True}).json()
    assert math.isclose(first["logprob"] + second["logprob"], one["logprob"], rel_tol=1e-5, abs_tol=1e-3)
    assert one["scored_tokens"] == len(document) - 1
    assert math.isclose(one["bits_per_byte"], -one["logprob"] / math.log(2) / (len(document) - 1), rel_tol=1e-9)

    result = complete(client, prompt="if __name__", max_tokens=6, temperature=0, session_id=session["id"])
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == len(document)
    assert result["session_id"] == session["id"]
    info = client.get(f"/v1/sessions/{session['id']}").json()
    assert info["tokens"] == len(document) + len("if __name__") + 6
    assert info["version"] == 3 and info["state_bytes"] > 0 and info["tier"] == "device"

    # continuing the session equals one request over the whole history
    full = complete(client, prompt=document + "if __name__", max_tokens=6, temperature=0)
    assert result["choices"][0]["text"] == full["choices"][0]["text"]

    metrics = client.get("/metrics").text
    assert metric(metrics, "xlserve_memory_reused_tokens_total", model=MODEL) >= len(document)

    # an empty prompt continues from the memory alone
    more = complete(client, prompt="", max_tokens=3, temperature=0, session_id=session["id"])
    assert more["usage"]["completion_tokens"] == 3
    assert client.delete(f"/v1/sessions/{session['id']}").json()["deleted"] is True
    assert client.get(f"/v1/sessions/{session['id']}").status_code == 404


@pytest.mark.parametrize("fields, status, param", [
    ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"model": MODEL, "prompt": [1, 999]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "session_id": "sess_unknown"}, 404, "session_id"),
    ({"prompt": "x"}, 400, "model"),
])
def test_errors_use_one_schema(client, fields, status, param):
    response = client.post("/v1/completions", json=fields)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]


def test_unknown_session_routes_are_404(client):
    for method, path in [("GET", "/v1/sessions/sess_nope"), ("DELETE", "/v1/sessions/sess_nope"),
                         ("POST", "/v1/sessions/sess_nope/append")]:
        response = client.request(method, path, json={"text": "x"} if method == "POST" else None)
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found_error"


def test_prompt_over_the_limit_is_400(tiny_checkpoint, tmp_path):
    server = ServerProcess([tiny_checkpoint], env={"XLSERVE_MAX_PROMPT_BYTES": "8"}).start()
    try:
        with server.client() as client:
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": "123456789"})
            assert response.status_code == 400
            assert "limit is 8" in response.json()["error"]["message"]
    finally:
        server.stop()


def test_api_keys(tiny_checkpoint):
    server = ServerProcess([tiny_checkpoint], env={"XLSERVE_API_KEYS": "key-a,key-b"}).start()
    try:
        with server.client() as anonymous:
            assert anonymous.get("/health").status_code == 200
            assert anonymous.get("/ready").status_code == 200
            assert anonymous.get("/v1/models").status_code == 401
            response = anonymous.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        with server.client(headers={"Authorization": "Bearer wrong"}) as wrong:
            assert wrong.get("/v1/models").status_code == 401
        with server.client(headers={"Authorization": "Bearer key-a"}) as a, \
                server.client(headers={"Authorization": "Bearer key-b"}) as b:
            session = a.post("/v1/sessions", json={"model": MODEL}).json()["id"]
            assert a.get(f"/v1/sessions/{session}").status_code == 200
            assert b.get(f"/v1/sessions/{session}").status_code == 404  # another key's session does not exist
            assert b.post("/v1/completions", json={"model": MODEL, "prompt": "x", "session_id": session}).status_code == 404
    finally:
        server.stop()


def test_server_exits_cleanly_on_sigterm(tiny_checkpoint):
    server = ServerProcess([tiny_checkpoint]).start()
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.stop() == 0


def test_counters_exist_at_zero_before_their_first_event(client):
    """Every model's error, refusal, eviction and finish-reason counters are exported from the
    start, so that the first event reads as a rate above 0 and its alert can fire."""
    text = client.get("/metrics").text
    for series in (f'xlserve_request_errors_total{{code="session_cache_full",model="{MODEL}",type="service_unavailable"}}',
                   f'xlserve_request_errors_total{{code="session_busy",model="{MODEL}",type="session_busy"}}',
                   f'xlserve_session_refusals_total{{model="{MODEL}",tier="device"}}',
                   f'xlserve_session_evictions_total{{model="{MODEL}",tier="disk"}}',
                   f'xlserve_requests_total{{finish_reason="cancelled",model="{MODEL}"}}',
                   f'xlserve_prefix_cache_evictions_total{{model="{MODEL}"}}',
                   f'xlserve_engine_restarts_total{{model="{MODEL}"}}'):
        assert any(line.startswith(series + " ") for line in text.splitlines()), series
