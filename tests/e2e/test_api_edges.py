"""An API without surprises, against the real server (HTTP and websocket): unknown and unsupported
fields are refused by name on both, and so are unknown query parameters on every route; seeds,
temperature, top_p and logit_bias are checked where they enter; `prompt` takes OpenAI's list of
prompts; malformed JSON is located by line and column; text that cannot become UTF-8 and JSON
nested too deeply are 400s, never 500s, and the keep-alive connection stays usable after them.
The test process runs no model."""

from __future__ import annotations

import http.client
import json

import httpx
import pytest
from websockets.sync.client import connect

from tests.e2e.server_process import ServerProcess

MODEL = "txl-tiny"
ERROR_FIELDS = {"message", "type", "param", "code"}


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/stream"


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and error["message"]
    return error


def post_raw(client, path: str, body: bytes | str, content_type: str = "application/json") -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": content_type})


def text_of(client, **fields) -> list[str]:
    response = client.post("/v1/completions", json={"model": MODEL, **fields})
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in response.json()["choices"]]


def frame_answer(ws, frame: dict | str, timeout: float = 60) -> tuple[list[dict], dict]:
    """Send one frame; its token frames and its final done or error frame."""
    ws.send(frame if isinstance(frame, str) else json.dumps(frame))
    tokens = []
    while True:
        received = json.loads(ws.recv(timeout=timeout))
        if received["type"] == "token":
            tokens.append(received)
        else:
            return tokens, received


def still_usable(ws) -> None:
    tokens, done = frame_answer(ws, {"type": "generate", "model": MODEL, "prompt": "ok", "max_tokens": 2,
                                     "temperature": 0})
    assert done["type"] == "done" and len(tokens) == 2, done


# -- unknown query parameters: refused by name on every route, as unknown fields are ----------------


def test_a_misspelt_query_parameter_is_refused_instead_of_falling_back(client):
    """`import?modle=` used to import into the model named in the file; `?lmit=` listed 20."""
    session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
    assert client.post(f"/v1/sessions/{session}/append", json={"text": "x = 1\n"}).status_code == 200
    blob = client.get(f"/v1/sessions/{session}/state").content
    listed = lambda: {s["id"] for s in client.get("/v1/sessions", params={"limit": 100}).json()["data"]}  # noqa: E731
    before = listed()
    error = error_of(post_raw(client, "/v1/sessions/import?modle=no-such-model", blob, "application/octet-stream"))
    assert error["code"] == "unknown_parameter" and error["param"] == "modle"
    assert error["type"] == "invalid_request_error"
    assert "'modle'" in error["message"] and "takes only 'model'" in error["message"]
    assert listed() == before  # nothing was imported
    imported = post_raw(client, f"/v1/sessions/import?model={MODEL}", blob, "application/octet-stream")
    assert imported.status_code == 200, imported.text
    error = error_of(client.get("/v1/sessions", params={"limit": 1, "lmit": 5, "aftr": "x"}))
    assert error["param"] == "lmit" and "unknown query parameters 'lmit', 'aftr'" in error["message"]
    assert "takes only 'after', 'limit'" in error["message"]
    assert len(client.get("/v1/sessions", params={"limit": 1}).json()["data"]) == 1


def test_every_operation_refuses_an_unknown_query_parameter_and_takes_those_it_documents(client):
    """Every operation in /openapi.json answers an unknown query parameter with its documented
    400, before any work (a DELETE deletes nothing), and none of those it documents is unknown."""
    document = client.get("/openapi.json").json()
    session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
    checked = 0
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            url = path.replace("{session_id}", session).replace("{name}", MODEL)
            documented = {p["name"]: "1" for p in operation.get("parameters", []) if p["in"] == "query"}
            response = client.request(method.upper(), url, params={**documented, "extra": "1"})
            error = error_of(response)
            assert error["code"] == "unknown_parameter" and error["param"] == "extra", (method, path, error)
            assert "400" in operation["responses"], (method, path)
            checked += 1
    assert checked >= 19
    assert client.get(f"/v1/sessions/{session}").status_code == 200  # the DELETE above deleted nothing


# -- unknown and unsupported fields: refused by name, on HTTP and the websocket alike ------------------


