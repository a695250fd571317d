"""What the API process takes from a client, at its edges, with a stand-in for the engine process
(no model, no torch work) behind starlette's test client:

- every list a client sends is bounded before its items are validated, and the 400 names the limit;
- with API keys, a request without one is answered 401 before its body is read (so before its
  nesting is scanned); a body sent without a Content-Type is not parsed as JSON;
- OpenAI's signed seeds and top_p 0 reach the engine;
- chat logprobs carry each token's bytes;
- a malformed Idempotency-Key is refused even where a key has no effect;
- tool parameters that refer to parts of themselves ($defs, definitions, "#") make a grammar that
  llguidance compiles and that holds the arguments to the schema.
"""

from __future__ import annotations

import asyncio
import json

import llguidance
import openai
import pytest
from pydantic import BaseModel, Field
from starlette.testclient import TestClient

from xlserve.models.tokenizer import ByteTokenizer, TokenizersTokenizer, WordTokenizer, token_string_bytes
from xlserve.server.api.chat import ChatTemplate
from xlserve.server.api.deps import ServedModel
from xlserve.server.api.protocol import (
    MAX_CONTENT_PARTS,
    MAX_GUIDED_CHOICES,
    MAX_JSON_DEPTH,
    MAX_MESSAGE_TOOL_CALLS,
    MAX_PROMPTS,
    FunctionDefinition,
)
from xlserve.server.api.structured import tool_grammar
from xlserve.server.engine.constraints import byte_level_tokenizer
from xlserve.server.engine.types import ChoiceFinished, Finished, TokenEvent
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings

from tests.server.scripted_engine import RecordingEngine, scripted_app

MODEL = "m"
KEY = "the-key"
CARD = {"id": MODEL, "object": "model", "created": 0, "owned_by": "xlserve", "architecture": "transformer-xl",
        "state_kind": "segment-recurrence", "state_grows_with_context": False, "max_context": None,
        "parameters": 0, "config": {}, "quantize": "none", "weight_bytes": 0, "state_bytes_per_session": 9216}
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
DEEP = ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)).encode()


@pytest.fixture
def served():
    """(client with the key, client without one, engine): the app with one byte-level model that
    has a chat template, and one API key."""
    app, state = scripted_app(Settings(models="none-loaded", api_keys=KEY, max_request_body_bytes=1_000_000),
                              RecordingEngine(Metrics()),
                              {MODEL: ServedModel(MODEL, ByteTokenizer(), 256, CARD, ChatTemplate(TEMPLATE, "test"))},
                              api_keys=[KEY])
    keyed = TestClient(app, headers={"Authorization": f"Bearer {KEY}"})  # not entered: no lifespan
    anonymous = TestClient(app)
    yield keyed, anonymous, state.engine
    keyed.close()
    anonymous.close()


@pytest.fixture
def word_served():
    """(client, engine): the app with one word-level model (a converted Transformer-XL's kind)."""
    words = WordTokenizer(["<eos>", "<unk>", "the", "cat"])
    app, state = scripted_app(Settings(models="none-loaded"), RecordingEngine(Metrics()),
                              {MODEL: ServedModel(MODEL, words, 4, CARD, ChatTemplate(TEMPLATE, "test"))})
    client = TestClient(app)  # not entered: no lifespan
    yield client, state.engine
    client.close()


