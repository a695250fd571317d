"""Every architecture served like Transformer-XL: listed, generating, continuing sessions,
surviving eviction to disk bit-identically (the Reformer only the last); the ∞-former's session state
does not grow with its history. Tiny random checkpoints; the shipped ones are checked at the end."""

import numpy as np
import pytest
from safetensors.numpy import load as load_numpy

from tests.e2e.server_process import REPO, ServerProcess
from tests.e2e.session_tools import CONTINUATION, append, create, document, info, ok, score

SHIPPED = sorted(p for p in (REPO / "weights").glob("*-stdlib") if (p / "model.safetensors").is_file())

ARCHITECTURES = {"inf-tiny": "infinity-former", "vanilla-tiny": "vanilla", "xlnet-tiny": "xlnet",
                 "longformer-tiny": "longformer", "performer-tiny": "performer", "adaptive-span-tiny": "adaptive-span",
                 "logsparse-tiny": "logsparse", "linformer-tiny": "linformer", "conformer-tiny": "conformer",
                 "lite-tiny": "lite-transformer", "mamba-tiny": "mamba", "mamba2-tiny": "mamba2", "rwkv-tiny": "rwkv"}
# the Reformer's results depend on its first call (tests/e2e/test_reformer_served.py), so it joins
# only the tests that feed a session the way they feed its twin
REFORMER = "reformer-tiny"
# two ∞-former sessions (the largest tiny state, about 116 kB) per tier, not three
TIER_BYTES = 300_000


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    checkpoints = [tiny_checkpoints[name] for name in [*ARCHITECTURES, REFORMER]]
    server = ServerProcess(checkpoints, env={
        "XLSERVE_DEVICE_STATE_BYTES": str(TIER_BYTES), "XLSERVE_HOST_STATE_BYTES": str(TIER_BYTES),
        "XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp("state")),
    }, log_path=tmp_path_factory.mktemp("logs") / "architectures.log").start()
    yield server
    server.stop()


@pytest.fixture
def client(served):
    with served.client() as c:
        yield c


def tensors(client, session_id: str) -> dict[str, np.ndarray]:
    exported = client.get(f"/v1/sessions/{session_id}/state")
    assert exported.status_code == 200, exported.text
    return load_numpy(exported.content)


def test_listed_and_generating(client):
    listed = {m["id"] for m in ok(client.get("/v1/models"))["data"]}
    assert set(ARCHITECTURES) <= listed
    for model in ARCHITECTURES:
        request = {"model": model, "prompt": "def main():\n", "max_tokens": 24, "temperature": 0}
        first, second = ok(client.post("/v1/completions", json=request)), ok(client.post("/v1/completions", json=request))
        assert first["usage"]["completion_tokens"] == 24
        assert first["choices"][0]["text"] == second["choices"][0]["text"]  # greedy is deterministic


@pytest.mark.parametrize("model", list(ARCHITECTURES))
def test_session_continues_like_one_request(client, model):
    """A document appended in three requests, then scored, gives the log-probs of one request
    holding the whole text (the vanilla window slides and the ∞-former crosses segment
    boundaries along the way)."""
    text = document(1, repeat=2)
    session = create(client, model)
    for piece in (text[:37], text[37:150], text[150:]):
        append(client, session, piece)
    assert info(client, session)["tokens"] == len(text)
    continued = score(client, session, model=model)
    whole = ok(client.post("/v1/completions", json={"model": model, "prompt": text + CONTINUATION, "max_tokens": 0,
                                                    "echo": True, "logprobs": 0}))
    expected = whole["choices"][0]["logprobs"]["token_logprobs"][len(text):]
    assert np.allclose(continued, expected, atol=2e-4)


@pytest.mark.parametrize("model", [*ARCHITECTURES, REFORMER])
def test_session_survives_eviction_to_disk_bit_identically(client, model):
    text = document(2)
    session = create(client, model)
    append(client, session, text)
    before = tensors(client, session)
    # push it down: the least recently used session goes first (the smallest state, the Lite
    # Transformer's 8 kB, takes about 60 fillers)
    for i in range(100):
        if info(client, session)["tier"] == "disk":
            break
        filler = create(client, model)
        append(client, filler, document(100 + i, repeat=1)[:30])
    assert info(client, session)["tier"] == "disk"
    twin = create(client, model)  # the same history, freshly computed on the device
    append(client, twin, text)
    after = tensors(client, session)  # read back from its safetensors file
    assert before.keys() == after.keys()
    for name in before:
        assert np.array_equal(before[name], after[name]), name
    assert score(client, session, model=model) == score(client, twin, model=model)  # exactly equal floats


def test_infinity_former_state_does_not_grow_with_history(client):
    session = create(client, "inf-tiny")
    sizes, fed = {}, 0
    piece = (document(3, repeat=60) * 2)[:25_000]
    for mark in (1_000, 10_000, 30_000):  # one size from the first segment on: more history only costs time
        while fed < mark:
            text = piece[: min(len(piece), mark - fed)]
            append(client, session, text)
            fed += len(text)
        current = info(client, session)
        assert current["tokens"] == mark
        sizes[mark] = current["state_bytes"]
    assert sizes[1_000] == sizes[10_000] == sizes[30_000] > 0


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    if not SHIPPED:
        pytest.skip("no shipped checkpoints under weights/")
    server = ServerProcess(SHIPPED, log_path=tmp_path_factory.mktemp("logs") / "shipped.log").start()
    yield server
    server.stop()


def test_every_shipped_checkpoint_is_served(shipped):
    with shipped.client() as client:
        listed = {m["id"] for m in ok(client.get("/v1/models"))["data"]}
        assert {p.name for p in SHIPPED} <= listed
        for directory in SHIPPED:
            session = create(client, directory.name)
            append(client, session, "import os\n\n\ndef main(argv):\n")
            body = ok(client.post("/v1/completions", json={"model": directory.name, "prompt": "    ", "max_tokens": 32,
                                                           "temperature": 0, "session_id": session}))
            assert body["usage"]["completion_tokens"] == 32
            assert info(client, session)["tokens"] == len("import os\n\n\ndef main(argv):\n    ") + 32
