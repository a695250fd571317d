"""Structured output and tool calls (issue 38) through the unmodified `openai` client against a
real server running the shipped byte-level Transformer-XL: every output is a real model sample,
kept inside its constraint by the engine's per-row mask (server/engine/constraints.py)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server_process import ServerProcess, make_checkpoint

REPO = Path(__file__).resolve().parents[2]
MODEL = "transformer-xl-stdlib"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
          "required": ["name", "age", "role", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                  "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


WIDE = "bytes-260"  # a byte model with more rows than bytes (`xlserve new --config '{"vocab_size": 260}'`)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    wide = make_checkpoint(tmp_path_factory.mktemp("checkpoints") / WIDE, config={"vocab_size": 260})
    process = ServerProcess([REPO / "weights" / MODEL, wide], env={"XLSERVE_STRUCTURED_MAX_BYTES": "20000"},
                            log_path=tmp_path_factory.mktemp("logs") / "server.log").start()
    yield process
    process.stop()


def test_json_schema_outputs_validate_for_20_seeds(oai):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = [oai.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format, seed=seed,
                                        temperature=1.0, max_tokens=400) for seed in range(10)]
    # completions: one request, n=10, choice i draws from seed 100 + i
    completion = oai.completions.create(model=MODEL, prompt="person = ", seed=100, n=10, temperature=1.0,
                                        max_tokens=400, extra_body={"response_format": response_format})
    texts = [c.choices[0].message.content for c in chat] + [choice.text for choice in completion.choices]
    reasons = [c.choices[0].finish_reason for c in chat] + [choice.finish_reason for choice in completion.choices]
    assert reasons == ["stop"] * 20
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 5  # real samples at temperature 1, not one forced answer


def test_json_object_and_guided_json(oai):
    result = oai.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"}, seed=3,
                                         max_tokens=300, temperature=0.7)
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(result.choices[0].message.content), dict)
    else:  # a free-form object may run past max_tokens; it is still a prefix of one
        assert result.choices[0].message.content.startswith("{")
    guided = oai.completions.create(model=MODEL, prompt="x = ", max_tokens=400, seed=4, n=4,
                                    extra_body={"guided_json": json.dumps(PERSON)})
    for choice in guided.choices:
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_regex_choice_and_grammar(oai):
    pattern = r"[A-Z][a-z]{2,8}-[0-9]{2,4}"
    result = oai.completions.create(model=MODEL, prompt=["id: ", "key = "], n=5, seed=1, temperature=1.0,
                                    max_tokens=40, extra_body={"guided_regex": pattern})
    assert len(result.choices) == 10  # two prompts, each with its own five matchers
    assert all(re.fullmatch(pattern, choice.text) for choice in result.choices), [c.text for c in result.choices]

    choices = ["red", "green", "blue"]
    picked = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A colour?"}], n=6, seed=2,
                                         max_tokens=10, extra_body={"guided_choice": choices})
    assert all(choice.message.content in choices for choice in picked.choices)

    newer = oai.completions.create(model=MODEL, prompt="c = ", n=3, seed=2, max_tokens=10,  # vLLM's newer form
                                   extra_body={"structured_outputs": {"choice": choices}})
    assert all(choice.text in choices for choice in newer.choices)

    grammar = 'start: "(" NUM (OP NUM)* ")"\nNUM: /[1-9][0-9]{0,2}/\nOP: "+" | "*"\n'
    summed = oai.completions.create(model=MODEL, prompt="y = ", n=4, seed=3, max_tokens=60,
                                    extra_body={"guided_grammar": grammar})
    for choice in summed.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]{0,2}([+*][1-9][0-9]{0,2})*\)",
                                                               choice.text), choice.text


def test_streamed_constrained_text_is_the_plain_answer(oai):
    kwargs = dict(model=MODEL, prompt="v = ", max_tokens=40, seed=9, extra_body={"guided_regex": r"[a-z]{3,30}"})
    plain = oai.completions.create(**kwargs).choices[0].text
    chunks = list(oai.completions.create(stream=True, **kwargs))
    pieces = [c.text for chunk in chunks for c in chunk.choices if c.text]
    assert "".join(pieces) == plain and len(pieces) > 1  # released as generated, not at the end


def _arguments(call, tool) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_tool_calls_required_named_and_auto(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(4):
        result = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                             tool_choice="required", seed=seed, max_tokens=200)
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls and all(call.type == "function" and call.id for call in
                                                 choice.message.tool_calls)
        for call in choice.message.tool_calls:
            _arguments(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])

    named = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], seed=5, max_tokens=200,
                                        tool_choice={"type": "function", "function": {"name": "get_time"}},
                                        parallel_tool_calls=False)
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time" and named.choices[0].finish_reason == "stop"
    _arguments(calls[0], TIME)

    # auto: text or calls, as the model draws; either parses
    answers = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="auto", n=6,
                                          seed=6, max_tokens=120)
    for choice in answers.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                _arguments(call, WEATHER)
        else:
            assert choice.message.content is not None and not choice.message.content.startswith("<")

    # the call sent back in the history, with the tool's answer, is a valid next request
    follow = oai.chat.completions.create(model=MODEL, max_tokens=5, seed=1, messages=[
        *messages, {"role": "assistant", "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "12:00"}])
    assert follow.choices[0].finish_reason == "length"


def test_streamed_tool_calls_rebuild_the_plain_answer(oai):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER, TIME],
                  tool_choice="required", seed=11, max_tokens=200)
    plain = oai.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish, argument_chunks = None, 0
    for chunk in oai.chat.completions.create(stream=True, **kwargs):  # as OpenAI's docs accumulate a stream
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += (delta.function.name or "") if delta.function else ""
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
                    argument_chunks += 1
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in plain]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert argument_chunks > len(calls)  # arguments stream as they are generated


def test_a_call_cut_short_by_max_tokens_is_in_tool_calls_as_the_stream_sends_it(oai):
    """max_tokens ends the answer inside the call's arguments: finish_reason "length", the call
    with its arguments as far as they were written, and no content; the stream sends the same."""
    head = '<tool_call>{"name": "get_weather", "arguments": '
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER], seed=3,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=len(head) + 12)
    choice = oai.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    # 12 byte tokens of arguments; a character they cut in two is still held by the detokenizer
    assert call.function.name == "get_weather" and 9 <= len(call.function.arguments.encode()) <= 12
    assert call.function.arguments.startswith('{"')
    arguments, content, finish = "", "", None
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for streamed in chunk.choices:
            content += streamed.delta.content or ""
            for delta in streamed.delta.tool_calls or []:
                arguments += delta.function.arguments or "" if delta.function else ""
            finish = streamed.finish_reason or finish
    assert (arguments, content, finish) == (call.function.arguments, "", "length")


def test_an_unconstrained_stream_beside_a_constrained_one_is_its_solo_run(oai):
    plain = dict(model=MODEL, prompt="def main():\n", max_tokens=48, seed=21, temperature=1.0)
    solo = oai.completions.create(**plain).choices[0].text
    results: dict[str, str] = {}

    def run(name, **kwargs):
        results[name] = "".join(c.text for chunk in oai.completions.create(stream=True, **kwargs)
                                for c in chunk.choices)

    threads = [threading.Thread(target=run, args=("constrained",), kwargs=dict(
                   model=MODEL, prompt="data = ", max_tokens=400, seed=5, n=3, extra_body={"response_format": {
                       "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})),
               threading.Thread(target=run, args=("plain",), kwargs=plain)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results["plain"] == solo


def test_a_session_continued_after_a_constrained_completion_equals_one_fed_the_text(server, oai):
    with server.client() as http:
        constrained = http.post("/v1/sessions", json={"model": MODEL}).json()["id"]
        fed = http.post("/v1/sessions", json={"model": MODEL}).json()["id"]
        for session in (constrained, fed):
            assert http.post(f"/v1/sessions/{session}/append", json={"text": "record = "}).status_code == 200
        schema = {**PERSON, "description": "a schema no other test sends: compiled while the session is leased"}
        text = oai.completions.create(model=MODEL, prompt="", max_tokens=400, seed=8, extra_body={
            "session_id": constrained, "guided_json": schema}).choices[0].text
        jsonschema.validate(json.loads(text), PERSON)
        assert http.post(f"/v1/sessions/{fed}/append", json={"text": text}).status_code == 200
        infos = [http.get(f"/v1/sessions/{session}").json() for session in (constrained, fed)]
        assert infos[0]["tokens"] == infos[1]["tokens"]
    after = [oai.completions.create(model=MODEL, prompt="\n", max_tokens=24, temperature=0, logprobs=1,
                                    extra_body={"session_id": session}).choices[0] for session in (constrained, fed)]
    assert after[0].text == after[1].text
    assert after[0].logprobs.token_logprobs == pytest.approx(after[1].logprobs.token_logprobs, abs=1e-4)
    with pytest.raises(openai.BadRequestError):  # refused at compile time: the session is let go, unchanged
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={
            "session_id": constrained, "guided_json": {"type": "never-seen"}})
    with server.client() as http:
        assert http.get(f"/v1/sessions/{constrained}").json()["tokens"] == infos[0]["tokens"] + 1 + 24  # the "\n" prompt and 24 tokens


@pytest.mark.parametrize("fields, param, code", [
    ({"extra_body": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "wat"}}}}}, "response_format", "invalid_response_format"),
    ({"extra_body": {"guided_json": {"$ref": "#/nowhere"}}}, "guided_json", "invalid_response_format"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "invalid_response_format"),
    ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar", "invalid_response_format"),
    ({"extra_body": {"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(4000))}}, "guided_grammar",
     "grammar_too_large"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice", "invalid_response_format"),
    ({"extra_body": {"structured_outputs": {"json": {"type": "wat"}}}}, "structured_outputs.json",
     "invalid_response_format"),
])
def test_bad_constraints_are_400_naming_the_field(oai, fields, param, code):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4, **fields)
    error = refused.value.body
    assert (error["param"], error["code"]) == (param, code), error
    with pytest.raises(openai.BadRequestError) as again:  # the refusal is cached: the same answer
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4, **fields)
    assert again.value.body == error


def test_bad_tools_are_400(oai):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}}
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=[bad], tool_choice="required", max_tokens=4)
    assert (refused.value.body["param"], refused.value.body["code"]) == ("tools", "invalid_response_format")
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "missing"}})
    assert refused.value.body["param"] == "tool_choice"


def test_a_flood_of_distinct_schemas_is_answered(oai):
    for i in range(12):  # each compiles once; the engine's cache stays bounded (tests/server/test_constraints.py)
        schema = {"type": "object", "properties": {f"field_{i}": {"enum": [i]}}, "required": [f"field_{i}"],
                  "additionalProperties": False}
        text = oai.completions.create(model=MODEL, prompt="x", max_tokens=40, extra_body={"guided_json": schema}
                                      ).choices[0].text
        assert json.loads(text) == {f"field_{i}": i}


def test_the_websocket_generate_frame_takes_the_same_fields(server):
    from websockets.sync.client import connect

    with connect(server.url.replace("http", "ws") + "/v1/stream") as socket:
        socket.send(json.dumps({"type": "generate", "id": "g", "model": MODEL, "prompt": "n = ", "max_tokens": 30,
                                "seed": 1, "guided_regex": "[0-9]{3}"}))
        texts, done = [], None
        while done is None:
            frame = json.loads(socket.recv(timeout=60))
            if frame["type"] == "token":
                texts.append(frame["text"])
            elif frame["type"] == "done":
                done = frame
            else:
                raise AssertionError(frame)
        assert done["finish_reason"] == "stop" and re.fullmatch("[0-9]{3}", "".join(texts) + done["text"])
        socket.send(json.dumps({"type": "generate", "id": "h", "model": MODEL, "prompt": "n", "max_tokens": 3,
                                "guided_regex": "("}))
        refused = json.loads(socket.recv(timeout=60))
        assert refused["type"] == "error" and refused["error"]["code"] == "invalid_response_format"


def test_the_openai_client_s_parse_helpers_get_their_pydantic_models(oai):
    """`chat.completions.parse` sends a pydantic model as a strict json_schema (or as a strict
    function tool) and parses the answer back into it: both parse."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=99)
        role: Literal["admin", "user"]

    class GetWeather(BaseModel):
        city: str = Field(max_length=12)

    parse = getattr(oai.chat.completions, "parse", None) or oai.beta.chat.completions.parse
    person = parse(model=MODEL, messages=ASK, response_format=Person, max_tokens=100, seed=1).choices[0]
    assert isinstance(person.message.parsed, Person) and person.finish_reason == "stop"
    weather = parse(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
                    tool_choice="required", max_tokens=100, seed=2).choices[0]
    assert weather.finish_reason == "tool_calls"
    assert isinstance(weather.message.tool_calls[0].function.parsed_arguments, GetWeather)