def error_of(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def finished_events(text: str = "ok") -> list:
    tokens = [TokenEvent(byte, chr(byte), -0.5, []) for byte in text.encode()]
    end = ChoiceFinished(0, "stop", "", len(tokens))
    return [*tokens, end, Finished([end], 2, len(tokens), 0, None)]


# -- lists are bounded before their items are validated ----------------------------------------------


@pytest.mark.parametrize("prompt", [["a"] * 20_000, [[1]] * 20_000], ids=["texts", "token-id-lists"])
def test_a_long_list_of_prompts_is_refused_naming_the_limit(served, prompt):
    client, _, engine = served
    error = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": prompt}))
    assert error["param"] == "prompt"
    assert f"at most {MAX_PROMPTS} prompts" in error["message"] and "20000" in error["message"]
    assert engine.params == []


def test_one_long_prompt_of_token_ids_is_still_one_prompt(served):
    client, _, engine = served
    engine.events = finished_events()
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": [65] * 20_000, "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_a_list_of_prompts_of_the_wrong_kind_is_one_error(served):
    client, _, _ = served
    error = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": [1] + ["a"] * 20_000}))
    assert error["param"] == "prompt" and "must be a string, a list of token ids" in error["message"]


@pytest.mark.parametrize("path, body, param, limit", [
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 5}, "stop", "at most 4 stop strings"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a"] * (MAX_GUIDED_CHOICES + 1)}, "guided_choice",
     f"at most {MAX_GUIDED_CHOICES} items"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": ["a"] * (MAX_GUIDED_CHOICES + 1)}},
     "structured_outputs.choice", f"at most {MAX_GUIDED_CHOICES} items"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 5}] * 1000},
     "messages", f"at most {MAX_CONTENT_PARTS} content parts"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)}]},
     "messages", f"at most {MAX_CONTENT_PARTS} content parts"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * (MAX_MESSAGE_TOOL_CALLS + 1)}]},
     "messages", f"at most {MAX_MESSAGE_TOOL_CALLS} tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 1025}, "messages", "at most 1024 items"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}] * 129}, "tools",
     "at most 128 items"),
])
def test_long_lists_are_400_naming_their_limit(served, path, body, param, limit):
    client, _, _ = served
    error = error_of(client.post(path, json={"model": MODEL, **body}))
    assert error["param"] == param and limit in error["message"], error


def test_lists_within_their_limits_are_taken(served):
    client, _, engine = served
    engine.events = finished_events()
    parts = [{"type": "text", "text": "a"}] * 4
    response = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": parts}] * (MAX_CONTENT_PARTS // 4), "max_tokens": 2,
        "stop": ["a", "b", "c", "d"]})
    assert response.status_code == 200, response.text


# -- a key before a body; a body without a Content-Type is the JSON it is parsed as --------------------


def test_without_a_key_a_body_is_refused_before_it_is_read(served):
    keyed, anonymous, _ = served
    # scanned, this body would be 400 json_too_deep: the 401 comes first
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
        error = error_of(anonymous.post("/v1/completions", content=DEEP, headers={
            "content-type": "application/json", **headers}), 401)
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    chunked = anonymous.post("/v1/completions", content=iter([DEEP]), headers={"content-type": "application/json"})
    assert error_of(chunked, 401)["code"] == "invalid_api_key"
    assert error_of(keyed.post("/v1/completions", content=DEEP,
                               headers={"content-type": "application/json"}))["code"] == "json_too_deep"


@pytest.mark.parametrize("content_type", [b"text/plain", b"application/x-www-form-urlencoded",
                                          b"application/octet-stream"])
@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/v1/sessions/import"])
def test_without_a_key_a_body_of_any_type_is_refused_before_it_is_read(served, content_type, path):
    """Only a JSON body, or one without a length, was refused before it was read: a text/plain
    one of 7 MB was read whole (FastAPI reads it before the route's key check) and then 401, so
    anyone without a key could make the server hold 8 MB per open connection."""
    keyed, _, _ = served
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", content_type), (b"content-length", b"900000")],  # under the 1 MB limit
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    asked, sent = [], []

    async def receive():
        asked.append(1)
        return {"type": "http.request", "body": b"x" * 900_000, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(keyed.app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 401
    assert asked == []  # not one byte of the body was asked for


def test_a_body_without_a_content_type_is_not_parsed_as_json(served):
    """FastAPI parses a body as JSON only when its Content-Type says so (strict_content_type, on
    since FastAPI 0.132), so admission's depth check need not scan a body without one: were such a
    body parsed, this one would have to be refused as too deep before it was."""
    keyed, _, _ = served
    request = keyed.build_request("POST", "/v1/completions", content=DEEP)
    assert "content-type" not in request.headers
    error = error_of(keyed.send(request))
    assert "Content-Type: application/json" in error["message"] and error["code"] is None
    # a state import's raw bytes, sent without a Content-Type as httpx sends them: read as bytes (the
    # stand-in engine knows no session: 404)
    request = keyed.build_request("PUT", "/v1/sessions/s/state", content=DEEP)
    assert "content-type" not in request.headers
    assert error_of(keyed.send(request), 404)["code"] == "session_not_found"


# -- seeds and top_p as OpenAI takes them ----------------------------------------------------------------


@pytest.mark.parametrize("fields", [{"seed": -1}, {"seed": -(2**63)}, {"seed": 2**64 - 1}, {"top_p": 0}])
def test_openai_s_seeds_and_top_p_0_reach_the_engine(served, fields):
    client, _, engine = served
    engine.events = finished_events()
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **fields})
    assert response.status_code == 200, response.text
    (params,) = engine.params
    assert {name: getattr(params, name) for name in fields} == fields


