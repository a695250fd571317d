"""A model that stops at its max_context, on a real server: a tiny random Reformer whose axial
positions (16 x 16) end at 256 tokens. A prompt or append that would take the context past them
is a 400 `context_length_exceeded` naming the limit and the length it would reach, refused
before anything runs (the session is as it was, the request beside it goes on untouched); a
generation that reaches the limit ends there with finish_reason "length"; a session a few
tokens short of its limit still works. And every other kind of user input on the generate,
append and import paths that the server cannot take (token ids, empty inputs, lengths, states)
is a 4xx too, never a 500. The test process runs no model.

(The fuzz test serves Transformer-XL only, which has no such limit: this file is where the
Reformer's is exercised.)"""

from __future__ import annotations

import json
import struct

import pytest
from websockets.sync.client import connect

from tests.e2e.server_process import ServerProcess, make_checkpoint
from tests.e2e.session_tools import append, create, fork, info, metric_total, ok

MODEL = "reformer-short"
LIMIT = 256  # its axial positions: 16 x 16
MAX_TOKENS_LIMIT = 200  # XLSERVE_MAX_TOKENS_LIMIT: long enough a stream that requests come beside it
MAX_PROMPT_BYTES = 1024  # XLSERVE_MAX_PROMPT_BYTES: above LIMIT, so the context is what refuses a long prompt
CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("weights") / MODEL, arch="reformer",
                                 config={"axial_pos_shape": [16, 16]})
    (checkpoint / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    server = ServerProcess([checkpoint], env={"XLSERVE_MAX_TOKENS_LIMIT": str(MAX_TOKENS_LIMIT),
                                              "XLSERVE_MAX_PROMPT_BYTES": str(MAX_PROMPT_BYTES)},
                           log_path=tmp_path_factory.mktemp("logs") / "context-limit.log").start()
    yield server
    server.stop()


@pytest.fixture
def client(served):
    with served.client() as c:
        yield c


def session_at(client, tokens: int) -> str:
    """A new session holding `tokens` bytes of history."""
    session = create(client, MODEL)
    assert append(client, session, "a" * tokens)["session_tokens"] == tokens
    return session


def refused(response, param: str, reach: str) -> dict:
    """The 400 context_length_exceeded answer, naming the limit and the length reached as `reach` says."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded", param)
    assert f"maximum context length of {LIMIT} tokens" in error["message"]
    assert f"would take the context to {reach}" in error["message"], error["message"]
    return error


def ws_answer(served, frame: dict) -> dict:
    """The last frame the websocket answers `frame` with (tokens skipped)."""
    with connect(served.url.replace("http", "ws") + "/v1/stream") as ws:
        ws.send(json.dumps({"id": "r1", **frame}))
        while True:
            answer = json.loads(ws.recv(timeout=60))
            if answer["type"] != "token":
                return answer


def test_the_card_names_the_limit(client):
    (card,) = ok(client.get("/v1/models"))["data"]
    assert card["max_context"] == LIMIT
    assert ok(client.post("/tokenize", json={"model": MODEL, "prompt": "x"}))["max_model_len"] == LIMIT


def test_a_completion_past_the_limit_is_400_naming_the_limit_and_the_length(served, client):
    long_prompt = {"model": MODEL, "prompt": "x" * 300, "max_tokens": 4}
    refused(client.post("/v1/completions", json=long_prompt), "prompt",
            "301 tokens (300 in the prompt + 1 to generate)")
    # streamed: refused before the stream starts, so it is an HTTP 400, not an error inside a 200
    refused(client.post("/v1/completions", json={**long_prompt, "stream": True}), "prompt", "301 tokens")
    # one of several prompts too long: the request is refused
    refused(client.post("/v1/completions", json={**long_prompt, "prompt": ["short", "x" * 300]}), "prompt",
            "301 tokens")
    # a prompt that fills the context exactly, scored without generating, fits
    scored = ok(client.post("/v1/completions", json={**long_prompt, "prompt": "x" * LIMIT, "max_tokens": 0,
                                                      "echo": True, "logprobs": 0}))
    assert len(scored["choices"][0]["logprobs"]["token_logprobs"]) == LIMIT

    session = session_at(client, 250)
    before = info(client, session)
    on_session = {"model": MODEL, "prompt": "b" * 6, "max_tokens": 4, "session_id": session}
    refused(client.post("/v1/completions", json=on_session), "prompt",
            "257 tokens (250 in the session's history + 6 in the prompt + 1 to generate)")
    answer = ws_answer(served, {"type": "generate", **on_session})
    assert answer["type"] == "error" and answer["id"] == "r1"
    assert (answer["error"]["code"], answer["error"]["param"]) == ("context_length_exceeded", "prompt")
    assert "257 tokens" in answer["error"]["message"]
    after = info(client, session)
    assert (after["tokens"], after["version"], after["in_use"]) == (before["tokens"], before["version"], False)

    # chat: the prompt the model measures is the rendered messages, the field at fault `messages`
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 4}
    rendered = len("<user>" + "x" * 300 + "\n<assistant>")
    refused(client.post("/v1/chat/completions", json=chat), "messages",
            f"{rendered + 1} tokens ({rendered} in the prompt + 1 to generate)")


def test_an_append_past_the_limit_is_400_and_leaves_the_session_as_it_was(served, client):
    refused(client.post(f"/v1/sessions/{create(client, MODEL)}/append", json={"text": "c" * 300}), "text",
            "300 tokens (300 in the appended text)")
    session = session_at(client, 250)
    before = info(client, session)
    refused(client.post(f"/v1/sessions/{session}/append", json={"text": "c" * 7}), "text",
            "257 tokens (250 in the session's history + 7 in the appended text)")
    refused(client.post(f"/v1/sessions/{session}/append", json={"text": [99] * 7}), "text", "257 tokens")
    answer = ws_answer(served, {"type": "append", "session_id": session, "text": "c" * 7})
    assert answer["type"] == "error" and answer["error"]["code"] == "context_length_exceeded"
    after = info(client, session)
    assert (after["tokens"], after["version"], after["in_use"]) == (250, before["version"], False)
    assert append(client, session, "c" * 6)["session_tokens"] == LIMIT  # exactly up to the limit fits


def test_a_session_a_few_tokens_short_of_its_limit_still_works(served, client):
    session = session_at(client, 250)
    assert append(client, session, "ddd", score=True)["session_tokens"] == 253
    # max_tokens past the room left: the generation ends where the context is full
    body = ok(client.post("/v1/completions", json={"model": MODEL, "prompt": "", "max_tokens": 16,
                                                    "temperature": 0, "session_id": session}))
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
    assert info(client, session)["tokens"] == LIMIT
    # the full session is read, forked and exported as any other; anything more is refused
    full_copies = [session, fork(client, session)]
    blob = client.get(f"/v1/sessions/{session}/state")
    assert blob.status_code == 200
    full_copies.append(ok(client.post("/v1/sessions/import", content=blob.content))["id"])
    for copy in full_copies:
        assert info(client, copy)["tokens"] == LIMIT
        refused(client.post("/v1/completions", json={"model": MODEL, "prompt": "", "max_tokens": 1,
                                                      "session_id": copy}),
                "prompt", "257 tokens (256 in the session's history + 1 to generate)")
        refused(client.post(f"/v1/sessions/{copy}/append", json={"text": "e"}), "text",
                "257 tokens (256 in the session's history + 1 in the appended text)")

    # streamed, and over the websocket, alike: 2 tokens left, finish_reason "length"
    streamed = session_at(client, 254)
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "", "max_tokens": 16,
                                                        "temperature": 0, "stream": True,
                                                        "session_id": streamed}) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert not any("error" in chunk for chunk in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
    done = ws_answer(served, {"type": "generate", "model": MODEL, "prompt": "", "max_tokens": 16,
                              "session_id": session_at(client, 254)})
    assert (done["type"], done["finish_reason"], done["usage"]["completion_tokens"], done["session_tokens"]) == \
        ("done", "length", 2, LIMIT)
    # a completion without a session stops at the limit too, every choice alike
    body = ok(client.post("/v1/completions", json={"model": MODEL, "prompt": "f" * 250, "max_tokens": 16, "n": 3}))
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 3
    assert body["usage"]["completion_tokens"] == 3 * 6


def test_the_request_beside_a_refused_one_is_unaffected(served, client):
    """A greedy stream on one session is running while requests past the limit are refused on
    the same model: it gets the text it gets alone, and the refusals were 400s.

    The stream is 200 tokens of a tiny model: on a loaded machine it can end before the refusals
    are answered. So the race is run again from a fresh fork, at most 4 times, until the stream
    was still running after them; every run checks the refusals and the stream's text."""
    source = session_at(client, 20)
    request = {"model": MODEL, "prompt": "def f(x):\n", "max_tokens": MAX_TOKENS_LIMIT, "temperature": 0}
    alone = ok(client.post("/v1/completions", json={**request, "session_id": fork(client, source)}))
    full = session_at(client, LIMIT)
    attempts = 4
    for attempt in range(1, attempts + 1):
        victim = fork(client, source)
        with client.stream("POST", "/v1/completions",
                           json={**request, "stream": True, "session_id": victim}) as response:
            chunks = (json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))
            first = next(chunks)
            with served.client() as other:
                refusals = [other.post("/v1/completions", json={**request, "session_id": full}),
                            other.post(f"/v1/sessions/{full}/append", json={"text": "g" * 3}),
                            other.post("/v1/completions", json={**request, "prompt": "h" * 400})]
                running = info(other, victim)["in_use"]  # the stream had not finished: the refusals came beside it
            choices = [first["choices"][0], *(chunk["choices"][0] for chunk in chunks)]
        assert [r.status_code for r in refusals] == [400] * 3, f"attempt {attempt}"
        assert all(r.json()["error"]["code"] == "context_length_exceeded" for r in refusals), f"attempt {attempt}"
        assert "".join(c["text"] for c in choices) == alone["choices"][0]["text"], f"attempt {attempt}"
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"], f"attempt {attempt}"
        assert info(client, victim)["tokens"] == 20 + len(request["prompt"]) + MAX_TOKENS_LIMIT
        assert info(client, full)["tokens"] == LIMIT
        if running:
            break
    else:
        raise AssertionError(f"the stream had ended before the refusals were answered in all {attempts} attempts")


