"""`xlserve bench soak` runs end to end in both modes (a small smoke run; the real one is run
alone): every round is sampled, and the prefix cache's bytes are reported beside RSS; completions
about no session fill the prefix cache, session work leaves it as it is."""

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.server_process import make_checkpoint


@pytest.mark.parametrize("mode", ["stateless", "sessions"])
def test_soak_bench_smoke(tmp_path, mode):
    checkpoint = make_checkpoint(tmp_path / "txl-tiny")
    out = tmp_path / "out"
    env = {**os.environ, "XLSERVE_TORCH_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "xlserve.server.cli", "bench", "soak", "--model", str(checkpoint), "--mode", mode,
         "--rounds", "2", "--sessions", "2", "--chunks", "1", "--chunk-bytes", "256", "--max-tokens", "4",
         "--settle-seconds", "0", "--state-dir", str(tmp_path / "state"), "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "soak.json").read_text())
    assert (out / "soak.png").stat().st_size > 0
    assert result["mode"] == mode
    rounds = [s for s in result["samples"] if s["label"] == "round"]
    assert [s["round"] for s in rounds] == [1, 2]
    assert all(s["engine"]["rss_mb"] > 0 and isinstance(s["prefix_cache_mb"], dict) for s in rounds)
    cache = result["prefix_cache"]
    assert "prefix cache" in done.stdout
    if mode == "stateless":
        assert result["counts"]["created"] == 0 and result["counts"]["committed"] == 0
        assert result["counts"]["completed"] + result["counts"]["disconnected"] == 4
        assert cache["max_mb"] > 0 and cache["end_mb"] > 0
    else:
        assert result["counts"]["created"] == 4 and result["counts"]["completed"] == 0
        assert cache["max_mb"] == 0
