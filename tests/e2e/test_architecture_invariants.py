"""Every registered architecture through a real server: listed with its state kind; sessions that
append and score, fork, export and import, continue over the websocket, and decode beside rows
of other histories exactly as alone; the state-size invariants of issue 17 read from
GET /v1/sessions/{id}; and the eight efficient-attention architectures through Redis.

Tiny random checkpoints, one server for the module (a second pair, sharing a real
redis-server, for the Redis test). The adaptive-span checkpoint gets heads of different learned
spans (written into its safetensors file), so its state follows spans that differ per head."""

from __future__ import annotations

import json
import math
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from safetensors.numpy import load as load_numpy
from safetensors.numpy import load_file, save_file
from websockets.sync.client import connect

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import (
    append, create, decode_together_as_alone, document, fork, greedy, info, ok, score,
)
from tests.redis_server import redis_url  # noqa: F401  (fixture)

TXL = "txl-tiny"  # the checkpoint of the shared `tiny_checkpoint` fixture (tests/e2e/conftest.py)
NEW = {"longformer-tiny": "longformer", "logsparse-tiny": "logsparse", "adaptive-span-tiny": "adaptive-span",
       "performer-tiny": "performer"}
OTHERS = {"inf-tiny": "infinity-former", "vanilla-tiny": "vanilla", "xlnet-tiny": "xlnet"}
# the efficient-attention family's second half (issue 19); the Reformer, whose state grows and whose
# results depend on its first call, has its own file (test_reformer_served.py)
SECOND = {"linformer-tiny": "linformer", "conformer-tiny": "conformer", "lite-tiny": "lite-transformer"}
# the recurrent models of issue 37: a convolution window and a selective state, or RWKV's WKV sums
RECURRENT = {"mamba-tiny": "mamba", "mamba2-tiny": "mamba2", "rwkv-tiny": "rwkv"}
ARCHITECTURES = {TXL: "transformer-xl", **OTHERS, **NEW, **SECOND, **RECURRENT}  # every registered architecture but the Reformer
REFORMER = "reformer-tiny"  # only in the Redis test: its one-pass first call is equal on both replicas
STATE_KINDS = {"transformer-xl": "segment-recurrence", "xlnet": "segment-recurrence", "infinity-former": "continuous",
               "vanilla": "window", "longformer": "window", "logsparse": "window", "adaptive-span": "window",
               "performer": "linear", "linformer": "window", "conformer": "window", "lite-transformer": "window",
               "mamba": "linear", "mamba2": "linear", "rwkv": "linear"}
# adaptive-span tiny (max_span 48, ramp 8): span fractions per layer and head, none of them
# giving a whole span, so ceil matters: z = 14.4, 48 | 0, 28.8
SPAN_FRACTIONS = [[0.3, 1.0], [0.0, 0.6]]
VOCAB = 256  # bytes; a session's state_bytes also counts its next-token row (float32)


def set_spans(checkpoint, fractions) -> None:
    weights = checkpoint / "model.safetensors"
    tensors = load_file(str(weights))
    for layer, row in enumerate(fractions):
        name = f"layers.{layer}.span_fraction"
        tensors[name] = np.asarray(row, dtype=tensors[name].dtype)
    save_file(tensors, str(weights))


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tiny_checkpoints, tmp_path_factory):
    made = {name: tiny_checkpoints[name] for name in ARCHITECTURES if name != TXL}
    # the shared checkpoints are not ours to change: the spans are set on a copy
    spans = tmp_path_factory.mktemp("weights") / "adaptive-span-tiny"
    shutil.copytree(made["adaptive-span-tiny"], spans)
    set_spans(spans, SPAN_FRACTIONS)
    return {TXL: tiny_checkpoint, **made, "adaptive-span-tiny": spans}


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    server = ServerProcess(list(checkpoints.values()), env={"XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp("state"))},
                           log_path=tmp_path_factory.mktemp("logs") / "invariants.log").start()
    yield server
    server.stop()


@pytest.fixture
def client(served):
    with served.client() as c:
        yield c


def exported(client, session: str) -> bytes:
    response = client.get(f"/v1/sessions/{session}/state")
    assert response.status_code == 200, response.text
    return response.content


# -- listing ------------------------------------------------------------------------------------


def test_models_lists_every_architecture_with_its_state_kind(client):
    listed = {m["id"]: m for m in ok(client.get("/v1/models"))["data"]}
    assert set(ARCHITECTURES) <= set(listed)
    for name, arch in ARCHITECTURES.items():
        card = listed[name]
        assert card["architecture"] == arch
        assert card["state_kind"] == STATE_KINDS[arch], (name, card["state_kind"])
        assert card["state_grows_with_context"] is False
        assert ok(client.get(f"/v1/models/{name}"))["state_kind"] == STATE_KINDS[arch]


# -- sessions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(ARCHITECTURES))
def test_append_with_score_equals_one_pass(client, model):
    """Scores of a document appended in two pieces: the first token is not scored, every other
    is, and together they are the log-probs of one request over the whole text."""
    text = document(4, repeat=2)
    cut = 61
    session = create(client, model)
    first, second = append(client, session, text[:cut], score=True), append(client, session, text[cut:], score=True)
    assert (first["scored_tokens"], second["scored_tokens"]) == (cut - 1, len(text) - cut)
    assert (second["session_tokens"], second["cached_tokens"]) == (len(text), cut)
    for step in (first, second):
        assert step["bits_per_byte"] == pytest.approx(-step["logprob"] / math.log(2) / step["scored_tokens"])
    whole = ok(client.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 0, "echo": True,
                                                    "logprobs": 0}))["choices"][0]["logprobs"]["token_logprobs"]
    assert whole[0] is None
    assert first["logprob"] == pytest.approx(sum(whole[1:cut]), abs=1e-3)
    assert second["logprob"] == pytest.approx(sum(whole[cut:]), abs=1e-3)