@pytest.mark.parametrize("fields, param", [({"seed": -(2**63) - 1}, "seed"), ({"seed": 2**64}, "seed"),
                                           ({"top_p": -0.01}, "top_p"), ({"top_p": 1.01}, "top_p")])
def test_seeds_and_top_p_outside_their_ranges_are_400(served, fields, param):
    client, _, _ = served
    assert error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **fields}))["param"] == param


# -- chat logprobs: each token's bytes --------------------------------------------------------------------


CHAT_WITH_LOGPROBS = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                      "top_logprobs": 2}


def chat_logprobs(client, engine, events: list, reason: str) -> list[dict]:
    """The `logprobs.content` of a chat answer whose tokens are `events`, ending for `reason`."""
    end = ChoiceFinished(0, reason, "", len(events))
    engine.events = [*events, end, Finished([end], 2, len(events), 0, None)]
    answer = client.post("/v1/chat/completions", json=CHAT_WITH_LOGPROBS)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["logprobs"]["content"]


def test_chat_logprobs_carry_the_bytes_of_byte_tokens(served):
    client, _, engine = served
    e_acute = "é".encode()  # 0xC3 0xA9: two byte tokens, named "<0xC3>" and "<0xA9>"
    content = chat_logprobs(client, engine, [TokenEvent(e_acute[0], "", -0.5, [(e_acute[0], -0.5), (0x41, -2.0)]),
                                             TokenEvent(e_acute[1], "é", -0.25, [(e_acute[1], -0.25), (0xE2, -3.0)])],
                            "stop")
    assert [(entry["token"], entry["bytes"]) for entry in content] == [("<0xC3>", [0xC3]), ("<0xA9>", [0xA9])]
    assert [[(top["token"], top["bytes"]) for top in entry["top_logprobs"]] for entry in content] == [
        [("<0xC3>", [0xC3]), ("A", [0x41])], [("<0xA9>", [0xA9]), ("<0xE2>", [0xE2])]]
    assert bytes(byte for entry in content for byte in entry["bytes"]).decode() == "é"
    streamed = client.post("/v1/chat/completions", json={**CHAT_WITH_LOGPROBS, "stream": True})
    chunks = [json.loads(line.removeprefix("data: ")) for line in streamed.text.split("\n\n")
              if line.startswith("data: {")]
    sent = [entry for chunk in chunks for choice in chunk["choices"] for entry in (choice["logprobs"] or {}).get(
        "content", [])]
    assert [entry["bytes"] for entry in sent] == [[0xC3], [0xA9]]