@pytest.mark.parametrize("field, value", [("best_of", 2), ("suffix", "x"), ("temprature", 0.5),
                                          ("functions", [])])
def test_unknown_fields_are_refused_by_name_on_http_and_websocket(server, client, field, value):
    fields = {"model": MODEL, "prompt": "x", "max_tokens": 1, field: value}
    http_error = error_of(client.post("/v1/completions", json=fields))
    assert http_error["param"] == field and field in http_error["message"]
    with connect(ws_url(server)) as ws:
        _, frame = frame_answer(ws, {"type": "generate", "id": "r", **fields})
        assert frame["type"] == "error" and frame["id"] == "r"
        assert frame["error"]["param"] == field and frame["error"]["message"] == http_error["message"]
        still_usable(ws)


def test_nested_and_other_bodies_refuse_unknown_fields(client):
    error = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True,
                                                          "stream_options": {"include_usage": True, "extra": 1}}))
    assert error["param"] == "stream_options.extra"
    assert error_of(client.post("/v1/sessions", json={"model": MODEL, "ttl": 5}))["param"] == "ttl"
    error = error_of(client.post("/tokenize", json={"model": MODEL, "prompt": "x", "truncate": 1}))
    assert error["param"] == "truncate"


# -- sampling fields: what the engine cannot honour is refused, naming the field -----------------------


@pytest.mark.parametrize("fields, param", [
    ('"seed": -9223372036854775809', "seed"),  # -2**63 - 1: OpenAI's seeds are signed 64-bit integers
    ('"seed": 18446744073709551616', "seed"),  # 2**64
    ('"temperature": -0.5', "temperature"),
    ('"temperature": 2.5', "temperature"),
    ('"temperature": 1e400', "temperature"),  # JSON's way to write infinity: parsed as inf
    ('"top_p": -0.01', "top_p"),
    ('"top_p": 1.5', "top_p"),
    ('"top_p": -1e400', "top_p"),
    ('"logit_bias": {"not-a-token": 1}', "logit_bias"),
    ('"logit_bias": {"65": 100.5}', "logit_bias.65"),
    ('"logit_bias": {"256": 1}', "logit_bias"),  # the tiny model has 256 tokens
    ('"logit_bias": ' + json.dumps({str(token): 1 for token in range(301)}), "logit_bias"),
    ('"stop": ' + json.dumps("x" * 1001), "stop"),  # checked at every token, beside other requests
    ('"stop": ["a", "b", "c", "d", "e"]', "stop"),
])
def test_sampling_values_the_engine_cannot_honour_are_400(server, client, fields, param):
    body = '{"model": "txl-tiny", "prompt": "x", "max_tokens": 1, ' + fields + "}"
    error = error_of(post_raw(client, "/v1/completions", body))
    assert error["param"] == param, error
    with connect(ws_url(server)) as ws:
        _, frame = frame_answer(ws, '{"type": "generate", ' + body[1:])
        assert frame["type"] == "error" and frame["error"]["param"] == param, frame


def test_nan_is_not_json(client):
    error = error_of(post_raw(client, "/v1/completions", '{"model": "txl-tiny", "prompt": "x", "temperature": NaN}'))
    assert "not valid JSON" in error["message"] or "finite" in error["message"]


def test_edge_values_that_the_engine_defines_are_accepted(client):
    greedy = text_of(client, prompt="def f(", max_tokens=8, temperature=0)
    # temperature below 1e-5 is greedy; top_p below 1e-5 keeps only the most likely token
    assert text_of(client, prompt="def f(", max_tokens=8, temperature=1e-45) == greedy
    assert text_of(client, prompt="def f(", max_tokens=8, temperature=1.0, top_p=1e-45, seed=5) == greedy
    assert len(text_of(client, prompt="x", max_tokens=2, seed=2**64 - 1)) == 1
    assert len(text_of(client, prompt="x", max_tokens=2, seed=0)) == 1


