"""`xlserve bench structured --quick` runs end to end on the shipped byte-level Transformer-XL
(the full run is run alone): ITL with and without a JSON-schema constraint at each batch size,
the compile time of 50-property schemas (cold, then cached), and the mask's cost per token."""

import json
import os
import subprocess
import sys
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[2] / "weights" / "transformer-xl-stdlib"


def test_structured_bench_quick(tmp_path):
    out = tmp_path / "structured.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "xlserve.server.cli", "bench", "structured", "--quick", "--model", str(SHIPPED), "--threads", "1",
         "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert result["quick"] and result["setting"]["batches"] == "1,4"
    assert [row["batch"] for row in result["itl"]] == [1, 4]
    for row in result["itl"]:
        # the constrained rows could not end early: every row decoded max_tokens tokens
        assert row["plain_tokens"] == row["constrained_tokens"] == row["batch"] * result["setting"]["max_tokens"]
        assert 0 < row["plain_itl_p50_ms"] <= row["plain_itl_p99_ms"]
        assert 0 < row["constrained_itl_p50_ms"] <= row["constrained_itl_p99_ms"]
        assert row["overhead"] == round(row["constrained_itl_p50_ms"] / row["plain_itl_p50_ms"] - 1, 4)
        assert row["meets_goal"] == (row["overhead"] <= 0.10)
    compiled = result["compile"]
    assert compiled["schema_properties"] == 50 and compiled["compiles"] == 3
    assert 0 < compiled["cached_ms_p50"] < compiled["cold_ms_p50"]  # a cached schema is not compiled again
    assert result["mask"]["tokens"] == 200 and result["mask"]["us_per_token"] > 0
