"""`xlserve bench fairness --quick` runs end to end (the full run is run alone): every long prompt
size is reported with the small requests' TTFT alone and beside it, and the small requests were
served while the long prompt was still prefilling."""

import json
import os
import subprocess
import sys

from tests.e2e.server_process import make_checkpoint


def test_fairness_bench_quick(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "txl-tiny")
    out = tmp_path / "fairness.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "xlserve.server.cli", "bench", "fairness", "--quick", "--model", str(checkpoint),
         "--long-sizes", "20000", "--threads", "1", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert result["quick"] and result["setting"]["prefill_chunk"] == 64
    results = result["results"]
    assert len(results["small_ttft_alone_s"]) == 3 and results["small_ttft_alone_p50_s"] > 0
    (row,) = results["rows"]
    assert row["long_bytes"] == 20000 and row["long_chunks"] == 313
    assert len(row["small_ttft_beside_s"]) == 3 and all(ttft > 0 for ttft in row["small_ttft_beside_s"])
    # order of service: the first small request is sent once the long prompt's first chunk is in,
    # and with fair prefill it comes a step or two later, with most of the long prompt's 313
    # chunks still to go (served first come first, it came after all of them)
    assert row["small_during_prefill"] >= 1
    assert row["long_ttft_alone_s"] > 0 and row["long_ttft_beside_s"] > 0 and isinstance(row["meets_goal"], bool)
