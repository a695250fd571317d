"""Structured output at the API (server/api/structured.py) with an engine stand-in that compiles
each request's constraint as the engine process does (server/engine/constraints.py) and answers
from a script:

- a schema's keywords and formats that llguidance does not implement are ignored unless the
  schema is strict, and a strict one's refusal names the keyword (and the function) in plain words;
- strict closes objects that do not say `additionalProperties`;
- a tool's `parameters` with `$id` compile and hold its arguments;
- an answer cut inside a call's markup is no content, streamed or not;
- `parallel_tool_calls: null` is the default, and a named function is called exactly once.
"""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from xlserve.models.tokenizer import ByteTokenizer
from xlserve.server.api.chat import ChatTemplate
from xlserve.server.api.deps import ServedModel
from xlserve.server.engine.constraints import ConstraintCompiler
from xlserve.server.engine.types import ChoiceFinished, Finished, TokenEvent
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings

from tests.server.scripted_engine import RecordingEngine, scripted_app

MODEL = "m"
CARD = {"id": MODEL, "object": "model", "created": 0, "owned_by": "xlserve", "architecture": "transformer-xl",
        "state_kind": "segment-recurrence", "state_grows_with_context": False, "max_context": None,
        "parameters": 0, "config": {}, "quantize": "none", "weight_bytes": 0, "state_bytes_per_session": 9216}
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")
ASK = [{"role": "user", "content": "x"}]
# keywords and formats that llguidance does not implement, as OpenAPI-made tool specs use them
UNIMPLEMENTED = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    "link": {"type": "string", "format": "uri-reference"},
    "secret": {"type": "string", "format": "password"},
    "blob": {"type": "string", "format": "binary"},
    "other": {"not": {"type": "null"}},
    "shape": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]},
              "propertyNames": {"pattern": "^[a-z]+$"}},
    "list": {"type": "array", "contains": {"type": "integer"}}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}  # no additionalProperties


class CompilingEngine(RecordingEngine):
    """Compiles each request's constraint with the engine's compiler (raising its refusal, as the
    engine process's submit does), keeps the compiled matcher, and answers from its script."""

    def __init__(self, metrics: Metrics):
        super().__init__(metrics)
        self.compiler = ConstraintCompiler(ByteTokenizer(), MODEL, compile_seconds=30)
        self.matchers: list = []

    async def submit(self, model, tokens, params, lease, scope, owner=None):
        if params.constraint_kind is not None:
            self.matchers.append(self.compiler.matcher(params.constraint_kind, params.constraint or "",
                                                       params.constraint_param))
        return await super().submit(model, tokens, params, lease, scope, owner)


@pytest.fixture
def served():
    engine = CompilingEngine(Metrics())
    app, _ = scripted_app(Settings(models="none-loaded"), engine,
                          {MODEL: ServedModel(MODEL, ByteTokenizer(), 256, CARD, ChatTemplate(TEMPLATE, "test"))})
    engine.events = answered("")
    return TestClient(app), engine


def answered(text: str, finish_reason: str = "stop") -> list:
    tokens = [TokenEvent(byte, chr(byte), -0.5, []) for byte in text.encode()]
    end = ChoiceFinished(0, finish_reason, "", len(tokens))
    return [*tokens, end, Finished([end], 2, len(tokens), 0, None)]


def takes(matcher, text: str) -> bool:
    """The constraint holds `text` whole."""
    copy = matcher.deep_copy()
    return copy.consume_tokens(list(text.encode())) and not copy.is_error() and copy.is_accepting()


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def tool(name: str, parameters: dict, **fields) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters, **fields}}


def json_schema_format(schema: dict, **fields) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **fields}}


# -- keywords the engine does not implement ----------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"tools": [tool("search", UNIMPLEMENTED)]},  # tool_choice unset: auto
    {"tools": [tool("search", UNIMPLEMENTED, strict=False)], "tool_choice": "required"},
    {"response_format": json_schema_format(UNIMPLEMENTED)},
    {"response_format": json_schema_format(UNIMPLEMENTED, strict=None)},
    {"guided_json": UNIMPLEMENTED},
    {"structured_outputs": {"json": UNIMPLEMENTED}},
])
def test_keywords_the_engine_does_not_implement_are_ignored_unless_strict(served, fields):
    client, engine = served
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **fields})
    assert response.status_code == 200, response.text
    (matcher,) = engine.matchers
    arguments = {"tags": ["a", "a"], "link": "../x", "secret": "p", "blob": "b", "other": 1, "shape": {"a": 1},
                 "list": ["no integer"]}  # the ignored keywords do not hold it back
    assert takes(matcher, call("search", arguments) if "tools" in fields else json.dumps(arguments))