def test_an_ambiguous_grammar_ends_its_stream_with_constraint_too_slow_and_holds_no_one(server, oai):
    """Every step of `x: x x | x x x | "a"` costs more than the last, on the engine's one thread:
    past XLSERVE_STRUCTURED_TOKEN_MILLISECONDS for 3 tokens in a row the request ends with its error
    event, after the text it had sent, and a completion beside it is its solo answer."""
    plain = dict(model=MODEL, prompt="def h(z):\n", max_tokens=48, seed=22, temperature=1.0)
    solo = oai.completions.create(**plain).choices[0].text
    body = {"model": MODEL, "prompt": "a", "max_tokens": 400, "n": 2, "seed": 0, "stream": True,
            "logit_bias": {str(ord("a")): 100}, "guided_grammar": 'start: x "b"\nx: x x | x x x | "a"\n'}
    events: list[dict] = []

    def hog():
        with server.client() as http, http.stream("POST", "/v1/completions", json=body, timeout=120) as response:
            events.extend(json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))

    thread = threading.Thread(target=hog)
    thread.start()
    beside = oai.completions.create(**plain).choices[0].text
    thread.join()
    assert beside == solo
    *chunks, last = events
    assert sum(len(choice["text"]) for chunk in chunks for choice in chunk["choices"]) > 0
    assert (last["error"]["code"], last["error"]["param"]) == ("constraint_too_slow", "guided_grammar"), last
    assert "XLSERVE_STRUCTURED_TOKEN_MILLISECONDS" in last["error"]["message"]


