"""A real server with XLSERVE_QUANTIZE=int8 beside the default (float) one, both serving the tiny
Transformer-XL: its card says int8 with fewer weight bytes and the checkpoint's parameter count,
its sessions score a continuation close to the float server's, and it generates; a quantize
setting naming a model the server does not serve stops the start in one line."""

import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import MODEL, append, create, document, ok, score

# largest difference (nats) between a continuation's log-probs from the int8 and the float model:
# the tiny random checkpoint's log-probs move by a few hundredths under int8 weights and
# int8 activations (tests/models/test_quantize.py bounds the shipped ones in bits per byte)
LOG_PROB_TOLERANCE = 0.1


@pytest.fixture(scope="module")
def int8_server(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess([tiny_checkpoint], env={"XLSERVE_QUANTIZE": "int8"},
                            log_path=tmp_path_factory.mktemp("logs") / "int8.log").start()
    yield process
    process.stop()


def test_the_int8_server_says_so_and_scores_like_the_float_one(server, int8_server):
    with server.client() as plain, int8_server.client() as quantized:
        float_card, int8_card = ok(plain.get(f"/v1/models/{MODEL}")), ok(quantized.get(f"/v1/models/{MODEL}"))
        assert (float_card["quantize"], int8_card["quantize"]) == ("none", "int8")
        assert int8_card["parameters"] == float_card["parameters"]
        assert 0 < int8_card["weight_bytes"] < float_card["weight_bytes"]

        float_session, int8_session = create(plain), create(quantized)
        append(plain, float_session, document(2))
        append(quantized, int8_session, document(2))
        expected, got = score(plain, float_session), score(quantized, int8_session)
        assert len(got) == len(expected)
        assert max(abs(a - b) for a, b in zip(got[1:], expected[1:])) < LOG_PROB_TOLERANCE

        body = ok(quantized.post("/v1/completions", json={"model": MODEL, "prompt": "def ", "max_tokens": 8,
                                                           "temperature": 0}))
        assert body["usage"]["completion_tokens"] == 8


def test_a_quantize_setting_naming_no_served_model_stops_the_start(tiny_checkpoint, tmp_path):
    log = tmp_path / "refused.log"
    process = ServerProcess([tiny_checkpoint], env={"XLSERVE_QUANTIZE": "no-such-model=int8"}, log_path=log)
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            process.start(timeout=60)
    finally:
        process.stop()
    assert "XLSERVE_QUANTIZE names 'no-such-model', which is not a served model" in log.read_text()