@pytest.mark.parametrize("model", list(ARCHITECTURES))
def test_fork_and_export_import_continue_identically(client, model):
    source = create(client, model)
    append(client, source, document(5))
    forked = fork(client, source)
    blob = exported(client, source)
    imported = ok(client.post("/v1/sessions/import", content=blob))
    assert imported["model"] == model and imported["tokens"] == len(document(5))
    copies = [forked, imported["id"]]
    expected = score(client, source, model=model)
    for copy in copies:  # the same continuation, scored from each copy: exactly the same floats
        assert score(client, copy, model=model) == expected, copy
    twins = [fork(client, s) for s in [source] + copies]  # all three are at the same history again
    texts = [greedy(client, model, s, "def ") for s in twins]
    assert texts[0] == texts[1] == texts[2]
    assert len({info(client, s)["tokens"] for s in twins}) == 1


@pytest.mark.parametrize("model", list(ARCHITECTURES))
def test_websocket_generate_on_a_session_equals_http(served, client, model):
    source = create(client, model)
    append(client, source, document(6, repeat=2))
    over_http, over_ws = fork(client, source), fork(client, source)
    expected = greedy(client, model, over_http, "    return ", max_tokens=20)
    with connect(served.url.replace("http://", "ws://") + "/v1/stream") as ws:
        ws.send(json.dumps({"type": "generate", "id": "g", "model": model, "prompt": "    return ", "max_tokens": 20,
                            "temperature": 0, "session_id": over_ws}))
        tokens = []
        while True:
            frame = json.loads(ws.recv(timeout=60))
            if frame["type"] != "token":
                break
            tokens.append(frame)
    assert frame["type"] == "done", frame
    assert frame["usage"]["completion_tokens"] == 20
    assert frame["usage"]["prompt_tokens_details"]["cached_tokens"] == len(document(6, repeat=2))
    assert "".join(t["text"] for t in tokens) + frame.get("text", "") == expected
    assert info(client, over_ws)["tokens"] == info(client, over_http)["tokens"]
    assert score(client, over_ws, model=model) == score(client, over_http, model=model)


@pytest.mark.parametrize("model", list(ARCHITECTURES))
def test_rows_of_different_histories_decode_together_as_alone(served, client, model):
    """Two sessions, one with 5 bytes of history and one with 600 (past every window, span,
    memory and segment of the tiny presets), generate concurrently: greedy gives each the
    tokens it gets alone, and the engine did run steps with both rows."""
    text = document(7, repeat=8)
    assert len(text) > 500
    decode_together_as_alone(served, client, model, [text[:5], text[:600]], ["def f(", "    x = "], max_tokens=48)


# -- state-size invariants ----------------------------------------------------------------------


def state_bytes_after(client, session: str, fed: int, mark: int, piece: str) -> tuple[int, int]:
    """Append slices of `piece` until the session holds `mark` tokens; (its state_bytes, mark)."""
    while fed < mark:
        chunk = piece[: min(len(piece), mark - fed)]
        append(client, session, chunk)
        fed += len(chunk)
    current = info(client, session)
    assert current["tokens"] == mark
    return current["state_bytes"], mark


LONG_PIECE = (document(8, repeat=60) * 2)[:25_000]


