"""Tool calls and chat templates at the API, in process (a scripted engine stands in for the
engine process, tests/server/scripted_engine.py):

- an assistant message's `tool_calls` are rendered once: by a template that renders them itself
  (in the style of Hugging Face's Hermes/Qwen tool templates), with their arguments as a JSON
  object; for one that does not (the shipped minimal template), as blocks in the content;
- /tokenize takes `tools` with `messages` and renders exactly the prompt chat runs;
- a streamed chat with tools sends every generated token's logprobs, in order, as the answer
  that is not streamed lists them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from xlserve.models.tokenizer import ByteTokenizer
from xlserve.server.api.chat import ChatTemplate
from xlserve.server.api.deps import AppState, ServedModel
from xlserve.server.api.protocol import ChatMessage, ToolDefinition
from xlserve.server.api.serving.completions import chat_prompt
from xlserve.server.engine.types import ChoiceFinished, Finished, TokenEvent
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings

from tests.server.scripted_engine import RecordingEngine, scripted_app

REPO = Path(__file__).resolve().parents[2]
SHIPPED_TEMPLATE = (REPO / "weights" / "transformer-xl-stdlib" / "chat_template.jinja").read_text()
TOOL_MODEL, SHIPPED_MODEL, THINKING_MODEL = "tool-template", "shipped-template", "thinking-template"
# in the style of Qwen3's: a request's `enable_thinking: false` (vLLM's chat_template_kwargs) opens
# the answer with an empty thought
THINKING_TEMPLATE = """\
{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}\
<think></think>{% endif %}{% endif %}"""

# written for these tests in the style of common Hugging Face tool templates: it describes the
# tools, and renders an assistant's calls itself, arguments through `tojson`
TOOL_TEMPLATE = """\
{%- if tools %}
<|system|>Functions you may call:
{%- for tool in tools %}
{{ tool.function | tojson }}
{%- endfor %}
{%- endif %}
{%- for message in messages %}
<|{{ message.role }}|>
{%- if message.content %}{{ message.content }}{% endif %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function %}
<tool_call>{"name": {{ call.name | tojson }}, "arguments": {{ call.arguments | tojson }}}</tool_call>
{%- endfor %}
{%- endif %}
{%- if message.role == 'tool' %} (for {{ message.tool_call_id }}){% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{%- endif %}
"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_2", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Lyon", "days": [1, 2]}'}}]
HISTORY = [{"role": "user", "content": "weather in Paris and Lyon?"},
           {"role": "assistant", "content": None, "tool_calls": CALLS},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>")


@pytest.fixture
def served():
    """(client, state): the app with a byte-level model per template."""
    card = {"id": "", "object": "model", "created": 0, "owned_by": "xlserve", "architecture": "transformer-xl",
            "state_kind": "segment-recurrence", "state_grows_with_context": False, "max_context": None,
            "parameters": 0, "config": {}, "quantize": "none", "weight_bytes": 0, "state_bytes_per_session": 0}
    models = {name: ServedModel(name, ByteTokenizer(), 256, {**card, "id": name}, ChatTemplate(source, name))
              for name, source in [(TOOL_MODEL, TOOL_TEMPLATE), (SHIPPED_MODEL, SHIPPED_TEMPLATE),
                                   (THINKING_MODEL, THINKING_TEMPLATE)]}
    app, state = scripted_app(Settings(models="none-loaded", max_request_body_bytes=100_000),
                              RecordingEngine(Metrics()), models)
    client = TestClient(app)  # not entered: no lifespan, no engine process
    yield client, state
    client.close()


def rendered(state: AppState, model: str, messages: list[dict], tools: list[dict] | None = None) -> str:
    return chat_prompt(state.served(model), [ChatMessage.model_validate(m) for m in messages],
                       tools=[ToolDefinition.model_validate(t) for t in tools] if tools else None)


def ok(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


# -- 1. an assistant's tool calls are rendered once ------------------------------------------------------


def test_the_template_is_read_for_whether_it_renders_tool_calls():
    assert ChatTemplate(TOOL_TEMPLATE, "t").renders_tool_calls
    assert ChatTemplate("{% for m in messages %}{{ m['tool_calls'] | length }}{% endfor %}", "t").renders_tool_calls
    assert ChatTemplate("{% for m in messages %}{{ m.get('tool_calls') }}{% endfor %}", "t").renders_tool_calls
    assert not ChatTemplate(SHIPPED_TEMPLATE, "t").renders_tool_calls
    # a name in a comment or in the text the template writes is not a field it reads
    assert not ChatTemplate("{# no tool_calls here #}tool_calls: {{ messages | length }}", "t").renders_tool_calls
    assert not ChatTemplate("{% for m in messages %}unclosed", "t").renders_tool_calls  # does not compile


def test_a_tool_template_renders_each_call_once_with_its_arguments_as_an_object(served):
    _, state = served
    prompt = rendered(state, TOOL_MODEL, HISTORY, tools=[WEATHER])
    calls = [json.loads(block) for block in BLOCK.findall(prompt)]
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                     {"name": "get_weather", "arguments": {"city": "Lyon", "days": [1, 2]}}]
    assert "<|assistant|><tool_call>" in prompt  # the message's content is empty: the calls are not in it
    assert '"name": "get_weather"' in prompt.split("<|user|>")[0]  # the tools are described before the chat
    assert prompt.endswith("</tool_call><|tool|>sunny (for call_1)<|tool|>rain (for call_2)<|assistant|>")


def test_arguments_that_are_not_json_reach_a_tool_template_as_the_text_they_came_as(served):
    """A client may send back whatever a model wrote; it is rendered, not refused, and never a 500."""
    _, state = served
    broken = [HISTORY[0], {"role": "assistant", "content": "checking", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]
    prompt = rendered(state, TOOL_MODEL, broken)
    assert BLOCK.findall(prompt) == ['{"name": "get_weather", "arguments": "{city: Paris"}']
    assert "<|assistant|>checking<tool_call>" in prompt


def test_the_shipped_template_still_gets_the_calls_as_blocks_in_the_content(served):
    _, state = served
    prompt = rendered(state, SHIPPED_MODEL, HISTORY, tools=[WEATHER])
    blocks = "".join('<tool_call>{"name": "get_weather", "arguments": %s}</tool_call>' % json.dumps(
        json.loads(call["function"]["arguments"])) for call in CALLS)
    assert prompt == ("user: weather in Paris and Lyon?\n"
                      f"assistant: {blocks}\n"
                      "tool: sunny\ntool: rain\nassistant: ")


# -- 3. /tokenize renders tools as chat does -----------------------------------------------------------


def test_tokenize_with_tools_counts_the_prompt_chat_runs(served):
    client, state = served
    for model in (TOOL_MODEL, SHIPPED_MODEL):
        tokens = ok(client.post("/tokenize", json={"model": model, "messages": HISTORY, "tools": [WEATHER]}))
        state.engine.events = [ChoiceFinished(0, "length", "", 0), Finished([], 0, 0, 0, None)]
        state.engine.prompts.clear()
        ok(client.post("/v1/chat/completions", json={"model": model, "messages": HISTORY, "tools": [WEATHER],
                                                     "tool_choice": "none", "max_tokens": 1}))
        (prompt,) = state.engine.prompts
        assert tokens["tokens"] == prompt and tokens["count"] == len(prompt)
        assert prompt == list(rendered(state, model, HISTORY, tools=[WEATHER]).encode())
    # the tools are in the prompt of a template that describes them
    without = ok(client.post("/tokenize", json={"model": TOOL_MODEL, "messages": HISTORY}))["count"]
    with_tools = ok(client.post("/tokenize", json={"model": TOOL_MODEL, "messages": HISTORY,
                                                   "tools": [WEATHER]}))["count"]
    assert with_tools > without


@pytest.mark.parametrize("body, param", [
    ({"prompt": "def", "tools": [WEATHER]}, "tools"),  # tools are rendered with messages only
    ({"messages": HISTORY, "tools": []}, "tools"),
    ({"messages": HISTORY, "tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools.0.function.name"),
    ({"messages": HISTORY, "tools": [{"type": "other", "function": {"name": "f"}}]}, "tools.0.type"),
])
def test_tokenize_refuses_tools_chat_refuses_naming_the_field(served, body, param):
    client, _ = served
    response = client.post("/tokenize", json={"model": TOOL_MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# -- 2. a streamed chat with tools sends every token's logprobs ------------------------------------------


def scripted_answer(text: str) -> list:
    """The events of an answer that writes `text` one character per token; a character past
    ASCII takes two tokens, the first of which releases no text (as the detokenizer holds half a
    character), as a byte-level model writes it."""
    events = []
    for position, character in enumerate(text):
        logprob = -0.01 * (position + 1)
        if ord(character) > 127:
            events.append(TokenEvent(0xC3, "", logprob - 0.005, [(0xC3, logprob - 0.005)]))
        events.append(TokenEvent(ord(character) % 256, character, logprob, [(ord(character) % 256, logprob)]))
    tokens = len(events)
    return [*events, ChoiceFinished(0, "stop", "", tokens), Finished([ChoiceFinished(0, "stop", "", tokens)],
                                                                     5, tokens, 0, None)]


@pytest.mark.parametrize("tool_choice, text", [
    ({"type": "function", "function": {"name": "get_weather"}},
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'),
    ("auto", "No call: Zürich is sunny."),
])
def test_streamed_chat_with_tools_sends_every_tokens_logprobs_in_order(served, tool_choice, text):
    client, state = served
    body = {"model": TOOL_MODEL, "messages": HISTORY[:1], "tools": [WEATHER], "tool_choice": tool_choice,
            "logprobs": True, "top_logprobs": 1, "max_tokens": 200}
    state.engine.events = scripted_answer(text)
    plain = ok(client.post("/v1/chat/completions", json=body))["choices"][0]
    expected = plain["logprobs"]["content"]
    assert len(expected) == len(state.engine.events) - 2  # one per generated token

    state.engine.events = scripted_answer(text)
    response = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    chunks = [json.loads(line[len("data: "):]) for line in response.text.split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [chunk["choices"][0] for chunk in chunks]
    streamed = [entry for choice in choices if choice["logprobs"] for entry in choice["logprobs"]["content"]]
    assert streamed == expected
    assert choices[0]["delta"]["role"] == "assistant"
    if plain["message"].get("tool_calls"):
        # the answer the stream adds up to is still the plain one
        arguments = "".join(delta["function"]["arguments"] for choice in choices
                            for delta in choice["delta"].get("tool_calls") or [])
        assert arguments == plain["message"]["tool_calls"][0]["function"]["arguments"]
        assert not any(choice["delta"].get("content") for choice in choices)
    else:
        assert "".join(choice["delta"].get("content") or "" for choice in choices) == plain["message"]["content"]


def test_tojson_writes_json_as_hub_templates_expect_it():
    """Keys in their order, nothing escaped for HTML, `ensure_ascii` and `indent` taken: what the
    templates on the Hub are written for (Jinja's own filter sorts keys and escapes <, > and &)."""
    from xlserve.server.api.chat import ChatTemplate

    template = ChatTemplate("{{ messages[0].content | tojson }}|{{ value | tojson(ensure_ascii=False, indent=2) }}",
                            origin="test")
    rendered = template.template.render(messages=[{"content": {"b": 1, "a": "<é>&"}}], value={"z": [1]})
    assert rendered == '{"b": 1, "a": "<é>&"}|{\n  "z": [\n    1\n  ]\n}'


# -- chat as OpenAI's clients send it ------------------------------------------------------------------


def test_a_history_as_openais_sdk_dumps_it_is_taken(served):
    """An assistant message OpenAI returned, sent back with the history as `message.model_dump()`
    writes it (refusal, annotations, audio and function_call as null or empty; tool_calls as []
    when it made none), is taken; a refusal stands for the text of a message without content.
    store: false and metadata are OpenAI's and change nothing here; store: true is refused."""
    client, state = served
    dumped = {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": CALLS[:1]}
    history = [HISTORY[0], dumped, HISTORY[2], {"role": "assistant", "content": "ok", "tool_calls": []},
               {"role": "assistant", "content": None, "refusal": "I can't help with that."},
               {"role": "user", "content": "thanks"}]
    state.engine.events = [ChoiceFinished(0, "length", "", 0), Finished([], 0, 0, 0, None)]
    ok(client.post("/v1/chat/completions", json={"model": TOOL_MODEL, "messages": history, "store": False,
                                                 "metadata": {"team": "docs"}}))
    prompt = rendered(state, TOOL_MODEL, history)
    assert prompt.count("<tool_call>") == 1 and "I can't help with that." in prompt
    for refused in ({"store": True}, {"metadata": {str(i): "x" for i in range(17)}},
                    {"messages": [{"role": "assistant", "content": "x", "audio": {"id": "audio_1"}}]}):
        response = client.post("/v1/chat/completions", json={"model": TOOL_MODEL, "messages": history, **refused})
        assert response.status_code == 400, (refused, response.text)


def test_whatever_a_template_raises_on_the_messages_is_a_400():
    """A template that fails on the messages it is given (an arithmetic error, a range past the
    sandbox's bound, a recursion) refuses the request as the template's (400
    chat_template_error), never a 500."""
    from xlserve.server.api.chat import ChatTemplateError

    for source in ("{{ 10 // (messages | length - 1) }}",
                   "{% for i in range(messages[0].content | length * 100000) %}{% endfor %}",
                   "{% macro deep(n) %}{{ deep(n + 1) }}{% endmacro %}{{ deep(0) }}"):
        with pytest.raises(ChatTemplateError):
            ChatTemplate(source, "test").render([{"role": "user", "content": "hi"}])


def test_templates_of_the_hub_render_as_transformers_renders_them(tmp_path):
    """`{% generation %}` (transformers' mark of what the assistant wrote) renders its body; a
    checkpoint's named tool_use template is the one rendered when a request gives tools; OpenAI's
    developer role reaches a template with no branch for it as system."""
    from xlserve.server.api.chat import load_chat_template

    marked = ChatTemplate("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}",
                          "test")
    assert marked.render([{"role": "assistant", "content": "hi"}]) == "[hi]"

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "DEFAULT{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "TOOLS{{ tools | length }}{% for m in messages %}{{ m.content }}{% endfor %}"},
    ]}))
    template = load_chat_template({}, tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages) == "DEFAULThi"
    assert template.render(messages, tools=[WEATHER]) == "TOOLS1hi"

    plain = ChatTemplate("{% for m in messages %}{% if m.role == 'system' %}S:{{ m.content }} {% elif m.role == "
                         "'user' %}U:{{ m.content }}{% endif %}{% endfor %}", "test")
    developer = [{"role": "developer", "content": "in French"}, {"role": "user", "content": "hi"}]
    assert plain.render(developer) == "S:in French U:hi"
    knowing = ChatTemplate("{% for m in messages %}{% if m.role == 'developer' %}D:{{ m.content }} {% endif %}"
                           "{% endfor %}", "test")
    assert knowing.render(developer) == "D:in French "


def test_an_answer_can_go_on_from_a_prefilled_assistant_message(served):
    """vLLM's add_generation_prompt and continue_final_message: without the assistant's turn after
    the messages, or ending where the last message's content ends (the template's end-of-turn
    after it cut off), so the answer goes on from a prefilled start; /tokenize counts the same
    prompt. Both at once, or a last message that is not the assistant's, is 400 naming why."""
    client, state = served
    messages = [{"role": "user", "content": "the weather?"}, {"role": "assistant", "content": "It is"}]
    state.engine.events = [ChoiceFinished(0, "length", "", 0), Finished([], 0, 0, 0, None)]
    body = {"model": TOOL_MODEL, "messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    ok(client.post("/v1/chat/completions", json=body))
    sent = bytes(state.engine.prompts[-1]).decode()
    assert sent.endswith("<|assistant|>It is") and sent == rendered(state, TOOL_MODEL, messages, None)[: len(sent)]
    tokenized = ok(client.post("/tokenize", json={k: v for k, v in body.items()}))
    assert tokenized["tokens"] == state.engine.prompts[-1]

    state.engine.events = [ChoiceFinished(0, "length", "", 0), Finished([], 0, 0, 0, None)]
    ok(client.post("/v1/chat/completions", json={"model": TOOL_MODEL, "messages": messages[:1],
                                                 "add_generation_prompt": False}))
    assert not bytes(state.engine.prompts[-1]).decode().rstrip().endswith("<|assistant|>")

    for wrong in ({**body, "add_generation_prompt": True}, {**body, "messages": messages[:1]}):
        for route in ("/v1/chat/completions", "/tokenize"):
            response = client.post(route, json=wrong)
            assert response.status_code == 400 and "continue_final_message" in response.text, (route, response.text)
    response = client.post("/tokenize", json={"model": TOOL_MODEL, "prompt": "It is", "add_generation_prompt": False,
                                              "continue_final_message": True})
    assert response.status_code == 400 and "continue_final_message" in response.text, response.text


def test_a_request_gives_the_template_further_variables(served):
    """vLLM's chat_template_kwargs: variables a template reads besides the messages (Qwen3's
    enable_thinking), on chat and /tokenize alike, and through a checkpoint's tool_use template.
    One the server sets itself (messages, tools, add_generation_prompt, the special tokens), a
    name no template can read, or the field with a prompt instead of messages is 400 naming why."""
    client, state = served
    messages = [{"role": "user", "content": "hi"}]
    prompts = {}
    for variables in (None, {"enable_thinking": False}, {"enable_thinking": True, "persona": {"name": "x"}}):
        state.engine.events = [ChoiceFinished(0, "length", "", 0), Finished([], 0, 0, 0, None)]
        body = {"model": THINKING_MODEL, "messages": messages}
        if variables is not None:
            body["chat_template_kwargs"] = variables
        ok(client.post("/v1/chat/completions", json=body))
        prompts[json.dumps(variables)] = bytes(state.engine.prompts[-1]).decode()
        assert ok(client.post("/tokenize", json=body))["tokens"] == state.engine.prompts[-1]
    assert prompts["null"] == "<|user|>hi<|assistant|>" == prompts[json.dumps({"enable_thinking": True,
                                                                                "persona": {"name": "x"}})]
    assert prompts[json.dumps({"enable_thinking": False})] == "<|user|>hi<|assistant|><think></think>"

    for variables, named in (({"tools": []}, "tools"), ({"add_generation_prompt": False}, "add_generation_prompt"),
                             ({"eos_token": "</s>"}, "eos_token"), ({"not a name": 1}, "chat_template_kwargs")):
        for route in ("/v1/chat/completions", "/tokenize"):
            response = client.post(route, json={"model": THINKING_MODEL, "messages": messages,
                                                "chat_template_kwargs": variables})
            assert response.status_code == 400 and named in response.text, (route, variables, response.text)
    response = client.post("/tokenize", json={"model": THINKING_MODEL, "prompt": "hi",
                                              "chat_template_kwargs": {"enable_thinking": False}})
    assert response.status_code == 400 and "chat_template_kwargs" in response.text, response.text


def test_a_tool_use_template_gets_the_requests_variables_too(tmp_path):
    from xlserve.server.api.chat import load_chat_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "DEFAULT{{ mood }}"},
        {"name": "tool_use", "template": "TOOLS{{ mood }}"},
    ]}))
    template = load_chat_template({}, tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages, variables={"mood": "!"}) == "DEFAULT!"
    assert template.render(messages, tools=[WEATHER], variables={"mood": "?"}) == "TOOLS?"


def test_a_prefill_ending_in_a_space_goes_on_under_a_template_that_trims():
    """A template that trims each message's content (Llama 3's `| trim`) drops a prefill's
    trailing space, and continue_final_message was 400 where vLLM (through transformers, which
    then cuts after the stripped content) goes on from "The colour is"."""
    from xlserve.server.api.errors import InvalidRequest

    trimming = ChatTemplate("{% for m in messages %}<|{{ m.role }}|>\n\n{{ m.content | trim }}<|eot|>{% endfor %}"
                            "{% if add_generation_prompt %}<|assistant|>\n\n{% endif %}", "test")
    served = ServedModel("llama-like", ByteTokenizer(), 256, {}, trimming)
    messages = [ChatMessage(role="user", content="Name a colour."), ChatMessage(role="assistant", content="The colour is ")]
    assert chat_prompt(served, messages, add_generation_prompt=False, continue_final_message=True).endswith(
        "<|assistant|>\n\nThe colour is")
    with pytest.raises(InvalidRequest, match="content as it is"):  # content the template does not write at all
        chat_prompt(served, [messages[0], ChatMessage(role="assistant", content="   ")], add_generation_prompt=False,
                    continue_final_message=True)
