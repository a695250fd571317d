"""`xlserve bench vs-hf`, `vs-hf-xlnet` and `vs-hf-reformer` with `--quick` run end to end in
seconds (the full settings are run alone, never in the tests): each converted model generates
the reference's tokens, and the JSON and the PNG are written."""

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


@pytest.mark.parametrize("benchmark, identical", [("vs-hf", "identical_tokens"),
                                                  ("vs-hf-xlnet", "identical_to_left_to_right_reference")])
def test_vs_hf_quick(tmp_path, capsys, benchmark, identical):
    out = tmp_path / f"{benchmark}.json"
    cli(["bench", benchmark, "--quick", "--threads", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["benchmark"] == benchmark and result["quick"] and result["all_identical"]
    assert result["setting"]["batch_sizes"] == [1, 2] and result["parameters"] > 0
    assert "transformers" in result["environment"]
    assert [row["batch_size"] for row in result["results"]] == [1, 2]
    for row in result["results"]:
        assert row[identical] and row["distinct_tokens_generated"] > 1 and row["xlserve_tokens_per_s"] > 0
    assert out.with_suffix(".png").read_bytes().startswith(PNG_SIGNATURE)
    assert "identical" in capsys.readouterr().out
