"""One client can never hurt another, over real HTTP against a real server: while a victim's
greedy stream runs, poisoned session states (NaN and infinite tensors, keys and values of
different lengths, a wrong dtype) are refused at import with 400 invalid_state naming the
tensor, the session they were meant to replace is unchanged, and completions with vanishing
temperature or top_p or the largest seed get defined answers; the victim's stream completes
with the tokens it gets alone. The test process runs no model: states are edited with numpy."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from safetensors.numpy import load as load_numpy
from safetensors.numpy import save as save_numpy

from tests.e2e.session_tools import MODEL, append, create, document, info, ok, safetensors_metadata

VICTIM = {"model": MODEL, "prompt": "def main(argv):\n    ", "max_tokens": 48, "temperature": 0, "logprobs": 1,
          "stream": True}


def stream_events(response) -> Iterator[dict]:
    """The SSE data events of a streaming response, read as they come, up to [DONE]."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def tokens_of(events: list[dict]) -> tuple[list[str], list[float]]:
    """(tokens, their log-probabilities) of a stream's chunks; fails on an error event."""
    tokens, logprobs = [], []
    for event in events:
        assert "error" not in event, event
        for choice in event["choices"]:
            if choice.get("logprobs"):
                tokens += choice["logprobs"]["tokens"]
                logprobs += choice["logprobs"]["token_logprobs"]
    return tokens, logprobs


def assert_same_as_alone(events: list[dict], expected: tuple[list[str], list[float]]) -> None:
    """The victim's stream ended normally with the tokens it gets alone (greedy), and their
    log-probabilities up to the float error of a batched forward."""
    tokens, logprobs = tokens_of(events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert tokens == expected[0]
    assert logprobs == pytest.approx(expected[1], abs=1e-4)


def victim_alone(client) -> tuple[list[str], list[float]]:
    with client.stream("POST", "/v1/completions", json=VICTIM) as response:
        assert response.status_code == 200
        return tokens_of(list(stream_events(response)))


def poisoned_blobs(blob: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (a session state edited so that the model could not have produced it, the words
    the refusal must contain). The checksum is dropped: an import without one is allowed."""
    tensors = load_numpy(blob)
    metadata = {k: v for k, v in safetensors_metadata(blob).items() if k != "checksum"}

    def edited(name: str, change) -> bytes:
        changed = dict(tensors)
        changed[name] = np.ascontiguousarray(change(tensors[name].copy()))
        return save_numpy(changed, metadata=metadata)

    def set_first(value):
        def change(array):
            array.reshape(-1)[0] = value
            return array
        return change

    def set_at(index, value):
        def change(array):
            array[index] = value
            return array
        return change

    return {
        "nan key": (edited("state.keys.0", set_first(np.nan)), "'keys.0' holds NaN or infinite values"),
        "inf value": (edited("state.values.1", set_first(np.inf)), "'values.1' holds NaN or infinite values"),
        "inf next_log_probs": (edited("next_log_probs", set_at(3, np.inf)), "next_log_probs holds NaN or infinite"),
        "nan next_log_probs": (edited("next_log_probs", set_at(0, np.nan)), "next_log_probs holds NaN or infinite"),
        "not a distribution": (edited("next_log_probs", lambda row: row + 1.0), "not a log-distribution"),
        "values shorter than keys": (edited("state.values.1", lambda array: array[:, 1:]), "'values.1' has shape"),
        "keys longer than valid": (edited("state.keys.0", lambda array: np.concatenate([array, array[:, :1]], 1)),
                                   "'keys.0' has shape"),
        # a floating tensor in another floating dtype is converted (XLSERVE_STATE_DTYPE); an
        # integer one where the model keeps floats is refused
        "wrong dtype": (edited("state.keys.0", lambda array: array.astype(np.int32)),
                        "'keys.0' is torch.int32"),
        # the memory is full (mem_len positions): a count of 1 token cannot have filled it
        "token count": (save_numpy(tensors, metadata={**metadata, "tokens": "1"}), "'valid' marks"),
    }


def assert_refused(response, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_state", error
    assert words in error["message"], error


def test_poisoned_imports_are_refused_while_a_stream_runs_unharmed(client):
    expected = victim_alone(client)
    session = create(client)
    append(client, session, document(51))
    before = client.get(f"/v1/sessions/{session}/state").content
    version = info(client, session)["version"]
    poisons = poisoned_blobs(before)

    with client.stream("POST", "/v1/completions", json=VICTIM) as response:
        assert response.status_code == 200
        events = stream_events(response)
        seen = [next(events)]  # the victim is running
        for name, (blob, words) in poisons.items():
            assert_refused(client.put(f"/v1/sessions/{session}/state", content=blob), words)  # replace
            assert_refused(client.post("/v1/sessions/import", content=blob), words)  # a new session
        seen += list(events)

    assert_same_as_alone(seen, expected)
    after = client.get(f"/v1/sessions/{session}/state").content
    assert info(client, session)["version"] == version
    assert load_numpy(after).keys() == load_numpy(before).keys()
    for name, array in load_numpy(before).items():
        assert np.array_equal(load_numpy(after)[name], array), name
    # and the untouched state still imports: the checks refuse poison, not states the server made
    ok(client.put(f"/v1/sessions/{session}/state", content=before))


@pytest.mark.parametrize("poison, greedy", [
    ({"temperature": 1e-45}, True),
    ({"temperature": 1.0, "top_p": 1e-45}, True),
    ({"temperature": 1.0, "seed": 2**64 - 1}, False),
    ({"temperature": 1.0, "seed": 0, "n": 2}, False),
])
def test_edge_sampling_values_answer_and_harm_no_stream(client, poison, greedy):
    expected = victim_alone(client)
    body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 16}
    with client.stream("POST", "/v1/completions", json=VICTIM) as response:
        assert response.status_code == 200
        events = stream_events(response)
        seen = [next(events)]
        answer = ok(client.post("/v1/completions", json={**body, **poison}))
        seen += list(events)
    assert_same_as_alone(seen, expected)
    assert all(choice["finish_reason"] == "length" for choice in answer["choices"])
    if greedy:  # a vanishing temperature or top_p is greedy
        plain = ok(client.post("/v1/completions", json={**body, "temperature": 0}))
        assert answer["choices"][0]["text"] == plain["choices"][0]["text"]