def test_two_thousand_choices_give_one_of_them(oai):
    choices = [f"w{i}" for i in range(2050)]  # a rule of over 2,000 alternatives died at its second token
    result = oai.completions.create(model=MODEL, prompt="tag: ", n=3, seed=1, max_tokens=30,
                                    extra_body={"guided_choice": choices})
    assert [(choice.text in choices, choice.finish_reason) for choice in result.choices] == [(True, "stop")] * 3


def test_tools_with_unimplemented_keywords_and_an_id_are_called(oai):
    """A tool's `parameters` as OpenAPI specs write them (uniqueItems, format uri-reference) are
    taken without strict, tool_choice unset; one with `$id` resolves its own references."""
    search = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "uniqueItems": True, "maxItems": 3},
        "link": {"type": "string", "format": "uri-reference", "maxLength": 20}}, "required": ["tags"],
        "additionalProperties": False}}}
    answer = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[search], max_tokens=120, seed=3)
    assert answer.choices[0].finish_reason in ("stop", "tool_calls", "length")
    fetch = {"type": "function", "function": {"name": "fetch", "parameters": {
        "$id": "https://example.com/fetch.json", "type": "object", "properties": {"u": {"$ref": "#/$defs/U"}},
        "required": ["u"], "additionalProperties": False, "$defs": {"U": {"type": "string", "maxLength": 10}}}}}
    for seed in range(3):
        choice = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[fetch], tool_choice="required",
                                             max_tokens=120, seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls"
        for called in choice.message.tool_calls:
            assert len(json.loads(called.function.arguments)["u"]) <= 10  # U's maxLength, through the $ref


