"""The API's input edges against a real server with an API key, running the shipped byte-level
Transformer-XL, through the unmodified `openai` client where a client would use it:

- tools whose parameters refer to parts of themselves (`openai.pydantic_function_tool` of a model
  with a nested and a recursive model: `$defs` and `$ref`) are called with arguments that
  validate against the model;
- OpenAI's signed seeds (taken modulo 2**64) and top_p 0 (the most likely token) are served;
- chat logprobs carry the bytes of byte tokens;
- a long list of prompts is 400 naming the limit; a malformed Idempotency-Key is 400 without a
  session too; a body without the key is 401 before it is read.
(tests/server/test_api_input_edges.py checks the same edges in detail, without a model.)"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.server_process import ServerProcess

REPO = Path(__file__).resolve().parents[2]
MODEL = "transformer-xl-stdlib"
KEY = "edge-key"
ASK = [{"role": "user", "content": "Who lives here?"}]


class Address(BaseModel):
    street: str = Field(max_length=12)
    number: int = Field(ge=1, le=999)


class Node(BaseModel):
    value: int = Field(ge=0, le=99)
    next: "Node | None" = None


class Person(BaseModel):
    name: str = Field(max_length=12)
    home: Address  # a nested model: "#/$defs/Address"
    chain: Node  # a recursive one: "#/$defs/Node" refers to itself


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess([REPO / "weights" / MODEL], env={"XLSERVE_API_KEYS": KEY,
                                                             "XLSERVE_STRUCTURED_MAX_BYTES": "20000"},
                            log_path=tmp_path_factory.mktemp("logs") / "server.log").start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def oai(server):
    with server.openai_client(api_key=KEY, timeout=120) as client:
        yield client


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        yield client


def test_a_pydantic_tool_with_nested_and_recursive_models_is_called_with_valid_arguments(oai):
    tool = openai.pydantic_function_tool(Person)
    assert "$defs" in tool["function"]["parameters"]  # the schema refers to its own parts
    answer = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[tool], n=4, seed=0, temperature=1.0,
                                         tool_choice={"type": "function", "function": {"name": "Person"}},
                                         max_tokens=1500)
    # a named function's whole call finishes with "stop", as OpenAI and vLLM answer it
    called = [choice for choice in answer.choices if choice.finish_reason == "stop" and choice.message.tool_calls]
    assert called, [choice.finish_reason for choice in answer.choices]  # a recursive chain may run past max_tokens
    for choice in called:
        (call,) = choice.message.tool_calls
        assert call.function.name == "Person"
        Person.model_validate_json(call.function.arguments)  # garbage text, but in the schema's shape


def test_openai_s_signed_seeds_and_top_p_0_are_served(oai):
    def text(**fields) -> str:
        return oai.completions.create(model=MODEL, prompt="def f(", max_tokens=8, **fields).choices[0].text

    # a seed is taken modulo 2**64: -1 draws as 2**64 - 1 does
    assert text(seed=-1, temperature=1.0) == text(seed=2**64 - 1, temperature=1.0)
    assert text(top_p=0, temperature=1.0, seed=3) == text(temperature=0)  # only the most likely token


def test_chat_logprobs_carry_the_bytes_of_byte_tokens(oai):
    # token 195 is byte 0xC3, named "<0xC3>": the first byte of "é" and other characters
    answer = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, logprobs=True, top_logprobs=2,
                                         logit_bias={"195": 100})
    content = answer.choices[0].logprobs.content
    assert [(entry.token, entry.bytes) for entry in content] == [("<0xC3>", [0xC3])] * 2
    for entry in content:
        for top in entry.top_logprobs:  # an ASCII character's name is itself, any other byte's "<0xNN>"
            expected = list(top.token.encode()) if len(top.token) == 1 else [int(top.token[3:5], 16)]
            assert top.bytes == expected, top


def test_a_long_list_of_prompts_is_400_naming_the_limit(http):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 20_000})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "at most 16 prompts" in error["message"]


def test_a_malformed_idempotency_key_is_400_without_a_session(http):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    response = http.post("/v1/completions", json=body, headers={"Idempotency-Key": "two words"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_idempotency_key"
    assert http.post("/v1/completions", json=body, headers={"Idempotency-Key": "one-word"}).status_code == 200


def test_a_body_without_the_key_is_401_before_it_is_read(server):
    deep = b"[" * 100 + b"]" * 100  # read and scanned, this would be 400 json_too_deep
    response = httpx.post(server.url + "/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"
