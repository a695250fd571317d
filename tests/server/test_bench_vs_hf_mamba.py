"""`xlserve bench vs-hf-mamba --quick` runs end to end in seconds (the full setting is run alone,
never in the tests): the converted Mamba decodes transformers' generate() tokens at every batch
size, both prefills are timed, and the JSON and the PNG are written."""

import json

import pytest

from tests.models.hf_reference import REFERENCE_DIR, reference_available
from xlserve.server.cli import main as cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not reference_available(), reason=f"needs the reference environment {REFERENCE_DIR} (make test)")
def test_vs_hf_mamba_quick(tmp_path, capsys):
    out = tmp_path / "results" / "vs-hf-mamba.json"
    cli(["bench", "vs-hf-mamba", "--quick", "--threads", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["benchmark"] == "vs-hf-mamba" and result["quick"] and result["all_identical"]
    assert result["environment"]["transformers"] == "4.57.1" and result["parameters"] > 0
    assert result["setting"]["batch_sizes"] == [1, 2]
    assert [row["batch_size"] for row in result["results"]] == [1, 2]
    for row in result["results"]:
        assert row["identical_tokens"] and row["distinct_tokens_generated"] > 1
        assert row["decode_speedup"] == pytest.approx(row["xlserve_decode_tokens_per_s"] / row["reference_decode_tokens_per_s"])
        # the ceiling: every weight and each row's state read once per step at the measured bandwidth
        read = result["weight_bytes_per_step"] + row["batch_size"] * result["state_bytes_per_row"]
        assert row["ceiling_tokens_per_s"] == pytest.approx(row["batch_size"] * result["read_bandwidth_bytes_per_s"] / read)
        assert row["ceiling_over_reference"] == pytest.approx(row["ceiling_tokens_per_s"] / row["reference_decode_tokens_per_s"])
    # the tied embedding is read whole (the head), so every parameter counts; the state is Mamba's fixed size
    assert result["weight_bytes_per_step"] == 4 * result["parameters"]
    assert result["state_bytes_per_row"] == 2 * (3 * 128 + 128 * 16) * 4 + 8
    prefill = result["prefill"]
    assert prefill["prefill_len"] == 128 and prefill["speedup"] == pytest.approx(prefill["reference_s"] / prefill["xlserve_s"])
    assert out.with_suffix(".png").read_bytes().startswith(PNG_SIGNATURE)
    assert "identical" in capsys.readouterr().out


def test_a_missing_reference_path_is_named(tmp_path):
    with pytest.raises(SystemExit, match="--reference-path .*nowhere is not a directory"):
        cli(["bench", "vs-hf-mamba", "--quick", "--reference-path", str(tmp_path / "nowhere"), "--out",
             str(tmp_path / "r.json")])