def test_a_strict_schema_is_refused_for_a_keyword_naming_it_plainly(served):
    client, _ = served
    for schema, named in [({"type": "array", "uniqueItems": True}, '"uniqueItems"'),
                          ({"type": "string", "format": "uri-reference"}, '"format": "uri-reference"'),
                          ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
                           '"if", "then"')]:
        response = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "max_tokens": 4,
            "response_format": json_schema_format(schema, strict=True)})
        error = response.json()["error"]
        assert response.status_code == 400 and (error["param"], error["code"]) == \
            ("response_format", "invalid_response_format"), error
        assert named in error["message"] and "strict" in error["message"], error["message"]


def test_a_strict_tool_is_refused_naming_the_function_and_keyword_without_the_grammar(served):
    client, _ = served
    tools = [tool("fine", {"type": "object"}), tool("search", UNIMPLEMENTED, strict=True)]
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4,
                                                          "tools": tools})
    error = response.json()["error"]
    assert response.status_code == 400 and (error["param"], error["code"]) == ("tools", "invalid_response_format")
    assert "function 'search'" in error["message"] and '"uniqueItems"' in error["message"], error["message"]
    assert "%json" not in error["message"] and "call_" not in error["message"]  # the grammar is the server's own


# -- strict closes objects -----------------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [True, False])
def test_strict_takes_a_missing_additional_properties_as_false(served, strict):
    client, engine = served
    nested = {**PERSON, "properties": {**PERSON["properties"], "pet": {"type": "object", "properties": {
        "kind": {"type": "string", "maxLength": 5}}}, "friends": {"type": "array", "items": {"$ref": "#/$defs/P"}}},
        "$defs": {"P": {"type": ["object", "null"], "properties": {"n": {"type": "integer"}}}}}
    for fields, wrap in [({"response_format": json_schema_format(nested, strict=strict)}, json.dumps),
                         ({"tools": [tool("f", nested, strict=strict)], "tool_choice": "required"},
                          lambda arguments: call("f", arguments))]:
        response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4,
                                                              **fields})
        assert response.status_code == 200, response.text
        matcher = engine.matchers[-1]
        assert takes(matcher, wrap({"name": "c", "age": 23, "pet": {"kind": "cat"}, "friends": [{"n": 1}, None]}))
        for extra in ({"name": "c", "age": 23, "": 10}, {"name": "c", "age": 23, "pet": {"kind": "cat", "x": 1}},
                      {"name": "c", "age": 23, "friends": [{"n": 1, "m": 2}]}):
            assert takes(matcher, wrap(extra)) is not strict, extra


# -- a tool's parameters with $id ----------------------------------------------------------------------------


def test_tool_parameters_with_an_id_resolve_their_references(served):
    client, engine = served
    parameters = {"$id": "https://example.com/fetch.json", "type": "object", "properties": {"u": {"$ref": "#/$defs/U"}},
                  "required": ["u"], "additionalProperties": False,
                  "$defs": {"U": {"type": "string", "maxLength": 10}}}
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4,
                                                          "tools": [tool("fetch", parameters)],
                                                          "tool_choice": "required"})
    assert response.status_code == 200, response.text
    (matcher,) = engine.matchers
    assert takes(matcher, call("fetch", {"u": "http://a"}))
    assert not takes(matcher, call("fetch", {"u": "http://example.com"}))  # U's maxLength holds
    assert not takes(matcher, call("fetch", {"u": 5}))


# -- a call's markup is never content ------------------------------------------------------------------------


WEATHER = tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                               "additionalProperties": False})


