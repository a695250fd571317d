"""The README's chat example runs as written against the shipped `transformer-xl-stdlib`, which
carries a minimal byte-level chat template; a checkpoint without one is served with the
template the `chat_template` setting names (`--chat-template` / XLSERVE_CHAT_TEMPLATE), while
a checkpoint's own template is kept. One real server on loopback serves both."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.e2e.server_process import ServerProcess

README = Path(__file__).resolve().parents[2] / "README.md"
SHIPPED = "transformer-xl-stdlib"
SETTING_TEMPLATE = "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}{% endfor %}"


def readme_chat_request() -> tuple[str, dict]:
    """The path and JSON body of the README's `curl .../v1/chat/completions` example."""
    text = README.read_text()
    match = re.search(r"^curl -s localhost:8000(/v1/chat/completions) [^\n]*\\\n(\s+-d '[^']*')", text,
                      flags=re.MULTILINE)
    assert match, "the README has no chat completions curl example"
    words = shlex.split(match.group(2))
    return match.group(1), json.loads(words[words.index("-d") + 1])


@pytest.fixture(scope="module")
def chat_server(tiny_checkpoint, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(SETTING_TEMPLATE)
    process = ServerProcess([SHIPPED, tiny_checkpoint], env={"XLSERVE_CHAT_TEMPLATE": str(template)},
                            log_path=tmp_path_factory.mktemp("logs") / "server.log").start(timeout=120)
    yield process
    process.stop()


def test_the_readme_chat_example_answers_with_content(chat_server):
    path, body = readme_chat_request()
    assert body["model"] == SHIPPED
    with chat_server.client() as client:
        response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion"
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    assert answer["usage"]["completion_tokens"] > 0


def prompt_text(client, model: str, messages: list[dict]) -> str:
    """The prompt the model's chat template makes of `messages` (a byte-level model's tokens
    turned back into text)."""
    tokens = client.post("/tokenize", json={"model": model, "messages": messages})
    assert tokens.status_code == 200, tokens.text
    text = client.post("/detokenize", json={"model": model, "tokens": tokens.json()["tokens"]})
    assert text.status_code == 200, text.text
    return text.json()["prompt"]


def test_shipped_template_is_kept_and_the_setting_serves_a_checkpoint_without_one(chat_server, tiny_checkpoint):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with chat_server.client() as client:
        assert prompt_text(client, SHIPPED, messages) == "system: be brief\nuser: hi\nassistant: "
        assert prompt_text(client, tiny_checkpoint.name, messages) == "<system>be brief<user>hi"
        response = client.post("/v1/chat/completions", json={"model": tiny_checkpoint.name, "messages": messages,
                                                              "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len("<system>be brief<user>hi")
