"""`xlserve bench models --quick --quantize int8`: the checkpoint is measured as the server runs it
with XLSERVE_QUANTIZE=int8, and its row says so (weight bytes in float32 and int8); a run without
the flag has no such field (tests/server/test_bench_models.py checks its rows field by field)."""

import json

from xlserve.models.checkpoint import load_checkpoint

from tests.e2e.server_process import make_checkpoint
from tests.server.test_bench_models import cli


def test_models_bench_measures_the_int8_model(tmp_path):
    checkpoint = tmp_path / "transformer-xl-tiny"
    make_checkpoint(checkpoint)
    out = tmp_path / "models-int8.json"
    cli("bench", "models", "--quick", "--quantize", "int8", "--models", str(checkpoint), "--batch-sizes", "1",
        "--threads", "1", "--out", str(out), cwd=tmp_path)
    result = json.loads(out.read_text())
    (row,) = result["results"]
    assert result["quantize"] == "int8" and row["quantize"]["mode"] == "int8"
    # the tiny preset's widths (64, 128) all go to int8 but r_net; the embedding stays float
    assert 0 < row["quantize"]["weight_bytes"] < 0.6 * row["quantize"]["float32_weight_bytes"]
    float_model = load_checkpoint(checkpoint)
    assert row["parameters"] == sum(p.numel() for p in float_model.parameters())  # the checkpoint's count
    assert row["decode_tokens_per_s"]["1"] > 0
