"""POST /v1/chat/completions (checkpoints with a chat template), /tokenize and /detokenize,
against a real server. The checkpoints are copies of the tiny one to which each test setup adds
a template, in each of the places a Hugging Face checkpoint keeps one. The test process runs no
model."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.e2e.server_process import ServerProcess

PLAIN = "txl-tiny"  # no chat template
FILE = "chat-file"  # chat_template.jinja
CONFIGURED = "chat-config"  # tokenizer_config.json: named templates, bos/eos tokens
BROKEN = "chat-broken"  # config.json: a template that does not compile

FILE_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'system' and not loop.first %}"
    "{{ raise_exception('the system message must come first') }}"
    "{% endif %}"
    "<|{{ message.role }}|>{{ message.content }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONFIG_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
                   "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def fib(n):"}]
RENDERED = "<|system|>Be brief.\n<|user|>def fib(n):\n<|assistant|>"
MAX_TOKENS_LIMIT = 48  # the server's XLSERVE_MAX_TOKENS_LIMIT


@pytest.fixture(scope="module")
def chat_server(tiny_checkpoint, tmp_path_factory):
    weights = tmp_path_factory.mktemp("chat-weights")
    with_file = shutil.copytree(tiny_checkpoint, weights / FILE)
    (with_file / "chat_template.jinja").write_text(FILE_TEMPLATE)
    configured = shutil.copytree(tiny_checkpoint, weights / CONFIGURED)
    (configured / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"},
        "chat_template": [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": CONFIG_TEMPLATE}],
    }))
    broken = shutil.copytree(tiny_checkpoint, weights / BROKEN)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "chat_template": "{% for m in messages %}unclosed"}))
    process = ServerProcess([tiny_checkpoint, with_file, configured, broken],
                            env={"XLSERVE_MAX_TOKENS_LIMIT": str(MAX_TOKENS_LIMIT)},
                            log_path=tmp_path_factory.mktemp("logs") / "chat.log").start()
    yield process
    process.stop()


@pytest.fixture
def client(chat_server):
    with chat_server.client() as c:
        yield c


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def sse_events(response: httpx.Response) -> list:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


# -- chat completions ------------------------------------------------------------------------------------


def test_tool_call_arguments_nested_past_the_body_limit_stay_text(client):
    """An assistant message's tool call arguments are parsed as JSON to render them; nested deeper
    than a body may be, they stay the text they came as (once a RecursionError: a 500)."""
    deep = "[" * 5_000 + "]" * 5_000
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    ok(client.post("/v1/chat/completions", json={"model": FILE, "messages": messages, "max_tokens": 1}))
    assert ok(client.post("/tokenize", json={"model": FILE, "messages": messages}))["count"] > 0


def test_a_chat_answer_without_max_tokens_runs_to_the_servers_limit(client):
    """OpenAI's chat and vLLM's have no 16-token default: without max_tokens (or
    max_completion_tokens) the answer runs until it stops, at most XLSERVE_MAX_TOKENS_LIMIT."""
    answer = ok(client.post("/v1/chat/completions", json={"model": FILE, "messages": MESSAGES, "temperature": 0}))
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT
    assert answer["choices"][0]["finish_reason"] == "length"
    answer = ok(client.post("/v1/chat/completions", json={"model": FILE, "messages": MESSAGES, "temperature": 0,
                                                          "max_completion_tokens": 5}))
    assert answer["usage"]["completion_tokens"] == 5


def test_chat_runs_the_prompt_its_template_renders(client):
    tokens = ok(client.post("/tokenize", json={"model": FILE, "messages": MESSAGES}))
    assert ok(client.post("/detokenize", json={"model": FILE, "tokens": tokens["tokens"]}))["prompt"] == RENDERED

    answer = ok(client.post("/v1/chat/completions", json={"model": FILE, "messages": MESSAGES, "max_tokens": 8,
                                                          "temperature": 0}))
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert answer["model"] == FILE and "session_id" not in answer
    (choice,) = answer["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant"
    plain = ok(client.post("/v1/completions", json={"model": FILE, "prompt": RENDERED, "max_tokens": 8,
                                                    "temperature": 0}))
    assert choice["message"]["content"] == plain["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens"] == len(RENDERED.encode()) == tokens["count"]
    assert answer["usage"]["completion_tokens"] == 8
    # OpenAI's newer name for the limit
    newer = ok(client.post("/v1/chat/completions", json={"model": FILE, "messages": MESSAGES,
                                                         "max_completion_tokens": 3, "temperature": 0}))
    assert newer["usage"]["completion_tokens"] == 3


def test_streamed_chat_is_chunks_that_add_up_to_the_answer(client):
    request = {"model": FILE, "messages": MESSAGES, "max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 11}
    plain = ok(client.post("/v1/chat/completions", json=request))
    with client.stream("POST", "/v1/chat/completions",
                       json={**request, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    texts, roles, finish = {}, {}, {}
    for event in map(json.loads, events[:-2]):
        assert event["object"] == "chat.completion.chunk" and event["id"].startswith("chatcmpl-")
        (choice,) = event["choices"]
        index = choice["index"]
        if index not in roles:  # the first delta of each choice says whose turn it is
            roles[index] = choice["delta"].get("role")
        else:
            assert "role" not in choice["delta"]
        texts[index] = texts.get(index, "") + choice["delta"].get("content", "")
        if choice["finish_reason"] is not None:
            finish[index] = choice["finish_reason"]
    assert roles == {0: "assistant", 1: "assistant"}
    assert finish == {0: "length", 1: "length"}
    assert texts == {c["index"]: c["message"]["content"] for c in plain["choices"]}


def test_max_completion_tokens_0_ends_every_choice_with_length(client):
    """As a completion's (test_api_edges.py): each choice says why it ended, unstreamed and in a
    streamed chunk of its own; before, no chunk carried it and the answer said null."""
    chat = {"model": FILE, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0, "n": 2}
    assert [choice["finish_reason"] for choice in ok(client.post("/v1/chat/completions", json=chat))["choices"]] \
        == ["length", "length"]
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as response:
        assert response.status_code == 200
        events = [json.loads(event) for event in sse_events(response) if event != "[DONE]"]
    finished = {choice["index"]: choice["finish_reason"] for event in events
                for choice in event["choices"] if choice["finish_reason"]}
    assert finished == {0: "length", 1: "length"}


def test_the_openai_client_chats(chat_server):
    oai = chat_server.openai_client(api_key="unused")
    answer = oai.chat.completions.create(model=FILE, messages=MESSAGES, max_tokens=5, temperature=0)
    assert answer.choices[0].message.role == "assistant" and answer.usage.completion_tokens == 5
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in oai.chat.completions.create(
        model=FILE, messages=MESSAGES, max_tokens=5, temperature=0, stream=True) if chunk.choices)
    assert streamed == answer.choices[0].message.content
    with_logprobs = oai.chat.completions.create(model=FILE, messages=MESSAGES, max_tokens=3, temperature=0,
                                                logprobs=True, top_logprobs=2)
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == 3 and all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)


def test_templates_in_tokenizer_config_use_the_default_and_special_tokens(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    for add_generation_prompt, expected in [(True, "<s>[user] hi\nthere</s>[assistant] "),
                                            (False, "<s>[user] hi\nthere</s>")]:
        tokens = ok(client.post("/tokenize", json={"model": CONFIGURED, "messages": messages,
                                                   "add_generation_prompt": add_generation_prompt}))["tokens"]
        assert ok(client.post("/detokenize", json={"model": CONFIGURED, "tokens": tokens}))["prompt"] == expected
    answer = ok(client.post("/v1/chat/completions", json={"model": CONFIGURED, "messages": messages, "max_tokens": 2}))
    assert answer["usage"]["prompt_tokens"] == len("<s>[user] hi\nthere</s>[assistant] ")


def test_a_model_without_a_template_is_a_clear_400(client):
    error = error_of(client.post("/v1/chat/completions", json={"model": PLAIN, "messages": MESSAGES}))
    assert error["code"] == "no_chat_template" and error["param"] == "model"
    assert "has no chat template" in error["message"]
    error = error_of(client.post("/tokenize", json={"model": PLAIN, "messages": MESSAGES}))
    assert error["code"] == "no_chat_template"


def test_a_template_that_refuses_or_does_not_compile_is_a_400(client):
    wrong_order = [MESSAGES[1], MESSAGES[0]]
    error = error_of(client.post("/v1/chat/completions", json={"model": FILE, "messages": wrong_order}))
    assert error["code"] == "chat_template_error" and error["param"] == "messages"
    assert "the system message must come first" in error["message"]
    error = error_of(client.post("/v1/chat/completions", json={"model": BROKEN, "messages": MESSAGES}))
    assert error["code"] == "chat_template_error" and "does not compile" in error["message"]


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls"),
    ({"messages": MESSAGES, "tools": []}, "tools"),
    ({"messages": MESSAGES, "session_id": "sess_x"}, "session_id"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "n": 17}, "n"),
    ({"messages": MESSAGES, "max_tokens": 10**6}, "max_tokens"),
    ({"messages": MESSAGES, "logit_bias": {"999": 1}}, "logit_bias"),
])
def test_bad_chat_requests_are_400_naming_the_field(client, fields, param):
    assert error_of(client.post("/v1/chat/completions", json={"model": FILE, **fields}))["param"] == param


def test_an_x_session_id_header_on_chat_is_a_mismatch_as_on_completions(client):
    """Chat is about no session: an X-Session-Id header (a proxy routes by it) is refused as
    /v1/completions refuses it on a request without session_id, streamed or not."""
    header = {"X-Session-Id": "sess_elsewhere"}
    plain = error_of(client.post("/v1/completions", json={"model": FILE, "prompt": "x", "max_tokens": 1},
                                 headers=header))
    for stream in (False, True):
        chat = error_of(client.post("/v1/chat/completions", headers=header,
                                    json={"model": FILE, "messages": MESSAGES, "max_tokens": 1, "stream": stream}))
        assert chat == plain and chat["code"] == "session_id_mismatch" and chat["param"] == "X-Session-Id"
        assert "sess_elsewhere" in chat["message"] and "no session" in chat["message"]
    ok(client.post("/v1/chat/completions", json={"model": FILE, "messages": MESSAGES, "max_tokens": 1}))


# -- tokenize and detokenize ------------------------------------------------------------------------------


def test_tokenize_and_detokenize_as_vllm(client):
    card = ok(client.get(f"/v1/models/{PLAIN}"))
    answer = ok(client.post("/tokenize", json={"model": PLAIN, "prompt": "héllo"}))
    assert answer == {"count": 6, "max_model_len": card["max_context"], "tokens": list("héllo".encode())}
    assert ok(client.post("/detokenize", json={"model": PLAIN, "tokens": answer["tokens"]})) == {"prompt": "héllo"}
    # bytes that are no UTF-8 text on their own still detokenize (as U+FFFD)
    assert ok(client.post("/detokenize", json={"model": PLAIN, "tokens": [104, 195]}))["prompt"] == "h\ufffd"
    assert ok(client.post("/tokenize", json={"model": PLAIN, "prompt": ""}))["count"] == 0


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": PLAIN}, 400, "prompt"),
    ("/tokenize", {"model": FILE, "prompt": "x", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"model": PLAIN, "tokens": [1, 256]}, 400, "tokens"),
    ("/detokenize", {"model": PLAIN, "tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"model": PLAIN, "tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"model": "no-such-model", "tokens": [1]}, 404, "model"),
])
def test_tokenize_errors(client, path, body, status, param):
    assert error_of(client.post(path, json=body), status)["param"] == param


def test_tokenize_takes_the_api_key(tiny_checkpoint):
    server = ServerProcess([tiny_checkpoint], env={"XLSERVE_API_KEYS": "key-a"}).start()
    try:
        with server.client() as client:
            for path, body in [("/tokenize", {"model": PLAIN, "prompt": "x"}),
                               ("/detokenize", {"model": PLAIN, "tokens": [120]})]:
                assert error_of(client.post(path, json=body), 401)["type"] == "authentication_error"
                assert client.post(path, json=body, headers={"Authorization": "Bearer key-a"}).status_code == 200
    finally:
        server.stop()