def test_a_call_cut_before_its_name_is_whole_is_no_content(oai):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=16, seed=1)
    choice = oai.chat.completions.create(**kwargs).choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("length", None, None)
    streamed = [c.delta.content for chunk in oai.chat.completions.create(stream=True, **kwargs) for c in chunk.choices]
    assert not any(streamed)


def test_a_named_function_is_called_once_and_parallel_tool_calls_may_be_null(server):
    with server.client() as http:
        for seed in range(6):
            answer = http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": ASK, "max_tokens": 300, "seed": seed, "temperature": 1.0, "tools": [TIME],
                "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "parallel_tool_calls": None})
            assert answer.status_code == 200, answer.text
            choice = answer.json()["choices"][0]
            # a named function's call finishes with "stop", as OpenAI and vLLM answer it
            assert choice["finish_reason"] == "stop" and len(choice["message"]["tool_calls"]) == 1, choice


def test_a_byte_model_with_more_rows_than_bytes_keeps_its_constraint(oai):
    """A byte checkpoint of 260 rows: llguidance's vocabulary was 256 + 1 while the logits are 260
    wide, so a constrained row could draw id 256, llguidance's end token, as a byte, and the
    request failed with 500 "bytes must be in range(0, 256)". Ids 256-259 stand for no byte: a
    constraint never allows them (even where the model favours them), and unconstrained they
    decode to nothing."""
    pattern = "[a-z]{1,8}"
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for bias in (None, {"257": 5}, {"256": 5, "259": 5}):
        for top_k in (None, 50):
            extra = {"top_k": top_k} if top_k else {}
            regex = oai.completions.create(model=WIDE, prompt="x", n=8, seed=1, max_tokens=10, temperature=1.0,
                                           logit_bias=bias, extra_body={"guided_regex": pattern, **extra})
            assert all(choice.finish_reason == "stop" and re.fullmatch(pattern, choice.text)
                       for choice in regex.choices), [(c.text, c.finish_reason) for c in regex.choices]
            person = oai.completions.create(model=WIDE, prompt="p = ", n=2, seed=2, max_tokens=400, temperature=1.0,
                                            logit_bias=bias, extra_body={"response_format": response_format, **extra})
            for choice in person.choices:
                assert choice.finish_reason == "stop", choice
                jsonschema.validate(json.loads(choice.text), PERSON)
    plain = oai.completions.create(model=WIDE, prompt="x", max_tokens=4, temperature=0, logit_bias={"257": 100},
                                   logprobs=0)
    choice = plain.choices[0]
    assert choice.text == "" and choice.finish_reason == "length" and choice.logprobs.tokens == ["<id 257>"] * 4