def test_logit_bias_reaches_the_sampler_on_http_and_websocket(server, client):
    biased = text_of(client, prompt="def f(", max_tokens=4, temperature=0, logit_bias={"65": 100})
    assert biased == ["AAAA"]  # token 65 is "A" in the byte vocabulary
    with connect(ws_url(server)) as ws:
        tokens, done = frame_answer(ws, {"type": "generate", "model": MODEL, "prompt": "def f(", "max_tokens": 4,
                                         "temperature": 0, "logit_bias": {"66": 100}})
        assert done["type"] == "done" and "".join(t["text"] for t in tokens) + done["text"] == "BBBB"
    # a bias that forbids the greedy choice changes it
    def first_token(**fields) -> str:
        answer = client.post("/v1/completions", json={"model": MODEL, "prompt": "def f(", "max_tokens": 1,
                                                      "temperature": 0, "logprobs": 0, **fields})
        return answer.json()["choices"][0]["logprobs"]["tokens"][0]  # "a", or "<0xNN>" beyond ASCII

    greedy = first_token()
    token_id = ord(greedy) if len(greedy) == 1 else int(greedy[3:5], 16)
    assert first_token(logit_bias={str(token_id): -100}) != greedy


# -- prompt as a list of prompts -------------------------------------------------------------------------


def test_a_list_of_prompts_answers_each_with_openai_indexes(client):
    prompts = ["def a(", "class B:", "import "]
    singles = [text_of(client, prompt=p, max_tokens=5, temperature=0)[0] for p in prompts]
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 5, "n": 2,
                                                    "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    choices = body["choices"]
    assert [choice["index"] for choice in choices] == list(range(6))
    # index = prompt_index * n + choice_index
    assert [choice["text"] for choice in choices] == [text for text in singles for _ in range(2)]
    assert body["usage"]["prompt_tokens"] == sum(len(p.encode()) for p in prompts)
    assert body["usage"]["completion_tokens"] == 6 * 5
    # token-id lists too, with echo
    ids = [[100, 101, 102], [120, 121]]
    echoed = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2, "echo": True,
                                                  "temperature": 0}).json()["choices"]
    assert [choice["text"][:len(prompt)] for choice, prompt in zip(echoed, ids)] == ["def", "xy"]


def test_a_list_of_prompts_streams_with_the_same_indexes(client):
    prompts = ["def a(", "class B:"]
    plain = client.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 6, "n": 2,
                                                 "temperature": 0}).json()["choices"]
    texts, finish = {}, {}
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 6, "n": 2,
                                                        "temperature": 0, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    for event in events[:-2]:
        for choice in json.loads(event)["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert texts == {choice["index"]: choice["text"] for choice in plain}
    assert finish == {index: "length" for index in range(4)}


def sse_events(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_max_tokens_0_ends_every_choice_with_length_on_every_path(server, client):
    """The scoring pattern (max_tokens 0, echo, logprobs): every choice says why it ended, as
    OpenAI's does, unstreamed, streamed (a chunk with its finish_reason) and on the websocket
    alike (test_chat_and_tokenize.py: chat); before, only the websocket said so."""
    body = {"model": MODEL, "prompt": ["def a(", "class B:"], "max_tokens": 0, "n": 2, "echo": True, "logprobs": 1}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert [choice["finish_reason"] for choice in answer.json()["choices"]] == ["length"] * 4
    assert answer.json()["choices"][0]["text"] == "def a("
    finished = {choice["index"]: choice["finish_reason"] for event in sse_events(client, "/v1/completions", body)
                for choice in event["choices"] if choice["finish_reason"]}
    assert finished == {index: "length" for index in range(4)}


    with connect(ws_url(server)) as ws:
        _, done = frame_answer(ws, {"type": "generate", "model": MODEL, "prompt": "def a(", "max_tokens": 0})
    assert done["finish_reason"] == "length"


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ["a", "b"], "session_id": "sess_x"}, "prompt"),
    ({"prompt": ["a"] * 17}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[1, 2], [3, 999]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": {"text": "a"}}, "prompt"),
])
def test_bad_prompt_lists_are_400(client, fields, param):
    assert error_of(client.post("/v1/completions", json={"model": MODEL, "max_tokens": 1, **fields}))["param"] == param


def test_the_websocket_takes_one_prompt(server):
    with connect(ws_url(server)) as ws:
        _, frame = frame_answer(ws, {"type": "generate", "model": MODEL, "prompt": ["a", "b"]})
        assert frame["type"] == "error" and frame["error"]["param"] == "prompt"


# -- malformed JSON: located by line and column -----------------------------------------------------------


