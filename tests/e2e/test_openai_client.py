"""The unmodified `openai` package pointed at the real server."""

from __future__ import annotations

import openai
import pytest

MODEL = "txl-tiny"


@pytest.fixture
def oai(server):
    with server.openai_client(timeout=60) as client:
        yield client


def test_completion(oai):
    result = oai.completions.create(model=MODEL, prompt="def main():\n", max_tokens=12, temperature=0)
    assert result.object == "text_completion" and result.model == MODEL
    assert len(result.choices) == 1 and result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == 12 and result.usage.completion_tokens == 12
    again = oai.completions.create(model=MODEL, prompt="def main():\n", max_tokens=12, temperature=0)
    assert again.choices[0].text == result.choices[0].text


def test_streaming_with_usage_matches_the_plain_answer(oai):
    plain = oai.completions.create(model=MODEL, prompt="class A:\n", max_tokens=10, temperature=0)
    chunks = list(oai.completions.create(model=MODEL, prompt="class A:\n", max_tokens=10, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    text = "".join(c.text for chunk in chunks for c in chunk.choices)
    assert text == plain.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.finish_reason for chunk in chunks for c in chunk.choices][-1] == "length"
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_logprobs_with_top_alternatives(oai):
    result = oai.completions.create(model=MODEL, prompt="import ", max_tokens=6, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == 6 and len(logprobs.token_logprobs) == 6
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0 and max(top.values()) == pytest.approx(logprob)  # greedy takes the most likely
    assert logprobs.text_offset == sorted(logprobs.text_offset)

    echoed = oai.completions.create(model=MODEL, prompt="import os", max_tokens=0, echo=True, logprobs=1)
    assert echoed.choices[0].text == "import os"
    assert echoed.choices[0].logprobs.token_logprobs[0] is None

    streamed = list(oai.completions.create(model=MODEL, prompt="import ", max_tokens=6, temperature=0, logprobs=3,
                                           stream=True))
    tokens = [t for chunk in streamed for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert tokens == logprobs.tokens


def test_stop_strings(oai):
    text = oai.completions.create(model=MODEL, prompt="def f():\n", max_tokens=20, temperature=0).choices[0].text
    stop = text[4:6]
    result = oai.completions.create(model=MODEL, prompt="def f():\n", max_tokens=20, temperature=0, stop=[stop, "zzz"])
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == text[: text.find(stop)]
    streamed = list(oai.completions.create(model=MODEL, prompt="def f():\n", max_tokens=20, temperature=0,
                                           stop=stop, stream=True))
    assert "".join(c.text for chunk in streamed for c in chunk.choices) == result.choices[0].text


def test_seed_reproducibility_and_n(oai):
    kwargs = dict(model=MODEL, prompt="x = ", max_tokens=16, temperature=1.0, top_p=0.95)
    a = oai.completions.create(seed=7, **kwargs).choices[0].text
    b = oai.completions.create(seed=7, **kwargs).choices[0].text
    assert a == b
    several = oai.completions.create(seed=7, n=3, **kwargs)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert several.choices[0].text == a
    assert several.usage.completion_tokens == 3 * 16
    streamed = list(oai.completions.create(seed=7, n=2, stream=True, **kwargs))
    by_index = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] += choice.text
    assert by_index == {0: a, 1: several.choices[1].text}


def test_sampling_extensions_through_extra_body(oai):
    result = oai.completions.create(model=MODEL, prompt="a", max_tokens=8, temperature=0.7, seed=1,
                                    presence_penalty=0.5, frequency_penalty=0.5,
                                    extra_body={"min_p": 0.1, "top_k": 20, "repetition_penalty": 1.3})
    assert result.usage.completion_tokens == 8


def test_errors_raise_the_clients_exceptions(oai):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError) as error:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert "limit is" in error.value.message
