"""Imported Mamba, Mamba-2 and RWKV checkpoints served end to end (issue 37): a random reference
of each, built with transformers' own classes in the second reference environment
(tests/models/hf_reference.py) and given a byte-level BPE tokenizer.json and a chat template,
goes through `xlserve convert` and a real server. The start-up log names each model's tokenizer;
a session continues exactly as one request over the same text; a stateless multi-turn client
(the unmodified openai package) is served from the prefix-state cache from its second turn on,
with the answers of a cold run; chat completions render the checkpoint's template; structured
output and chat's tools are enforced over the byte-level BPE's tokens."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
from openai import OpenAI

from tests.e2e.server_process import REPO, ServerProcess
from tests.e2e.session_tools import append, create, ok
from tests.models.hf_reference import reference_runs
from tests.models.test_convert_recurrent import TEMPLATE, byte_level_tokenizer_json
from xlserve.models.convert import convert

VOCAB = 300  # embeddings for the 290 tokens of the byte-level tokenizer, and a few spare rows
CONFIGS = {
    "mamba": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2,
                  time_step_rank=4),
    "mamba2": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2,
                   num_heads=4, head_dim=16, n_groups=1, chunk_size=16),
    "rwkv": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64, context_length=128),
}
MODELS = {f"{arch}-imported": arch for arch in CONFIGS}
# each ends where the byte-level pre-tokenizer splits anyway ("[]" | " for"), so the pieces
# tokenize as their concatenation does (checked through /tokenize)
TURNS = ["def parse(text):", " values = []", " for line in text.splitlines():"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("imported")
    specs = [dict(arch=arch, config=config, seed=i, dir=str(root / arch), tokens=[[1, 2, 3, 4]], prompt=2, new=1)
             for i, (arch, config) in enumerate(CONFIGS.items())]
    reference_runs(specs)
    tokenizer = byte_level_tokenizer_json(290)
    converted = {}
    for name, arch in MODELS.items():
        source = root / arch / "hf"
        (source / "tokenizer.json").write_text(tokenizer)
        (source / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
        if arch == "mamba":  # the command a user runs, once; the others in this process (one torch import fewer)
            done = subprocess.run([sys.executable, "-m", "xlserve.server.cli", "convert", str(source), str(root / name)],
                                  cwd=REPO, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
        else:
            convert(source, root / name)
        converted[name] = root / name
    return converted


@pytest.fixture(scope="module")
def server(imported, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "imported.log"
    process = ServerProcess(list(imported.values()), log_path=log, log_level="info").start()
    process.log = log
    yield process
    process.stop()


def openai_client(server) -> OpenAI:
    return server.openai_client(api_key="unused", timeout=60)


def test_the_start_up_log_names_each_models_tokenizer(server):
    text = server.log.read_text()
    for name, arch in MODELS.items():
        (line,) = [line for line in text.splitlines() if f"model {name}: {arch}, " in line]
        assert line.endswith("tokenizer tokenizer.json (the tokenizers library)"), line


@pytest.mark.parametrize("model", list(MODELS))
def test_a_session_continues_as_one_request(server, model):
    """Appending a prompt to a session in two pieces, then generating greedily, gives the tokens of
    one stateless request over the whole prompt."""
    prompt = "".join(TURNS)
    with server.client() as client:
        tokens = [ok(client.post("/tokenize", json={"model": model, "prompt": text}))["tokens"] for text in [*TURNS, prompt]]
        assert tokens[0] + tokens[1] + tokens[2] == tokens[3]
        session = create(client, model)
        append(client, session, TURNS[0])
        append(client, session, TURNS[1])
        continued = ok(client.post("/v1/completions", json={"model": model, "prompt": TURNS[2], "max_tokens": 16,
                                                             "temperature": 0, "session_id": session}))
        whole = ok(client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16,
                                                         "temperature": 0, "prefix_cache": False}))
    assert continued["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert continued["choices"][0]["text"] == whole["choices"][0]["text"]
    assert continued["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("model", list(MODELS))
def test_a_stateless_conversation_is_served_from_the_prefix_cache(server, model):
    prompt, answers, cached = "", [], []
    with openai_client(server) as oai:
        for message in TURNS:
            prompt += message
            result = oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            answers.append(result.choices[0].text)
            cached.append(result.usage.prompt_tokens_details.cached_tokens)
            prompt += result.choices[0].text
        cold, prompt = [], ""
        for message in TURNS:  # the same conversation with the cache off: the same answers
            prompt += message
            text = oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"prefix_cache": False}).choices[0].text
            cold.append(text)
            prompt += text
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    assert answers == cold


@pytest.mark.parametrize("model", list(MODELS))
def test_chat_completions_use_the_checkpoints_template(server, model):
    messages = [{"role": "user", "content": "def main():"}]
    with openai_client(server) as oai:
        answer = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    with server.client() as client:
        rendered = "<|user|>def main():<|endoftext|><|assistant|>"
        counted = ok(client.post("/tokenize", json={"model": model, "prompt": rendered}))
    assert answer.usage.prompt_tokens == counted["count"]
    assert isinstance(answer.choices[0].message.content, str)


@pytest.mark.parametrize("model", list(MODELS))
def test_generation_ends_at_the_checkpoints_end_of_text(server, imported, model):
    """The end-of-text token the source's config.json names (eos_token_id: transformers' defaults,
    0 for Mamba and RWKV, 2 for Mamba-2) ends a completion with finish_reason "stop" and is not
    sent (but counted in the usage), as transformers' generate() and vLLM end it, streamed or not; `ignore_eos` goes on
    through it. Forced here by logit_bias: a random model would draw it only by chance."""
    source = imported[model].parent / MODELS[model] / "hf" / "config.json"
    end = json.loads(source.read_text())["eos_token_id"]
    forced = {"model": model, "prompt": TURNS[0], "max_tokens": 4, "temperature": 0, "logit_bias": {str(end): 100}}
    with server.client() as client:
        ended = ok(client.post("/v1/completions", json=forced))
        going_on = ok(client.post("/v1/completions", json={**forced, "ignore_eos": True, "logprobs": 0}))
        with client.stream("POST", "/v1/completions", json={**forced, "stream": True}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert end == (2 if MODELS[model] == "mamba2" else 0)
    assert ended["choices"][0]["text"] == "" and ended["choices"][0]["finish_reason"] == "stop", ended
    assert ended["usage"]["completion_tokens"] == 1  # the end of text, counted as OpenAI and vLLM count it
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == ""
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks][-1] == "stop"
    assert going_on["choices"][0]["finish_reason"] == "length" and going_on["usage"]["completion_tokens"] == 4
    assert len(going_on["choices"][0]["logprobs"]["tokens"]) == 4


# -- structured output over the byte-level BPE -------------------------------------------------------------

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "a word's definition",
    "parameters": {"type": "object", "required": ["word"], "additionalProperties": False,
                   "properties": {"word": {"type": "string", "maxLength": 10}}}}}
ASK = [{"role": "user", "content": "def main():"}]


@pytest.mark.parametrize("model", list(MODELS))
def test_json_schema_and_regex_are_enforced_over_the_byte_level_bpe(server, model):
    """A tokenizer.json with GPT-NeoX's byte-level BPE (and the model's spare rows past it) takes
    structured output, where every such model was refused with 400 constraint_not_supported."""
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with openai_client(server) as oai:
        chat = [oai.chat.completions.create(model=model, messages=ASK, response_format=response_format, seed=seed,
                                            temperature=1.0, max_tokens=120) for seed in range(3)]
        completion = oai.completions.create(model=model, prompt=TURNS[0], n=4, seed=7, temperature=1.0,
                                            max_tokens=120, extra_body={"response_format": response_format})
        pattern = "[a-z]{2,6}_[0-9]{1,3}"
        regex = oai.completions.create(model=model, prompt=TURNS[0], n=4, seed=8, temperature=1.0, max_tokens=30,
                                       extra_body={"guided_regex": pattern})
    texts = [c.choices[0].message.content for c in chat] + [choice.text for choice in completion.choices]
    assert [c.choices[0].finish_reason for c in chat] + [c.finish_reason for c in completion.choices] == ["stop"] * 7
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert all(re.fullmatch(pattern, choice.text) and choice.finish_reason == "stop" for choice in regex.choices), \
        [choice.text for choice in regex.choices]


@pytest.mark.parametrize("model", list(MODELS))
def test_chat_with_tools_is_answered_and_calls_parse(server, model):
    """`tools` without tool_choice (auto) is a grammar too: answered, not refused with 400; with
    `required` the model calls the function, and the call comes back as tool_calls whose
    arguments fit its parameters."""
    with openai_client(server) as oai:
        unset = oai.chat.completions.create(model=model, messages=ASK, tools=[LOOKUP], n=3, seed=1, max_tokens=60)
        auto = oai.chat.completions.create(model=model, messages=ASK, tools=[LOOKUP], tool_choice="auto", n=3,
                                           seed=2, max_tokens=60)
        required = [oai.chat.completions.create(model=model, messages=ASK, tools=[LOOKUP], tool_choice="required",
                                                seed=seed, max_tokens=100, parallel_tool_calls=False)
                    for seed in range(3)]
    for choice in [*unset.choices, *auto.choices]:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "lookup"
        else:
            assert choice.message.content is not None and not choice.message.content.startswith("<")
    for answer in required:
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id and call.function.name == "lookup"
        jsonschema.validate(json.loads(call.function.arguments), LOOKUP["function"]["parameters"])