def test_logprobs_name_each_token_by_the_text_it_adds():
    """Logprobs named tokens by their vocabulary entries: "Ġthe", "▁the", "Ċ", a word without its
    space and <eos> for a line break, so that the tokens never joined into the text, and chat's
    `bytes` of a word-level model were wrong. OpenAI and vLLM name each by the text it adds."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    byte_level = Tokenizer(models.BPE(vocab={"a": 0, "Ġ": 1, "Ġa": 2, "Ã": 3, "©": 4, "Ċ": 5, "Ã©": 6},
                                      merges=[("Ġ", "a"), ("Ã", "©")]))
    byte_level.decoder = decoders.ByteLevel()
    byte_level.add_tokens([AddedToken("<|endoftext|>", special=True)])
    tokenizer = TokenizersTokenizer(byte_level)
    strings = [tokenizer.token_string(token) for token in range(8)]
    assert strings == ["a", " ", " a", "<0xC3>", "<0xA9>", "\n", "é", "<|endoftext|>"]
    read = token_string_bytes
    assert [read(string) for string in strings[:7]] == [[0x61], [0x20], [0x20, 0x61], [0xC3], [0xA9], [0x0A],
                                                        [0xC3, 0xA9]]
    assert tokenizer.decode([2, 3, 4, 5]) == "".join(strings[i] for i in (2, 6, 5))  # a whole character joins

    fallback = Tokenizer(models.BPE(vocab={"▁the": 0, "<0x0A>": 1, "<0xC3>": 2, "cat": 3}, merges=[]))
    fallback.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    tokenizer = TokenizersTokenizer(fallback)
    assert [tokenizer.token_string(token) for token in range(4)] == [" the", "\n", "<0xC3>", "cat"]
    assert [token_string_bytes(tokenizer.token_string(t)) for t in range(3)] == [list(b" the"), [10], [0xC3]]

    words = WordTokenizer(["<eos>", "<unk>", "the", "cat"])
    assert [words.token_string(token) for token in words.encode("the cat\nthe")] == [" the", " cat", "\n", " the"]
    assert token_string_bytes(words.token_string(3)) == list(b" cat")
    assert ByteTokenizer().token_string(0x78) == "x" and ByteTokenizer().token_string(0xC3) == "<0xC3>"
    assert token_string_bytes("x") == [0x78]


def test_chat_and_completion_logprobs_of_a_word_level_model_join_into_the_text(word_served):
    client, engine = word_served
    eos, the, cat = 0, 2, 3
    content = chat_logprobs(client, engine, [TokenEvent(the, "the", -0.5, [(the, -0.5), (cat, -2.0)]),
                                             TokenEvent(cat, " cat", -0.25, [(cat, -0.25), (the, -3.0)]),
                                             TokenEvent(eos, "\n", -0.1, [(eos, -0.1), (cat, -3.0)])], "length")
    assert [(entry["token"], entry["bytes"]) for entry in content] == [
        (" the", list(b" the")), (" cat", list(b" cat")), ("\n", [0x0A])]
    assert [top["token"] for top in content[0]["top_logprobs"]] == [" the", " cat"]
    answer = client.post("/v1/completions", json={"model": MODEL, "prompt": "the", "logprobs": 1, "max_tokens": 3})
    assert answer.json()["choices"][0]["logprobs"]["tokens"] == [" the", " cat", "\n"]
    assert answer.json()["choices"][0]["logprobs"]["top_logprobs"][1] == {" cat": -0.25, " the": -3.0}


# -- Idempotency-Key ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_idempotency_key_is_400_without_a_session_too(served, stream):
    client, _, engine = served
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": stream}
    for key in ("has space", "x" * 256, "é".encode()):
        error = error_of(client.post("/v1/completions", json=body, headers={"Idempotency-Key": key}))
        assert (error["param"], error["code"]) == ("Idempotency-Key", "invalid_idempotency_key")
    assert engine.params == []
    engine.events = finished_events()
    # a well-formed key without session_id changes nothing: it is ignored
    assert client.post("/v1/completions", json=body, headers={"Idempotency-Key": "k-1"}).status_code == 200


# -- tool parameters that refer to parts of themselves -----------------------------------------------------


class Address(BaseModel):
    street: str = Field(max_length=12)


class Node(BaseModel):
    value: int
    next: "Node | None" = None


class Person(BaseModel):
    name: str = Field(max_length=12)
    home: Address
    chain: Node


DRAFT_7 = {"type": "object", "definitions": {"Unit": {"enum": ["c", "f"]}},
           # properties named as keywords are names: "default" refers to Unit as "unit" does
           "properties": {"unit": {"$ref": "#/definitions/Unit"}, "same": {"$ref": "#/properties/unit"},
                          "default": {"$ref": "#/definitions/Unit"}},
           "required": ["unit", "same", "default"], "additionalProperties": False}
ROOT_RECURSIVE = {"type": "object", "properties": {"v": {"type": "integer"},
                                                   "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                  "required": ["v", "next"], "additionalProperties": False,
                  "default": {"$ref": "#/not-a-reference"}}  # data, not a schema: left as it is


def matches(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(byte_level_tokenizer(256), llguidance.LLMatcher.grammar_from_lark(grammar),
                                   log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and not matcher.is_error() and matcher.is_accepting()


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_tool_parameters_with_references_compile_and_hold_the_arguments():
    functions = [FunctionDefinition.model_validate(openai.pydantic_function_tool(Person)["function"]),
                 FunctionDefinition(name="units", parameters=DRAFT_7),
                 FunctionDefinition(name="chain", parameters=ROOT_RECURSIVE)]
    grammar = tool_grammar(functions, auto=False, parallel=True)
    person = {"name": "Ann", "home": {"street": "Main"}, "chain": {"value": 1, "next": {"value": 2, "next": None}}}
    assert matches(grammar, call("Person", person))
    assert matches(grammar, call("units", {"unit": "c", "same": "f", "default": "c"})
                   + call("chain", {"v": 1, "next": {"v": 2, "next": None}}))
    assert not matches(grammar, call("Person", {**person, "home": {"street": 5}}))  # Address's schema holds
    assert not matches(grammar, call("Person", {**person, "chain": {"value": 1, "next": {"value": "x"}}}))
    assert not matches(grammar, call("units", {"unit": "k", "same": "c", "default": "c"}))
    assert not matches(grammar, call("units", {"unit": "c", "same": "c", "default": "k"}))
    assert not matches(grammar, call("chain", {"v": 1, "next": {"value": 2}}))  # "#" is chain's own schema
    assert '"default": {"$ref": "#/not-a-reference"}' in grammar


# -- a header sent twice; echo's text; the chosen token among the top log-probabilities ----------------


def test_a_content_type_sent_twice_is_read_as_its_first_value_as_the_routes_read_it(served):
    """Admission kept the last Content-Type where FastAPI reads the first: JSON then text/plain
    skipped the key check before the body and the nesting check, and the body was parsed."""
    keyed, anonymous, _ = served
    twice = [("content-type", "application/json"), ("content-type", "text/plain")]
    error = error_of(anonymous.post("/v1/completions", content=DEEP, headers=twice), 401)
    assert error["code"] == "invalid_api_key"
    assert error_of(keyed.post("/v1/completions", content=DEEP, headers=twice))["code"] == "json_too_deep"


def test_an_echo_that_would_repeat_the_prompts_past_the_limit_is_400(served):
    from xlserve.server.api.protocol import MAX_ECHOED_TOKENS

    client, _, engine = served
    body = {"model": MODEL, "prompt": ["x" * 10_000] * 16, "n": 16, "echo": True, "max_tokens": 0}
    error = error_of(client.post("/v1/completions", json=body))
    assert (error["param"], error["code"]) == ("echo", "echo_too_large")
    assert f"returns 2,560,000 tokens of text; the limit is {MAX_ECHOED_TOKENS:,}" in error["message"]
    assert engine.params == []
    engine.events = finished_events()
    assert client.post("/v1/completions", json={**body, "prompt": "x" * 10_000, "n": 2}).status_code == 200


@pytest.mark.parametrize("logprobs", [0, 1])
def test_completion_top_logprobs_always_hold_the_chosen_token(served, logprobs):
    """OpenAI and vLLM: up to logprobs + 1 entries, the chosen token's always among them (it was
    sampled from outside the top here)."""
    client, _, engine = served
    top = [(0x27, -2.75)][:logprobs]
    end = ChoiceFinished(0, "length", "", 2)
    engine.events = [TokenEvent(ord("P"), "P", -4.86, top), TokenEvent(ord("'"), "'", -2.75, top), end,
                     Finished([end], 1, 2, 0, None)]
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                    "logprobs": logprobs})
    assert response.status_code == 200, response.text
    tops = response.json()["choices"][0]["logprobs"]["top_logprobs"]
    expected_first = {"'": -2.75, "P": -4.86} if logprobs else {"P": -4.86}
    assert tops == [expected_first, {"'": -2.75}]


def test_tokenize_names_messages_when_their_rendering_is_over_the_prompt_limit():
    app, _ = scripted_app(Settings(models="none-loaded", max_prompt_bytes=50), RecordingEngine(Metrics()),
                          {MODEL: ServedModel(MODEL, ByteTokenizer(), 256, CARD, ChatTemplate(TEMPLATE, "test"))})
    client = TestClient(app)  # not entered: no lifespan
    error = error_of(client.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 60}]}))
    assert (error["param"], error["code"]) == ("messages", "prompt_too_long"), error
    error = error_of(client.post("/tokenize", json={"model": MODEL, "prompt": "x" * 60}))
    assert (error["param"], error["code"]) == ("prompt", "prompt_too_long"), error


# -- large prompts are tokenized off the event loop --------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_large_prompt_is_tokenized_off_the_event_loop_and_a_small_one_on_it(served, monkeypatch, path):
    """Tokenizing a prompt (and rendering a chat template) is work on the event loop every other
    request waits for: 27 ms a MB of text with wt103's 267,735 words, 100 ms to check an 8 MB body
    of token ids. Past OFF_THE_LOOP_ITEMS it runs on a worker thread; a small one stays on the loop,
    where a thread would cost more than the work."""
    import asyncio

    client, _, engine = served
    encode, threads = ByteTokenizer.encode, []

    def on_the_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:  # a worker thread runs no loop
            return False

    def recorded(self, text):
        threads.append(on_the_loop())
        return encode(self, text)

    monkeypatch.setattr(ByteTokenizer, "encode", recorded)
    for text in ("x" * 100, "x" * 200_000):
        engine.events = finished_events()
        body = ({"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]})
        assert client.post(path, json={"model": MODEL, "max_tokens": 2, **body}).status_code == 200
    assert threads == [True, False]
