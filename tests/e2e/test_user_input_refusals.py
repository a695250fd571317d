"""User input a model cannot take is a 4xx with a code naming the problem, never a 500 (issue 35
audit), over real HTTP and the websocket against a real server serving Transformer-XL and a
small Reformer: token ids outside the vocabulary wherever token ids are taken, and imported
states (POST /v1/sessions/import, PUT /v1/sessions/{id}/state) whose header, shapes,
architecture or token count do not fit the model. The Reformer's context limit has its own
file (test_context_limit.py); tests/server/test_import_refusals.py takes each class of import
refusal through every architecture. The test process runs no model: states are edited with numpy."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load as load_numpy
from safetensors.numpy import save as save_numpy
from websockets.sync.client import connect

from tests.e2e.server_process import ServerProcess, make_checkpoint
from tests.e2e.session_tools import append, create, document, info, metric_total, ok, safetensors_metadata

MODEL = "txl-tiny"
REFORMER = "reformer-small"
VOCABULARY = 256  # both are byte-level


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    reformer = make_checkpoint(tmp_path_factory.mktemp("weights") / REFORMER, arch="reformer",
                               config={"axial_pos_shape": [8, 8]})
    server = ServerProcess([tiny_checkpoint, reformer],
                           log_path=tmp_path_factory.mktemp("logs") / "user-input.log").start()
    yield server
    server.stop()


@pytest.fixture
def client(served):
    with served.client() as c:
        yield c


def refused(response, status: int, code: str, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    return error


# -- token ids outside the vocabulary ----------------------------------------------------------------

@pytest.mark.parametrize("token", [VOCABULARY, -1, 2**40])
def test_token_ids_outside_the_vocabulary_are_400_wherever_ids_are_taken(served, client, token):
    session = create(client, MODEL)
    answers = {
        "completion": (client.post("/v1/completions", json={"model": MODEL, "prompt": [1, token]}), "prompt"),
        "completion on a session": (client.post("/v1/completions", json={"model": MODEL, "session_id": session,
                                                                          "prompt": [token]}), "prompt"),
        "append": (client.post(f"/v1/sessions/{session}/append", json={"text": [1, token]}), "text"),
        "detokenize": (client.post("/detokenize", json={"model": MODEL, "tokens": [token]}), "tokens"),
        "reformer completion": (client.post("/v1/completions", json={"model": REFORMER, "prompt": [token]}),
                                "prompt"),
    }
    for name, (response, param) in answers.items():
        error = refused(response, 400, "token_id_out_of_vocabulary", param)
        assert f"token id {token} is outside the vocabulary [0, {VOCABULARY})" in error["message"], (name, error)
    assert info(client, session)["tokens"] == 0  # nothing ran on the session
    with connect(served.url.replace("http", "ws") + "/v1/stream") as ws:
        ws.send(json.dumps({"type": "generate", "id": "g", "model": MODEL, "prompt": [token]}))
        frame = json.loads(ws.recv(timeout=60))
    assert frame["type"] == "error" and frame["error"]["code"] == "token_id_out_of_vocabulary", frame


# -- an echo of more log-probabilities than an answer may carry ---------------------------------------

def test_an_echo_of_too_many_prompt_logprobs_is_400_naming_the_limit(client):
    """`echo` with `logprobs` returns every prompt token's log-probability and its alternatives,
    in every choice: past MAX_ECHO_LOGPROBS it is refused before anything runs (the engine would
    hold them all and send them in one frame, beside every other client's stream)."""
    from xlserve.server.api.protocol import MAX_ECHO_LOGPROBS

    prompt = "x" * 4_000  # 4,000 byte tokens x 21 x 16 choices: 1.34 M
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 20, "n": 16, "max_tokens": 0}
    error = refused(client.post("/v1/completions", json=body), 400, "echo_logprobs_too_large", "logprobs")
    assert f"returns 1,344,000 log-probabilities; the limit is {MAX_ECHO_LOGPROBS:,}" in error["message"]
    answer = ok(client.post("/v1/completions", json={**body, "prompt": prompt[:100], "n": 2}))  # 4,200: answered
    assert [len(choice["logprobs"]["top_logprobs"]) for choice in answer["choices"]] == [100, 100]