def test_malformed_json_names_line_and_column(server, client):
    error = error_of(post_raw(client, "/v1/completions", '{"model": "txl-tiny" "prompt": "x"}'))
    assert error["message"] == "body is not valid JSON: Expecting ',' delimiter at line 1, column 22"
    assert error["param"] is None
    error = error_of(post_raw(client, "/v1/completions", '{\n  "model": "txl-tiny",\n  "prompt": x\n}'))
    assert error["message"] == "body is not valid JSON: Expecting value at line 3, column 13"
    with connect(ws_url(server)) as ws:
        _, frame = frame_answer(ws, '{"type": "generate",\n "model" "txl-tiny"}')
        assert frame["error"]["code"] == "malformed_frame"
        assert frame["error"]["message"] == "frame is not valid JSON: Expecting ':' delimiter at line 2, column 10"
        still_usable(ws)


def test_bodies_that_are_not_json_objects_say_so(client):
    assert "JSON object" in error_of(post_raw(client, "/v1/completions", "[1, 2]"))["message"]
    assert "JSON object" in error_of(post_raw(client, "/v1/completions", "model=txl-tiny",
                                              "application/x-www-form-urlencoded"))["message"]
    assert "needs a JSON body" in error_of(post_raw(client, "/v1/completions", b""))["message"]
    assert "not valid UTF-8" in error_of(post_raw(client, "/v1/completions", b'{"model": "\xff"}'))["message"]


# -- text at the edges: what cannot become UTF-8 is a 400, and the connection stays usable ----------------

LONE = "\ud800"


class OneConnection:
    """Requests over one keep-alive connection (http.client reconnects silently when a
    connection was closed, so the socket is checked after every answer)."""

    def __init__(self, server):
        self.connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        self.connection.connect()
        self.socket = self.connection.sock

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        # json.dumps writes a lone surrogate as the escape \ud800: the JSON a client would send
        payload = None if body is None else json.dumps(body).encode("ascii")
        headers = {"content-type": "application/json"} if payload is not None else {}
        self.connection.request(method, path, body=payload, headers=headers)
        response = self.connection.getresponse()
        answer = json.loads(response.read())
        assert response.getheader("connection", "").lower() != "close"
        assert self.connection.sock is self.socket, "the server closed the keep-alive connection"
        return response.status, answer

    def close(self) -> None:
        self.connection.close()


def test_text_that_cannot_become_utf8_is_400_and_the_connection_stays_usable(server, client):
    session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
    refused = [
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "a" + LONE}, "prompt"),
        ("POST", "/v1/completions", {"model": MODEL + LONE, "prompt": "a"}, "model"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", "session_id": "sess_" + LONE}, "session_id"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", "stop": ["x", LONE]}, "stop"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": ["a", "b" + LONE]}, "prompt"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", "user": LONE}, "user"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", LONE: 1}, None),
        ("POST", f"/v1/sessions/{session}/append", {"text": "ab\udfff"}, "text"),
        ("POST", "/v1/sessions", {"model": LONE}, "model"),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONE}]},
         "messages.0.content"),
        ("POST", "/tokenize", {"model": MODEL, "prompt": LONE}, "prompt"),
        ("GET", "/v1/sessions/sess_%ED%A0%80", None, None),  # an encoded surrogate in the path
        ("GET", "/v1/sessions/sess_%FF", None, None),
        ("GET", "/v1/sessions?after=%ED%A0%80", None, None),
    ]
    connection = OneConnection(server)
    try:
        for method, path, body, param in refused:
            status, answer = connection.request(method, path, body)
            assert status == 400, (path, body, answer)
            assert set(answer["error"]) == ERROR_FIELDS and answer["error"]["param"] == param, answer
            assert "UTF-8" in answer["error"]["message"], answer
            assert answer["error"]["code"] == "invalid_text", answer  # in a body as in a URL
            # the same connection answers the next request
            status, answer = connection.request("POST", "/v1/completions",
                                                {"model": MODEL, "prompt": "ok", "max_tokens": 1})
            assert status == 200, answer
    finally:
        connection.close()
    # the session was not touched by the refused append
    assert client.get(f"/v1/sessions/{session}").json()["tokens"] == 0