# -- every other kind of user input these paths cannot take: a 4xx, never a 500 --------------------

def past_limit_state(blob: bytes) -> bytes:
    """An exported session state at the limit, rewritten (without its checksum) to claim one
    position more than the model has: metadata `tokens` and the `position` tensor both say 257
    (its key and value tensors still hold 256)."""
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    data = bytearray(blob[8 + length :])
    entry = header["state.position"]
    assert entry["dtype"] == "I64" and entry["shape"] == [1]
    start, end = entry["data_offsets"]
    data[start:end] = struct.pack("<q", LIMIT + 1)
    header["__metadata__"]["tokens"] = str(LIMIT + 1)
    del header["__metadata__"]["checksum"]
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + bytes(data)


CASES = {
    # token ids out of the vocabulary
    "prompt token id past the vocabulary": ("completion", {"prompt": [1, 256]}, 400, "prompt"),
    "negative prompt token id": ("completion", {"prompt": [-1]}, 400, "prompt"),
    "appended token id past the vocabulary": ("append", {"text": [1, 256]}, 400, "text"),
    # empty inputs
    "empty prompt on an empty session": ("completion", {"prompt": ""}, 400, "prompt"),
    "empty append": ("append", {"text": ""}, 400, "text"),
    "empty list of token ids appended": ("append", {"text": []}, 400, "text"),
    # lengths
    "max_tokens past the server's limit": ("completion", {"prompt": "x", "max_tokens": MAX_TOKENS_LIMIT + 1}, 400,
                                           "max_tokens"),
    "prompt past the server's byte limit": ("completion", {"prompt": "x" * (MAX_PROMPT_BYTES + 1)}, 400, "prompt"),
    "append past the server's byte limit": ("append", {"text": "x" * (MAX_PROMPT_BYTES + 1)}, 400, "text"),
    "prompt past the model's context": ("completion", {"prompt": "x" * (LIMIT + 1), "max_tokens": 0}, 400, "prompt"),
    "append past the model's context": ("append", {"text": "x" * (LIMIT + 1)}, 400, "text"),
    # states
    "a state past the model's context": ("import", past_limit_state, 400, "body"),
    "a state that is not one": ("import", lambda blob: b"\x00" * 64, 400, "body"),
    "a state cut short": ("import", lambda blob: blob[: len(blob) // 2], 400, "body"),
}


@pytest.mark.parametrize("name", CASES)
def test_user_input_that_cannot_run_is_a_4xx_never_a_500(served, client, name):
    path, change, status, param = CASES[name]
    session = create(client, MODEL)
    if path == "completion":
        response = client.post("/v1/completions", json={"model": MODEL, "session_id": session, **change})
    elif path == "append":
        response = client.post(f"/v1/sessions/{session}/append", json=change)
    else:
        exported = client.get(f"/v1/sessions/{session_at(client, LIMIT)}/state").content
        response = client.post("/v1/sessions/import", content=change(exported))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if path == "import":
        assert error["code"] == "invalid_state", error
    assert info(client, session)["tokens"] == 0  # nothing ran on the session


def test_no_request_here_was_answered_with_an_internal_error(client):
    """Run last in this module: whatever the tests above sent, no answer was a 500."""
    assert metric_total(client.get("/metrics").text, "xlserve_request_errors_total", model=MODEL,
                        type="internal_error") == 0