@pytest.mark.parametrize("text, finish_reason, arguments", [
    ('<tool_call>{"name": ', "length", None),  # max_tokens inside the call's head
    ('<tool_call>{"name": "get_wea', "stop", None),  # a stop string there
    ("<tool_", "length", None),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_c', "length", '{"city": "Paris"}'),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', "length", '{"city": "Par'),
])
def test_an_answer_cut_inside_a_call_s_markup_is_no_content(served, text, finish_reason, arguments):
    client, engine = served
    engine.events = answered(text, finish_reason)
    body = {"model": MODEL, "messages": ASK, "max_tokens": 20, "tools": [WEATHER], "tool_choice": "required"}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] is None
    assert [c["function"]["arguments"] for c in message.get("tool_calls", [])] == ([] if arguments is None
                                                                                    else [arguments])
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    deltas = [choice["delta"] for chunk in chunks for choice in chunk["choices"]]
    assert not any(delta.get("content") for delta in deltas)
    sent = "".join(call_delta["function"].get("arguments") or "" for delta in deltas
                   for call_delta in delta.get("tool_calls") or [])
    assert sent == (arguments or "")
    assert chunks[-1]["choices"][0]["finish_reason"] == finish_reason


@pytest.mark.parametrize("tool_choice, finish_reason", [
    ("required", "tool_calls"), ("auto", "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, "stop"),  # OpenAI's and vLLM's answer to a named call
])
def test_whole_calls_finish_with_tool_calls_unless_the_function_was_named(served, tool_choice, finish_reason):
    client, engine = served
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "tools": [WEATHER], "tool_choice": tool_choice}
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    engine.events = answered(text, "stop")
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == finish_reason and len(choice["message"]["tool_calls"]) == 1
    engine.events = answered(text, "stop")
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == finish_reason


def test_arguments_with_an_integer_past_python_s_digit_limit_end_where_they_end(served):
    """Python's json refuses an integer of more than 4,300 digits, which a constraint allows: the
    first call's end was then never found, every later call was read as part of its arguments,
    and the answer finished with "stop" as one broken call."""
    client, engine = served
    huge = "7" * 5000
    engine.events = answered('<tool_call>{"name": "get_weather", "arguments": {"city": ' + huge + '}}</tool_call>'
                             '<tool_call>{"name": "get_weather", "arguments": {"city": "Lyon"}}</tool_call>', "stop")
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4000, "tools": [WEATHER], "tool_choice": "required"}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == ['{"city": ' + huge + '}',
                                                                                     '{"city": "Lyon"}']


def test_text_in_auto_mode_is_still_content(served):
    client, engine = served
    engine.events = answered("Sunny.", "length")
    body = {"model": MODEL, "messages": ASK, "max_tokens": 6, "tools": [WEATHER]}
    assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == "Sunny."


# -- parallel_tool_calls ---------------------------------------------------------------------------------------


def test_parallel_tool_calls_null_is_the_default(served):
    client, engine = served
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4,
                                                          "tools": [WEATHER], "tool_choice": "required",
                                                          "parallel_tool_calls": None})
    assert response.status_code == 200, response.text
    twice = call("get_weather", {"city": "a"}) + call("get_weather", {"city": "b"})
    assert takes(engine.matchers[-1], twice)  # the default: calls in parallel


@pytest.mark.parametrize("parallel", [True, False])
def test_a_named_function_is_called_exactly_once(served, parallel):
    client, engine = served
    other = tool("get_time", {"type": "object"})
    response = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 4, "tools": [WEATHER, other], "parallel_tool_calls": parallel,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert response.status_code == 200, response.text
    matcher = engine.matchers[-1]
    once = call("get_weather", {"city": "a"})
    assert takes(matcher, once)
    assert not takes(matcher, once + call("get_weather", {"city": "b"}))
    assert not takes(matcher, call("get_time", {}))


def test_strict_enforces_objects_combined_by_all_of_as_written(served):
    """allOf's branches (and the definitions they refer to) describe one object together: closed
    one by one, no object could hold the properties of two (`allOf: [{$ref Base}, {properties:
    {age}}]` with age required was refused as unsatisfiable), so such a schema is not closed."""
    client, engine = served
    schema = {"$defs": {"Base": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}},
                                 "required": ["name"]}},
              "allOf": [{"$ref": "#/$defs/Base"},
                        {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}]}
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4,
                                                          "response_format": json_schema_format(schema, strict=True)})
    assert response.status_code == 200, response.text
    assert takes(engine.matchers[-1], json.dumps({"name": "c", "age": 23}))


@pytest.mark.parametrize("kind", ["text", "json_object"])
def test_a_json_schema_under_another_response_format_type_is_400_not_ignored(served, kind):
    client, _ = served
    response = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 4,
        "response_format": {"type": kind, "json_schema": {"name": "n", "schema": {"type": "object"}}}})
    error = response.json()["error"]
    assert response.status_code == 400 and (error["param"], error["code"]) == \
        ("response_format.json_schema", "invalid_response_format"), error