def test_performer_state_bytes_constant_over_1k_10k_100k(client):
    session = create(client, "performer-tiny")
    sizes, fed = {}, 0
    for mark in (1_000, 10_000, 100_000):
        sizes[mark], fed = state_bytes_after(client, session, fed, mark, LONG_PIECE)
    assert sizes[1_000] == sizes[10_000] == sizes[100_000] > 0, sizes


# 64 KB through the recurrent models costs 6-9 s each on 2 cores: Mamba in the default run, the
# other two with -m slow (tests/models/test_mamba2.py and test_rwkv.py check the same in process)
RECURRENT_64KB = ["mamba-tiny", *(pytest.param(name, marks=pytest.mark.slow) for name in RECURRENT if name != "mamba-tiny")]


@pytest.mark.parametrize("model", ["longformer-tiny", "logsparse-tiny", *SECOND, *RECURRENT_64KB])
def test_windowed_state_bytes_equal_after_4kb_and_64kb(client, model):
    """The windows of the efficient-attention models, and the recurrent models' fixed states."""
    session = create(client, model)
    sizes, fed = {}, 0
    for mark in (4_096, 65_536):
        sizes[mark], fed = state_bytes_after(client, session, fed, mark, LONG_PIECE)
    assert sizes[4_096] == sizes[65_536] > 0, sizes


def test_adaptive_span_state_follows_the_learned_spans(client, checkpoints):
    """After a history longer than every head's span + ramp, each head keeps ceil(z) + R - 1
    positions: the bytes are what the learned spans predict, smaller than the maximum span would
    need by the ratio of kept positions."""
    config = json.loads((checkpoints["adaptive-span-tiny"] / "config.json").read_text())["config"]
    S, R, D = config["max_span"], config["ramp"], config["d_head"]
    weights = load_file(str(checkpoints["adaptive-span-tiny"] / "model.safetensors"))
    spans = [(np.float32(S) * np.clip(weights[f"layers.{l}.span_fraction"], 0, 1)).tolist()
             for l in range(config["n_layer"])]
    kept = [math.ceil(z) + R - 1 for row in spans for z in row]
    assert kept == [22, 55, 7, 36]  # the fractions written by set_spans
    predicted = 2 * 4 * D * sum(kept) + 8  # keys and values (float32) + `position` (int64)
    at_max_span = 2 * 4 * D * len(kept) * (S + R - 1) + 8

    session = create(client, "adaptive-span-tiny")
    sizes, fed = {}, 0
    for mark in (S + R + 1, 4_096):  # past the longest span + ramp, and far past it
        sizes[mark], fed = state_bytes_after(client, session, fed, mark, LONG_PIECE)
    assert sizes[S + R + 1] == sizes[4_096] == predicted + 4 * VOCAB, (sizes, predicted)
    state = load_numpy(exported(client, session))
    assert [state[f"state.keys.{i}"].shape[1] for i in range(len(kept))] == kept
    assert (sizes[4_096] - 4 * VOCAB - 8) / (at_max_span - 8) == pytest.approx(sum(kept) / (len(kept) * (S + R - 1)))
    assert sizes[4_096] < at_max_span + 4 * VOCAB


# -- Redis --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(checkpoints, tiny_checkpoints, tmp_path_factory, redis_url):  # noqa: F811
    logs = tmp_path_factory.mktemp("logs")
    models = [checkpoints[n] for n in {**NEW, **SECOND}] + [tiny_checkpoints[REFORMER]]
    servers = [ServerProcess(models, env={
        "XLSERVE_REDIS_URL": redis_url, "XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp(f"state-{name}")),
    }, log_path=logs / f"redis-{name}.log") for name in "ab"]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(ServerProcess.start, servers))
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.mark.parametrize("model", [*NEW, *SECOND, REFORMER])
def test_session_round_trips_through_redis(replicas, model):
    """A session written on replica A is read back from Redis by replica B, which has never held
    it: the state is bit-identical and the same continuation scores the same on both."""
    a_server, b_server = replicas
    with a_server.client() as a, b_server.client() as b:
        text = document(9, repeat=4)
        session, twin = create(a, model), create(a, model)
        for s in (session, twin):
            append(a, s, text)
        on_b = info(b, session)
        assert (on_b["tier"], on_b["version"], on_b["tokens"]) == ("redis", 1, len(text))
        before, after = load_numpy(exported(a, session)), load_numpy(exported(b, session))
        assert before.keys() == after.keys()
        for name in before:
            assert np.array_equal(before[name], after[name]), name
        assert score(b, session, model=model) == score(a, twin, model=model)
        assert info(a, session)["version"] == 2  # B's commit went through Redis, and A sees it
