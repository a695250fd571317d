"""`xlserve bench vs-hf-reformer --quick` runs end to end in seconds (the full setting is run
alone, never in the tests): the converted Reformer generates the reference's tokens, and the
JSON and the PNG are written."""

import json

import pytest

pytest.importorskip("transformers")

from xlserve.server.cli import main as cli  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_vs_hf_reformer_quick(tmp_path, capsys):
    out = tmp_path / "results" / "vs-hf-reformer.json"
    cli(["bench", "vs-hf-reformer", "--quick", "--threads", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["benchmark"] == "vs-hf-reformer" and result["quick"] and result["all_identical"]
    assert result["setting"]["attn_layers"] == ["local", "lsh"] and result["parameters"] > 0
    assert "transformers" in result["environment"]
    (row,) = result["results"]
    assert row["identical_tokens"] and row["distinct_tokens_generated"] > 1
    assert row["xlserve_tokens_per_s"] > 0 and row["reference_generate_tokens_per_s"] > 0
    assert row["speedup_vs_generate"] == pytest.approx(row["reference_generate_s"] /
                                                       (row["xlserve_prefill_s"] + row["xlserve_decode_s"]))
    png = out.with_suffix(".png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 1000
    assert "identical" in capsys.readouterr().out
