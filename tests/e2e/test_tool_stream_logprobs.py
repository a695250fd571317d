"""Chat with tools against a real server running the shipped byte-level Transformer-XL, through
the unmodified `openai` client where it applies:

- a streamed answer that calls a tool sends every generated token's logprobs, as OpenAI sends
  them (`choices[].logprobs.content`), and they add up to the unstreamed answer's list;
- a copy of the shipped checkpoint with a tool-aware template (in the style of Hugging Face's
  Hermes/Qwen templates: it describes the tools and renders an assistant's `tool_calls` itself)
  gets each earlier call once, its arguments as a JSON object;
- /tokenize with `messages` and `tools` counts the prompt chat runs (`usage.prompt_tokens`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.e2e.server_process import ServerProcess
from tests.server.test_tool_templates import TOOL_TEMPLATE  # a tool-aware template in the Hub's style

REPO = Path(__file__).resolve().parents[2]
SHIPPED = "transformer-xl-stdlib"
WITH_TOOLS = "txl-tool-template"  # the shipped checkpoint with TOOL_TEMPLATE as its chat_template.jinja
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather?"}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with_tools = shutil.copytree(REPO / "weights" / SHIPPED, tmp_path_factory.mktemp("weights") / WITH_TOOLS)
    (with_tools / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    process = ServerProcess([REPO / "weights" / SHIPPED, with_tools],
                            log_path=tmp_path_factory.mktemp("logs") / "server.log").start()
    yield process
    process.stop()


@pytest.mark.parametrize("model", [SHIPPED, WITH_TOOLS])
def test_a_streamed_tool_call_sends_every_tokens_logprobs(oai, model):
    kwargs = dict(model=model, messages=HISTORY, tools=[WEATHER], temperature=0, max_tokens=120,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  logprobs=True, top_logprobs=2)
    plain = oai.chat.completions.create(**kwargs).choices[0]
    assert plain.finish_reason == "stop" and plain.message.tool_calls  # a named function's call: OpenAI's "stop"
    expected = plain.logprobs.content
    streamed, arguments = [], ""
    for chunk in oai.chat.completions.create(stream=True, **kwargs):  # parsed as ChatCompletionChunk
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content or []
            for delta in choice.delta.tool_calls or []:
                arguments += (delta.function.arguments or "") if delta.function else ""
    assert arguments == plain.message.tool_calls[0].function.arguments  # the same answer, greedy both times
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in expected]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [[t.token for t in e.top_logprobs]
                                                                     for e in expected]
    # every generated token has its entry, the call's head and end (held back while they are written) too
    assert b"".join(bytes(e.bytes) for e in streamed).decode().startswith('<tool_call>{"name": "get_weather"')


def test_a_tool_template_gets_each_earlier_call_once_as_an_object(server):
    with server.client() as client:
        answer = client.post("/tokenize", json={"model": WITH_TOOLS, "messages": HISTORY, "tools": [WEATHER]})
        assert answer.status_code == 200, answer.text
        text = client.post("/detokenize", json={"model": WITH_TOOLS, "tokens": answer.json()["tokens"]})
    prompt = text.json()["prompt"]
    blocks = re.findall(r"<tool_call>(.*?)</tool_call>", prompt)
    assert [json.loads(block) for block in blocks] == [{"name": "get_weather",
                                                        "arguments": {"city": "Paris", "unit": "celsius"}}]
    assert prompt.startswith("<|system|>Functions you may call:") and '"name": "get_weather"' in prompt


@pytest.mark.parametrize("model", [SHIPPED, WITH_TOOLS])
def test_tokenize_with_tools_counts_the_chat_prompt(server, oai, model):
    with server.client() as client:
        counted = client.post("/tokenize", json={"model": model, "messages": HISTORY, "tools": [WEATHER]})
        assert counted.status_code == 200, counted.text
    for tool_choice in ("none", "auto"):  # the prompt does not depend on it
        chat = oai.chat.completions.create(model=model, messages=HISTORY, tools=[WEATHER], tool_choice=tool_choice,
                                           max_tokens=1, temperature=0)
        assert chat.usage.prompt_tokens == counted.json()["count"]