# -- imported states that do not fit -------------------------------------------------------------------

def exported_state(client, model: str = MODEL) -> tuple[str, bytes]:
    session = create(client, model)
    append(client, session, document(3, repeat=1)[:40])
    return session, client.get(f"/v1/sessions/{session}/state").content


def rewritten(blob: bytes, change_tensors=None, **metadata) -> bytes:
    """The exported `blob`, its tensors through `change_tensors` and its metadata updated, without checksum."""
    tensors = load_numpy(blob)
    if change_tensors is not None:
        tensors = change_tensors(tensors)
    meta = {k: v for k, v in safetensors_metadata(blob).items() if k != "checksum"}
    return save_numpy(tensors, metadata={**meta, **metadata})


def header_only(header: object) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded


def widened_keys(tensors: dict) -> dict:
    """Every memory key and value twice as wide: the shapes of a model with another d_head."""
    return {name: np.ascontiguousarray(np.concatenate([array, array], axis=-1))
            if name.startswith(("state.keys.", "state.values.")) else array for name, array in tensors.items()}


def assert_refused_on_import_and_put(client, session: str, blob: bytes, words: str) -> None:
    """POST import creates nothing; PUT leaves the session as it was."""
    before = info(client, session)
    for response in (client.post("/v1/sessions/import", content=blob),
                     client.put(f"/v1/sessions/{session}/state", content=blob)):
        error = refused(response, 400, "invalid_state", "body")
        assert words in error["message"], error
    after = info(client, session)
    assert (after["version"], after["tokens"]) == (before["version"], before["tokens"])


def test_an_import_whose_metadata_is_not_an_object_is_invalid_state(client):
    """It was a 500 (the header's metadata was read as a dict)."""
    session, _ = exported_state(client)
    for metadata in ("xlserve-session", ["format"], 7):
        assert_refused_on_import_and_put(client, session, header_only({"__metadata__": metadata}),
                                         "not an xlserve-session blob")


def test_an_import_with_the_shapes_of_another_config_is_invalid_state(client):
    session, blob = exported_state(client)
    assert_refused_on_import_and_put(client, session, rewritten(blob, widened_keys), "dimension 3 must be")


def test_a_state_of_another_architecture_is_invalid_state(client):
    """A Reformer's state, its metadata claiming Transformer-XL: the tensors give it away."""
    session, _ = exported_state(client)
    _, reformer_blob = exported_state(client, REFORMER)
    disguised = rewritten(reformer_blob, model=MODEL, architecture="transformer-xl", state_class="XLMemory")
    assert_refused_on_import_and_put(client, session, disguised, "state tensor")
    # sent as it is, it names the model and the architecture it belongs to
    error = refused(client.put(f"/v1/sessions/{session}/state", content=reformer_blob), 400, "invalid_state", "body")
    assert f"belongs to model '{REFORMER}'" in error["message"], error


def test_a_transformer_xl_state_claiming_a_huge_history_is_taken_and_goes_on(client):
    """A full memory looks the same after any longer history, so a larger token count is no
    malformation: it is imported, and the session goes on from it (the count is only a number)."""
    _, blob = exported_state(client)
    claimed = 2**62
    copy = ok(client.post("/v1/sessions/import", content=rewritten(blob, tokens=str(claimed))))
    assert copy["tokens"] == claimed
    answer = ok(client.post("/v1/completions", json={"model": MODEL, "session_id": copy["id"], "prompt": "x",
                                                     "max_tokens": 2, "temperature": 0}))
    assert answer["usage"]["completion_tokens"] == 2
    assert info(client, copy["id"])["tokens"] == claimed + 3


def test_no_request_here_was_answered_with_an_internal_error(client):
    """Run last in this module: whatever the tests above sent, no answer was a 500."""
    text = client.get("/metrics").text
    for model in (MODEL, REFORMER):
        assert metric_total(text, "xlserve_request_errors_total", model=model, type="internal_error") == 0
