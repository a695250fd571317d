"""The Reformer served like the others, on a real server with a tiny random checkpoint: listed
with its state kind, generating over HTTP and the websocket alike, and its sessions follow its
own semantics (models/reformer.py): a state's first call is one pass, every later call is the
reference's cached decoding, so after the first append any split of the rest gives the same
log-probs; its state grows with the history; fork and export/import continue exactly. (The shared invariants file assumes bounded states and chunking-free results, which
the Reformer does not promise; it does take the Reformer through Redis.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from websockets.sync.client import connect

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import append, create, decode_together_as_alone, document, info, ok, score

MODEL = "reformer-tiny"


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    server = ServerProcess([tiny_checkpoints[MODEL]], env={"XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp("state"))},
                           log_path=tmp_path_factory.mktemp("logs") / "reformer.log").start()
    yield server
    server.stop()


@pytest.fixture
def client(served):
    with served.client() as c:
        yield c


def test_listed_and_generating_the_same_over_http_and_the_websocket(served, client):
    (listed,) = [m for m in ok(client.get("/v1/models"))["data"] if m["id"] == MODEL]
    assert listed["state_kind"] == "window"
    request = {"model": MODEL, "prompt": "def main():\n", "max_tokens": 16, "temperature": 0}
    text = ok(client.post("/v1/completions", json=request))["choices"][0]["text"]
    with connect(served.url.replace("http", "ws") + "/v1/stream") as ws:
        ws.send(json.dumps({"type": "generate", "id": "r1", **request}))
        pieces = []
        while True:
            frame = json.loads(ws.recv(timeout=60))
            if frame["type"] == "token":
                pieces.append(frame["text"])
            elif frame["type"] == "done":
                break
            else:
                assert frame["type"] != "error", frame
    assert "".join(pieces) == text


def test_after_the_first_call_any_split_gives_the_same_log_probs(client):
    first, rest = document(1)[:100], document(2, repeat=2)
    whole_rest, split_rest = create(client, MODEL), create(client, MODEL)
    for session in (whole_rest, split_rest):
        append(client, session, first)
    append(client, whole_rest, rest)
    for piece in (rest[:7], rest[7:130], rest[130:]):
        append(client, split_rest, piece)
    assert info(client, whole_rest)["tokens"] == info(client, split_rest)["tokens"] == len(first) + len(rest)
    assert np.allclose(score(client, whole_rest, model=MODEL), score(client, split_rest, model=MODEL), atol=1e-4)


def test_state_grows_with_the_history(client):
    session = create(client, MODEL)
    sizes = []
    for i in range(3):
        append(client, session, document(10 + i))
        sizes.append(info(client, session)["state_bytes"])
    assert sizes[0] < sizes[1] < sizes[2]


def test_fork_and_export_import_continue_exactly(client):
    source = create(client, MODEL)
    append(client, source, document(5))
    forked = ok(client.post(f"/v1/sessions/{source}/fork"))["id"]
    blob = client.get(f"/v1/sessions/{source}/state")
    assert blob.status_code == 200, blob.text
    imported = ok(client.post("/v1/sessions/import", content=blob.content))["id"]
    expected = score(client, source, model=MODEL)
    for copy in (forked, imported):
        assert score(client, copy, model=MODEL) == expected, copy


def test_rows_of_different_histories_decode_together_as_alone(served, client):
    """Sessions of 5 and 600 bytes (LSH buckets over many chunks) generating at once: greedy
    gives each what it gets alone, and the engine ran steps with both rows."""
    text = document(7, repeat=8)
    decode_together_as_alone(served, client, MODEL, [text[:5], text[:600]], ["def f(", "    x = "], max_tokens=32)
