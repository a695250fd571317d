"""Requests at the API's edges, answered as the house rules say: a user error is a 4xx naming the
field the client sent (never a 500, never taken silently as something else), OpenAI's nullable
parameters take null as their default, an answer that is not streamed is bounded in what it
builds, a registered error keeps its declared status, bits per byte divides by bytes, and a
websocket request whose client left at once is no longer counted as running.

The app `build_app` makes, with a stand-in for the engine process (tests/server/scripted_engine.py):
through starlette's test client, or driven as an ASGI application where a test must place a
client's close exactly."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import pytest
from starlette.testclient import TestClient

from xlserve.models.tokenizer import ByteTokenizer, WordTokenizer
from xlserve.server.api.chat import ChatTemplate
from xlserve.server.api.deps import AppState, ServedModel
from xlserve.server.api.protocol import MAX_GENERATED_LOGPROBS, CompletionRequest
from xlserve.server.api.serving import Completion, stream_completion
from xlserve.server.api.serving.requests import error_for
from xlserve.server.app import build_app
from xlserve.server.cache.errors import CorruptState, SessionInfo
from xlserve.server.engine.client import RemoteLease
from xlserve.server.engine.types import Appended, ChoiceFinished, Finished, Submission, TokenEvent
from xlserve.server.errors import RAISED_CODES
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings

from tests.server.scripted_engine import ScriptedEngine

MODEL, WORDS, SESSION = "m", "words", "s1"
CARD = {"id": MODEL, "object": "model", "created": 0, "owned_by": "xlserve", "architecture": "transformer-xl",
        "state_kind": "segment-recurrence", "state_grows_with_context": False, "max_context": None,
        "parameters": 0, "config": {}, "quantize": "none", "weight_bytes": 0, "state_bytes_per_session": 9216}
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
MESSAGES = [{"role": "user", "content": "hi"}]
# a word-level vocabulary without <unk>: the chat template's "<user>hi" is not in it
WORD_SYMBOLS = ["hello", "world", "again", "<a>", "<eos>"]


def session_info(model: str = MODEL, tokens: int = 0) -> SessionInfo:
    return SessionInfo(SESSION, model, None, tokens, 0, 10, "device", 0.0, 0.0)


class SessionEngine(ScriptedEngine):
    """A scripted engine that also holds sessions: `acquire` leases one (of `session_model`, with
    `session_tokens` in its memory), `release` counts, an append answers `appended`, `submit`
    records the sampling parameters it was given."""

    def __init__(self, metrics: Metrics):
        super().__init__(metrics)
        self.session_model, self.session_tokens = MODEL, 0
        self.appended = Appended(None, 0.0, 0)
        self.acquired = self.released = 0
        self.submitted: list = []

    async def acquire(self, session_id, owner, key):
        self.acquired += 1
        return RemoteLease(1, session_id, session_info(self.session_model, self.session_tokens),
                           self.session_tokens > 0)

    def release(self, lease):
        self.released += 1

    async def submit(self, model, tokens, params, lease, scope, owner=None):
        self.submitted.append(params)
        return await super().submit(model, tokens, params, lease, scope, owner)

    async def append(self, lease, tokens, score, **_):
        submission = Submission(self.session_model, self.metrics, threading.Event(), wake=lambda: None)
        submission.queue.put_nowait(self.appended)
        return submission

    async def commit(self, lease, result=None):
        return session_info(self.session_model, self.session_tokens + 1)


def make_app(**settings_overrides):
    settings = Settings(models="none-loaded", max_request_body_bytes=100_000, **settings_overrides)
    app = build_app(settings)
    metrics = Metrics()
    state = AppState(settings=settings, metrics=metrics, ready=True)
    state.engine = SessionEngine(metrics)
    # one token and the end: a request that reaches the engine is answered (where a test expects a
    # refusal, code without that refusal then fails the test instead of waiting for events forever)
    state.engine.events = [one_token(), *finished()]
    state.models = {MODEL: ServedModel(MODEL, ByteTokenizer(), 256, CARD, ChatTemplate(TEMPLATE, "test")),
                    WORDS: ServedModel(WORDS, WordTokenizer(WORD_SYMBOLS), len(WORD_SYMBOLS), {**CARD, "id": WORDS},
                                       ChatTemplate(TEMPLATE, "test"))}
    app.state.xlserve = state
    return app, state


@pytest.fixture
def served():
    """(client, state): the app with a byte-level model and a word-level one, both with a chat template."""
    app, state = make_app()
    client = TestClient(app)  # not entered: no lifespan, no engine process
    yield client, state
    client.close()


def one_token(text: str = "h", index: int = 0, top=()) -> TokenEvent:
    return TokenEvent(ord(text), text, -0.5, list(top), index=index)


def finished(choices: int = 1) -> list:
    ends = [ChoiceFinished(index, "length", "", 1) for index in range(choices)]
    return [*ends, Finished(ends, 2, choices, 0, None)]


def error_of(response) -> dict:
    assert 400 <= response.status_code < 600, response.text
    return response.json()["error"]


# -- 1. a websocket request whose client closes at once ---------------------------------------------


async def websocket_session(app, frame: dict) -> list[dict]:
    """One websocket connection that sends `frame` and closes, both already queued when the server
    reads the first: it reads the close right after it started the request, before the request's
    task took a step. Returns what the server sent."""
    incoming: asyncio.Queue = asyncio.Queue()
    for message in ({"type": "websocket.connect"}, {"type": "websocket.receive", "text": json.dumps(frame)},
                    {"type": "websocket.disconnect", "code": 1000}):
        incoming.put_nowait(message)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {"type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "ws",
             "path": "/v1/stream", "raw_path": b"/v1/stream", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"test")], "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "subprotocols": []}
    await app(scope, incoming.get, send)
    return sent


@pytest.mark.parametrize("frame", [
    {"type": "generate", "model": MODEL, "prompt": "ab", "max_tokens": 1, "session_id": SESSION},
    {"type": "generate", "model": MODEL, "prompt": "ab", "max_tokens": 1},
    {"type": "append", "session_id": SESSION, "text": "abc"},
], ids=["generate-on-a-session", "generate", "append"])
def test_a_websocket_request_whose_client_closes_at_once_is_no_longer_in_flight(frame):
    app, state = make_app()
    engine = state.engine
    engine.events = [one_token(), *finished()]
    asyncio.run(websocket_session(app, frame))
    # shutdown's drain waits while this is above 0
    assert state.inflight == 0
    # the generation's frames were closed as the connection ended, not left to the garbage
    # collector: the session it held is free again
    assert engine.released == engine.acquired


# -- 2. an empty session_id ---------------------------------------------------------------------------


def test_an_empty_session_id_is_refused_naming_it(served):
    client, state = served
    state.engine.events = [one_token(), *finished()]
    error = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "session_id": ""}))
    assert (error["type"], error["param"]) == ("invalid_request_error", "session_id")
    with client.websocket_connect("/v1/stream") as websocket:
        for frame in ({"type": "append", "id": "a", "session_id": "", "text": "abc"},
                      {"type": "generate", "id": "g", "model": MODEL, "prompt": "ab", "session_id": ""}):
            websocket.send_text(json.dumps(frame))
            answer = json.loads(websocket.receive_text())
            assert answer["type"] == "error" and answer["id"] == frame["id"]
            assert (answer["error"]["type"], answer["error"]["param"]) == ("invalid_request_error", "session_id")
    assert state.engine.acquired == 0 and state.engine.submitted == []  # nothing reached the engine


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_another_method_on_the_import_route_is_405_allow_post_not_a_missing_session(served, method):
    """/v1/sessions/import takes POST only; GET or DELETE there fell to /v1/sessions/{session_id}
    and answered 404 for a session named "import"."""
    client, state = served
    response = client.request(method, "/v1/sessions/import")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert "POST" in error_of(response)["message"]
    assert state.engine.acquired == 0


def test_an_append_too_large_or_empty_is_refused_before_its_session_is_fetched():
    """An append's size limit and its emptiness need no model: refused before the lease (which may
    bring the session back from disk or Redis, moving others off the device), not after it."""
    app, state = make_app(max_prompt_bytes=10)
    client = TestClient(app)
    for text, code in (("x" * 11, "prompt_too_long"), ("", None), ([1] * 11, "prompt_too_long"), ([], None)):
        error = error_of(client.post("/v1/sessions/sess_0123456789abcdef0123456789abcdef/append", json={"text": text}))
        assert (error["param"], error["code"]) == ("text", code), text
    assert state.engine.acquired == 0


def test_the_bound_on_generated_logprobs_comes_before_the_prompts_are_tokenized(served):
    """It needs only the number of prompts: a request past it is refused before up to 16 prompts
    of up to XLSERVE_MAX_PROMPT_BYTES each are tokenized (here, one whose token id would be refused
    when tokenized)."""
    client, state = served
    body = {"model": MODEL, "prompt": [[999_999]] * 16, "logprobs": 20, "max_tokens": 4096}
    error = error_of(client.post("/v1/completions", json=body))
    assert error["code"] == "generated_logprobs_too_large"


# -- 3. null for OpenAI's nullable parameters ---------------------------------------------------------

COMPLETION_NULLS = ["prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "echo", "logprobs",
                    "stop", "seed", "logit_bias", "presence_penalty", "frequency_penalty"]
CHAT_NULLS = ["temperature", "top_p", "n", "stream", "stream_options", "max_tokens", "max_completion_tokens",
              "logprobs", "top_logprobs", "stop", "seed", "logit_bias", "presence_penalty", "frequency_penalty",
              "parallel_tool_calls"]  # the last as vLLM takes it (Optional[bool]), which clients send null for


def test_null_means_the_default_for_every_nullable_completion_parameter(served):
    client, state = served
    state.engine.events = [one_token(), *finished()]
    engine = state.engine
    state.engine.session_tokens = 3  # a null prompt is "": the session's memory is continued
    body = {"model": MODEL, "session_id": SESSION, **{name: None for name in COMPLETION_NULLS}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "text_completion" and len(answer["choices"]) == 1  # not streamed, n 1
    assert answer["choices"][0]["text"] == "h" and answer["choices"][0]["logprobs"] is None  # no echo, no logprobs
    params = engine.submitted[-1]
    assert (params.max_tokens, params.temperature, params.top_p, params.n, params.echo) == (16, 1.0, 1.0, 1, False)
    assert (params.presence_penalty, params.frequency_penalty, params.stop, params.seed) == (0.0, 0.0, [], None)


def test_null_means_the_default_for_every_nullable_chat_parameter(served):
    client, state = served
    state.engine.events = [one_token(), *finished()]
    body = {"model": MODEL, "messages": MESSAGES, **{name: None for name in CHAT_NULLS}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion" and len(answer["choices"]) == 1
    assert answer["choices"][0]["logprobs"] is None
    params = state.engine.submitted[-1]
    # no max_tokens of either name: the server's limit, as without them
    assert (params.max_tokens, params.temperature, params.top_p, params.n, params.logprobs) == (
        state.settings.server.max_tokens_limit, 1.0, 1.0, 1, None)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"model": MODEL, "prompt": "ab"}, "prefix_cache"),
    ("/v1/completions", {"model": MODEL, "prompt": "ab"}, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}, "messages"),
])
def test_null_stays_refused_where_openai_does_not_take_it(served, path, body, field):
    client, _ = served
    error = error_of(client.post(path, json={**body, field: None}))
    assert (error["type"], error["param"]) == ("invalid_request_error", field)


def test_a_websocket_generate_frame_keeps_refusing_null(served):
    client, _ = served
    with client.websocket_connect("/v1/stream") as websocket:
        websocket.send_text(json.dumps({"type": "generate", "model": MODEL, "prompt": "ab", "temperature": None}))
        answer = json.loads(websocket.receive_text())
    assert answer["type"] == "error" and answer["error"]["param"] == "temperature"


def test_a_websocket_frame_id_is_bounded_and_a_longer_one_is_not_echoed(served):
    """A frame's id is echoed in every frame of its answer, a token frame each token: an id of
    megabytes was sent back that many times over (and kept, unread, by a client that stops
    reading). Past MAX_FRAME_ID characters the frame is refused naming the id, which its error
    frame does not echo."""
    from xlserve.server.api.protocol import MAX_FRAME_ID

    client, _ = served
    with client.websocket_connect("/v1/stream") as websocket:
        for kind in ({"type": "generate", "model": MODEL, "prompt": "ab"}, {"type": "cancel"}):
            websocket.send_text(json.dumps({**kind, "id": "x" * (MAX_FRAME_ID + 1)}))
            answer = json.loads(websocket.receive_text())
            assert answer["type"] == "error" and answer["id"] is None and answer["error"]["param"] == "id", answer


# -- 4. the log-probabilities of an answer that is not streamed ---------------------------------------


def test_generated_logprobs_past_the_bound_are_refused_without_streaming(served):
    client, state = served
    state.engine.events = [one_token(), *finished(16)]
    limit = state.settings.server.max_tokens_limit
    # at the bound's edge: 16 choices x the token limit x (logprobs + 1)
    fits = next(k for k in range(20, -1, -1) if 16 * limit * (k + 1) <= MAX_GENERATED_LOGPROBS)
    body = {"model": MODEL, "prompt": "ab", "n": 16, "max_tokens": limit}
    assert client.post("/v1/completions", json={**body, "logprobs": fits}).status_code == 200
    error = error_of(client.post("/v1/completions", json={**body, "logprobs": fits + 1}))
    assert (error["param"], error["code"]) == ("logprobs", "generated_logprobs_too_large")
    assert "max_tokens" in error["message"]
    # OpenAI's worst case: 16 prompts x 16 choices x 4096 tokens x 21
    error = error_of(client.post("/v1/completions", json={**body, "prompt": ["ab"] * 16, "logprobs": 20}))
    assert (error["param"], error["code"]) == ("logprobs", "generated_logprobs_too_large")
    assert f"{16 * 16 * limit * 21:,}" in error["message"]
    assert RAISED_CODES["generated_logprobs_too_large"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_are_exactly_the_alternatives_asked_for(served, stream):
    """Chat lists top_logprobs alternatives per token, as OpenAI and vLLM do: logprobs alone gives
    none, top_logprobs k gives k, whether or not the chosen token is among them (completions' list
    adds the chosen token). A temperature-0 test never sees the difference: the chosen token is
    then the most likely."""
    client, state = served
    alternatives = [(ord("a"), -1.0), (ord("b"), -2.0)]
    for asked, expected in ((None, []), (2, ["a", "b"])):
        state.engine.events = [one_token("h", top=alternatives[: asked or 0]), *finished()]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "max_tokens": 1,
                "stream": stream, **({"top_logprobs": asked} if asked is not None else {})}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: {")]
            content = [entry for chunk in chunks for choice in chunk["choices"]
                       for entry in ((choice.get("logprobs") or {}).get("content") or [])]
        else:
            content = response.json()["choices"][0]["logprobs"]["content"]
        assert [entry["token"] for entry in content] == ["h"]
        assert [top["token"] for top in content[0]["top_logprobs"]] == expected, asked
    state.engine.events = [one_token("h", top=alternatives), *finished()]
    completion = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "logprobs": 2, "max_tokens": 1})
    assert list(completion.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == ["a", "b", "h"]  # as before


def test_chat_logprobs_past_the_bound_name_the_chat_fields(served):
    client, state = served
    state.engine.events = [one_token(), *finished(16)]
    limit = state.settings.server.max_tokens_limit
    body = {"model": MODEL, "messages": MESSAGES, "n": 16, "logprobs": True, "top_logprobs": 20}
    # no max tokens given: the server's limit, which the message names under chat's name
    error = error_of(client.post("/v1/chat/completions", json=body))
    assert (error["param"], error["code"]) == ("top_logprobs", "generated_logprobs_too_large")
    assert f"max_tokens={limit}" in error["message"]
    error = error_of(client.post("/v1/chat/completions", json={**body, "max_completion_tokens": limit}))
    assert f"max_completion_tokens={limit}" in error["message"]


def test_a_streamed_answer_has_no_bound_and_keeps_no_logprobs_it_sent(served):
    """A stream sends each token's log-probabilities in its chunk, as it comes: it is not refused
    by the bound, and it does not keep them (its memory does not grow with them)."""
    client, state = served
    limit = state.settings.server.max_tokens_limit
    state.engine.events = [one_token("a", top=[(97, -0.5)]), one_token("b", index=1, top=[(98, -0.5)]), *finished(2)]
    body = {"model": MODEL, "prompt": ["ab"] * 16, "n": 16, "max_tokens": limit, "logprobs": 20, "stream": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200 and "generated_logprobs_too_large" not in response.text

    async def streamed() -> tuple[Completion, list[dict]]:
        state.engine.events = [one_token("a", top=[(97, -0.5)]), *finished()]
        request = CompletionRequest(model=MODEL, prompt="x", max_tokens=3, logprobs=1, stream=True)
        completion = Completion(state, request, None)
        answer = await stream_completion(completion)
        text = b"".join([chunk async for chunk in answer.body_iterator]).decode()
        events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
        return completion, [json.loads(event) for event in events if event != "[DONE]"]

    completion, chunks = asyncio.run(streamed())
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == ["a"]  # sent in its chunk
    assert completion.choices[0].logprobs["tokens"] == []  # and not kept


# -- 5. chat errors name chat's fields ----------------------------------------------------------------


def test_chat_errors_name_the_fields_the_chat_request_has():
    app, state = make_app(max_prompt_bytes=5)
    client = TestClient(app)  # not entered: no lifespan, no engine process
    error = error_of(client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}))
    assert (error["param"], error["code"]) == ("messages", "prompt_too_long")
    app, state = make_app()
    client = TestClient(app)
    error = error_of(client.post("/v1/chat/completions", json={"model": WORDS, "messages": MESSAGES}))
    assert (error["param"], error["code"]) == ("messages", "word_not_in_vocabulary")
    too_many = state.settings.server.max_tokens_limit + 1
    for field in ("max_completion_tokens", "max_tokens"):
        error = error_of(client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                   field: too_many}))
        assert error["param"] == field and error["message"].startswith(f"{field} is {too_many}")
    # the completion it runs as still names its own
    error = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": too_many}))
    assert error["param"] == "max_tokens"


# -- 6. a registered error that is also a ValueError ---------------------------------------------------


def test_a_registered_error_keeps_its_status_even_when_it_is_a_value_error(served):
    client, state = served
    corrupt = CorruptState("checksum mismatch at /var/lib/xlserve/s1")
    assert isinstance(corrupt, ValueError)
    assert (error_for(corrupt).status, error_for(corrupt).message) == (500, "internal error: CorruptState")
    assert error_for(ValueError("the engine could not run it")).status == 400  # a plain one is the request's
    internal = {"message": "internal error: CorruptState", "type": "internal_error", "param": None, "code": None}
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 1}
    state.engine.events = [corrupt]
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 500 and response.json()["error"] == internal
    state.engine.events = [corrupt]
    response = client.post("/v1/completions", json={**body, "stream": True})
    assert json.loads(response.text.split("\n\n")[0].removeprefix("data: "))["error"] == internal
    state.engine.events = [corrupt]
    with client.websocket_connect("/v1/stream") as websocket:
        websocket.send_text(json.dumps({"type": "generate", "id": "g", **body}))
        answer = json.loads(websocket.receive_text())
    assert answer["type"] == "error" and answer["error"] == internal


# -- 7. bits per byte ----------------------------------------------------------------------------------


def append(client, state, text, scored: int, logprob: float, model: str = WORDS, session_tokens: int = 0) -> dict:
    state.engine.session_model, state.engine.session_tokens = model, session_tokens
    state.engine.appended = Appended(None, logprob, scored)
    response = client.post(f"/v1/sessions/{SESSION}/append", json={"text": text, "score": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_bits_per_byte_divides_by_the_bytes_of_the_scored_tokens(served):
    client, state = served
    logprob = -6.0 * math.log(2)  # 6 bits
    # a word tokenizer's tokens as ids: "hello world again", of which " world again" (12 bytes) is
    # scored (the first token had no context), not 2 (the scored tokens' count)
    answer = append(client, state, [0, 1, 2], scored=2, logprob=logprob)
    assert answer["bits_per_byte"] == pytest.approx(6 / len(" world again"))
    # the same tokens sent as text score the same
    assert append(client, state, "hello world again", scored=2, logprob=logprob)["bits_per_byte"] == \
        pytest.approx(6 / len(" world again"))
    # everything scored (the session had a memory): the whole text
    assert append(client, state, "hello world", scored=2, logprob=logprob, session_tokens=4)["bits_per_byte"] == \
        pytest.approx(6 / len("hello world"))
    # the byte tokenizer: a token is a byte
    assert append(client, state, "abcd", scored=3, logprob=logprob, model=MODEL)["bits_per_byte"] == \
        pytest.approx(6 / 3)
    # even where a chunk of ids splits a character (a document fed chunk by chunk): "€" is three
    # bytes, and a decode would count each of its broken pieces as U+FFFD's three
    euro = list("€".encode())
    assert append(client, state, euro[:2], scored=2, logprob=logprob, model=MODEL, session_tokens=4)["bits_per_byte"] == \
        pytest.approx(6 / 2)
    assert append(client, state, euro[2:], scored=1, logprob=logprob, model=MODEL, session_tokens=4)["bits_per_byte"] == \
        pytest.approx(6 / 1)


@pytest.mark.parametrize("text", ["hello", [0]], ids=["text", "token-ids"])
def test_bits_per_byte_is_null_when_nothing_was_scored(served, text):
    client, state = served
    # a first append of one (multi-byte) token: it has no context, nothing is scored
    answer = append(client, state, text, scored=0, logprob=0.0)
    assert answer["scored_tokens"] == 0 and answer["bits_per_byte"] is None


# -- 8. stream_options without stream -----------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "ab"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}),
], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [{}, {"stream": False}, {"stream": None}], ids=["left-out", "false", "null"])
def test_stream_options_without_stream_are_refused_naming_them(served, path, body, stream):
    client, state = served
    error = error_of(client.post(path, json={**body, **stream, "stream_options": {"include_usage": True}}))
    assert (error["type"], error["param"]) == ("invalid_request_error", "stream_options")
    assert state.engine.submitted == []
    state.engine.events = [one_token(), *finished()]
    response = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and '"usage": {' in response.text


def test_tool_call_arguments_nested_past_the_parser_stream_without_an_internal_error():
    """Generated arguments may nest arbitrarily deep (a tool without `parameters` constrains them
    to an object only): past what the JSON parser follows they are streamed as they come and
    never end a call, rather than raising RecursionError mid-stream."""
    from xlserve.server.api.structured import ToolCallStream

    stream = ToolCallStream()
    deep = '{"a": ' * 100_000 + "1" + "}" * 100_000
    deltas = stream.push('<tool_call>{"name": "f", "arguments": ' + deep + "}</tool_call>")
    deltas += stream.finish("length")[0]
    sent = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d)
    assert sent.startswith('{"a": {"a": ') and len(stream.calls) == 1


def test_tool_call_arguments_end_at_their_closing_tag_token_by_token():
    from xlserve.server.api.structured import ToolCallStream

    stream = ToolCallStream()
    text = '<tool_call>{"name": "f", "arguments": {"x": [1, 2, {"y": "}</tool_call>"}]}}</tool_call>'
    for character in text:
        stream.push(character)
    assert stream.complete and json.loads(stream.calls[0]["function"]["arguments"]) == {"x": [1, 2, {"y": "}</tool_call>"}]}


# -- 8. text_offset counts text held back for a stop string -------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_text_offset_counts_the_characters_each_token_decoded_to_even_while_held_back(served, stream):
    """A token whose text is held back as a stop string's possible start releases "" and the
    next one releases both: text_offset must still say where each token's own text starts in
    the answer ("axyb" with stop "xyz": 0, 1, 2, 3, not 0, 1, 1, 1)."""
    client, state = served
    state.engine.events = [TokenEvent(ord("a"), "a", -0.1, [], 0, 1), TokenEvent(ord("x"), "", -0.2, [], 0, 1),
                           TokenEvent(ord("y"), "", -0.3, [], 0, 1), TokenEvent(ord("b"), "xyb", -0.4, [], 0, 1),
                           ChoiceFinished(0, "length", "", 4), Finished([ChoiceFinished(0, "length", "", 4)], 2, 4, 0,
                                                                         None)]
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 4, "logprobs": 0, "stop": ["xyz"], "stream": stream}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(line.removeprefix("data: ")) for line in response.text.split("\n\n")
                  if line.startswith("data: {")]
        offsets = [o for chunk in chunks for choice in chunk["choices"] if choice.get("logprobs")
                   for o in choice["logprobs"]["text_offset"]]
        text = "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])
    else:
        choice = response.json()["choices"][0]
        offsets, text = choice["logprobs"]["text_offset"], choice["text"]
    assert text == "axyb" and offsets == [0, 1, 2, 3]


def test_a_list_of_prompts_is_measured_against_the_per_key_queue_too():
    from types import SimpleNamespace

    from xlserve.server.api.errors import InvalidRequest
    from xlserve.server.api.serving.generation import check_the_batch_fits

    limits = SimpleNamespace(max_batch_size=64, max_queued_requests=256, max_queued_per_key=4)
    check_the_batch_fits(limits, 16, 4, keyed=True)  # 16 prompts x 4 rows: all run at once
    check_the_batch_fits(limits, 16, 16, keyed=False)  # 4 run, 12 wait: within the model's queue
    with pytest.raises(InvalidRequest, match="XLSERVE_MAX_QUEUED_PER_KEY") as refused:
        check_the_batch_fits(limits, 16, 16, keyed=True)  # 12 of one key's would wait
    assert refused.value.code == "too_many_prompts" and "at most 8 such prompts" in refused.value.message


def test_a_web_page_of_another_origin_cannot_open_the_websocket():
    """A browser applies no same-origin rule to a websocket: any site a user visited could open
    ws://127.0.0.1:8000/v1/stream on a server without keys (as `make serve` starts it), generate
    and append to its sessions. A page of another origin is refused 403 unless the operator
    allows it; a client that is no browser sends no Origin and is not asked for one."""
    app, state = make_app()
    client = TestClient(app)
    generate = json.dumps({"type": "generate", "model": MODEL, "prompt": "ab", "temperature": None})

    def first_frame(headers: dict) -> dict:
        with client.websocket_connect("/v1/stream", headers=headers) as websocket:
            websocket.send_text(generate)
            return json.loads(websocket.receive_text())

    for origin in ("https://evil.example", "http://127.0.0.1:3000", "null"):
        refused = first_frame({"origin": origin, "host": "127.0.0.1:8000"})
        assert refused["type"] == "error" and refused["error"]["code"] == "cross_origin", (origin, refused)
        assert refused["error"]["type"] == "permission_error"
    # its own pages (the playground), a client without an Origin, behind a proxy that sends the Host without its port
    for headers in ({"origin": "http://127.0.0.1:8000", "host": "127.0.0.1:8000"}, {},
                    {"origin": "https://xl.example", "host": "xl.example"},
                    # behind a proxy that rewrites Host and says the page's in X-Forwarded-Host
                    {"origin": "https://xl.example", "host": "127.0.0.1:8000", "x-forwarded-host": "xl.example"}):
        answer = first_frame(headers)
        assert answer["error"]["param"] == "temperature", (headers, answer)  # past the handshake: the frame's own error
    state.settings.security.allowed_origins = "https://app.example.com, https://other.example/"
    assert first_frame({"origin": "https://app.example.com"})["error"]["param"] == "temperature"
    assert first_frame({"origin": "https://evil.example"})["error"]["code"] == "cross_origin"
    state.settings.security.allowed_origins = "*"
    assert first_frame({"origin": "https://evil.example"})["error"]["param"] == "temperature"
    client.close()
