"""`xlserve bench multi-turn` runs end to end (a small smoke run; the real one is run alone): every
mode and turn is reported, the stateless client with the prefix cache and the session client
reuse their history from turn 2 on, and the client without the cache reuses nothing."""

import json
import os
import subprocess
import sys

from tests.e2e.server_process import make_checkpoint


def test_multi_turn_bench_smoke(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "txl-tiny")
    out = tmp_path / "multi-turn.json"
    env = {**os.environ, "XLSERVE_STATE_DIR": str(tmp_path / "state"), "XLSERVE_TORCH_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "xlserve.server.cli", "bench", "multi-turn", "--model", str(checkpoint),
         "--conversations", "2", "--turns", "3", "--reply-tokens", "4", "--min-message", "64", "--max-message", "128",
         "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    modes = result["modes"]
    assert set(modes) == {"prefix-cache", "no-cache", "sessions"}
    for mode, rows in modes.items():
        assert [row["turn"] for row in rows["turns"]] == [1, 2, 3]
        assert all(row["requests"] == 2 and row["ttft_p50_s"] > 0 and 0 <= row["goodput"] <= 1 for row in rows["turns"])
        assert rows["output_tokens_per_s"] > 0
    assert all(row["cached_share"] == 0 for rows in modes.values() for row in rows["turns"][:1])
    assert all(row["cached_share"] > 0.3 for row in modes["prefix-cache"]["turns"][1:])
    assert all(row["cached_share"] > 0.3 for row in modes["sessions"]["turns"][1:])
    assert all(row["cached_share"] == 0 for row in modes["no-cache"]["turns"])
    assert set(result["goals"]) == {"cache_last_over_first_ttft", "no_cache_over_cache_ttft_last_turn",
                                    "cache_over_sessions_ttft_last_turn"}