def test_websocket_frames_with_text_that_cannot_become_utf8_are_malformed(server):
    with connect(ws_url(server)) as ws:
        for frame, param in [
            ({"type": "generate", "model": MODEL, "prompt": LONE}, "prompt"),
            ({"type": "generate", "model": MODEL, "prompt": "x", "stop": LONE}, "stop"),
            ({"type": "generate", "model": MODEL + LONE, "prompt": "x"}, "model"),
            ({"type": "generate", "model": MODEL, "prompt": "x", "session_id": LONE}, "session_id"),
            ({"type": "append", "session_id": "sess_x", "text": LONE}, "text"),
            ({"type": "generate", "id": LONE, "model": MODEL, "prompt": "x"}, "id"),
        ]:
            _, answer = frame_answer(ws, json.dumps(frame))
            assert answer["type"] == "error", answer
            assert answer["error"]["code"] == "malformed_frame" and answer["error"]["param"] == param, answer
            assert "UTF-8" in answer["error"]["message"]
        still_usable(ws)


# -- nesting depth and size limits -----------------------------------------------------------------------


def test_deeply_nested_json_is_400_on_http_and_malformed_on_the_websocket(server, client):
    deep = "[" * 100_000 + "]" * 100_000
    for body in (deep, '{"model": "txl-tiny", "prompt": ' + deep + "}", "[" * 33 + "]" * 33):
        error = error_of(post_raw(client, "/v1/completions", body))
        assert error["code"] == "json_too_deep" and "levels deep" in error["message"]
    # brackets inside strings are text, not nesting
    assert text_of(client, prompt="[" * 200, max_tokens=1, temperature=0)
    with connect(ws_url(server)) as ws:
        for frame in (deep, '{"type": "generate", "model": "txl-tiny", "prompt": ' + deep + "}"):
            _, answer = frame_answer(ws, frame)
            assert answer["type"] == "error" and answer["error"]["code"] == "malformed_frame", answer
            assert "levels deep" in answer["error"]["message"]
        still_usable(ws)


def test_json_nested_inside_a_string_field_is_a_400_not_a_500(client):
    """The body's depth check reads brackets inside strings as text; fields whose strings are
    themselves parsed as JSON (a schema given as text) are checked too (a tool call's arguments:
    tests/e2e/test_chat_and_tokenize.py)."""
    deep = "[" * 5_000 + "]" * 5_000
    for fields, param in (({"guided_json": deep}, "guided_json"),
                          ({"structured_outputs": {"json": deep}}, "structured_outputs.json")):
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, **fields})
        error = error_of(response)
        assert error["code"] == "invalid_response_format" and error["param"] == param, error
        assert "levels deep" in error["message"]


def test_a_body_sent_without_a_length_streams_its_answer(client):
    """A chunked body (no Content-Length) is read and replayed by admission; the streamed answer
    must still notice the client's end (the replay once recursed into itself: RecursionError)."""

    def chunks():
        yield b'{"model": "txl-tiny", "prompt": "def f(", '
        yield b'"max_tokens": 3, "temperature": 0, "stream": true}'

    with client.stream("POST", "/v1/completions", content=chunks(),
                       headers={"content-type": "application/json"}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2


@pytest.fixture(scope="module")
def small_server(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess([tiny_checkpoint], env={"XLSERVE_MAX_REQUEST_BODY_BYTES": "2000"},
                            log_path=tmp_path_factory.mktemp("logs") / "small.log").start()
    yield process
    process.stop()


def test_size_limits_on_bodies_and_frames(small_server):
    with small_server.client() as client:
        big = json.dumps({"model": MODEL, "prompt": "x" * 3000})
        assert error_of(post_raw(client, "/v1/completions", big), 413)["type"] == "request_too_large"

        def chunks():
            yield big.encode()[:1500]
            yield big.encode()[1500:]

        response = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert error_of(response, 413)["type"] == "request_too_large"
    with connect(ws_url(small_server)) as ws:
        _, answer = frame_answer(ws, json.dumps({"type": "generate", "model": MODEL, "prompt": "x" * 3000}))
        assert answer["type"] == "error" and answer["error"]["code"] == "malformed_frame", answer
        assert "2000 bytes" in answer["error"]["message"]
        still_usable(ws)
