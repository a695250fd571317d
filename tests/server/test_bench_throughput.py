"""`xlserve bench throughput` runs end to end (a tiny smoke run: the real one is run alone)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_throughput_bench_smoke(tmp_path):
    from tests.e2e.server_process import make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "txl-tiny")
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "xlserve.server.cli", "bench", "throughput", "--model", str(checkpoint), "--concurrency", "1,2",
         "--max-tokens", "4", "--requests-per-stream", "1", "--min-requests", "3", "--rounds", "2", "--threads", "1",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "throughput.json").read_text())
    rows = result["http"] + result["engine"] + result["engine_ceiling"]
    for kind in ("http", "engine", "engine_ceiling"):
        assert [r["concurrency"] for r in result[kind]] == [1, 2]
    # one stream alone sends three requests (--min-requests), two streams two each
    assert result["requests_per_stream"] == {"1": 3, "2": 2}
    assert all(r["generated_tokens"] == 4 * r["requests"] for r in rows)
    assert [r["requests"] for r in result["http"]] == [3, 4]
    assert all(r["ttft_p50_s"] is not None for r in rows)
    assert all(len(r["tokens_per_s_rounds"]) == 2 and r["tokens_per_s"] in r["tokens_per_s_rounds"] for r in rows)
    assert set(result["goals"]["http_share_of_ceiling"]) == {"1", "2"}
    # CPU is counted in clock ticks (10 ms): a smoke run this short may use none of either
    assert all(r["server_cpu_share"] >= 0 and r["engine_process_cpu_share"] >= 0 and r["client_cpu_share"] >= 0
               for r in result["http"])
    assert (out / "throughput.png").stat().st_size > 0
    assert "http/eng" in done.stdout
