"""`xlserve bench throughput` runs end to end (a small smoke run: the real one is run alone).

Each HTTP level generates a few hundred tokens, so that the engine process uses many 10 ms CPU
clock ticks while it is timed: its CPU share must then be above zero (a zero would mean the
bench measured the wrong process), and no process can use more than the machine's cores.
"""

import json
import os
import struct
import subprocess
import sys

from tests.e2e.server_process import make_checkpoint

LEVELS = [1, 2]
MAX_TOKENS = 32
MIN_REQUESTS = 8  # per level: 8 x 32 = 256 tokens, a few tenths of a second of engine work
ROUNDS = 2
TICK_S = 1 / os.sysconf("SC_CLK_TCK")  # /proc counts CPU time in clock ticks


def test_throughput_bench_smoke(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "txl-tiny")
    out = tmp_path / "results"
    env = {**os.environ, "XLSERVE_STATE_DIR": str(tmp_path / "state")}  # the bench's server writes nowhere else
    done = subprocess.run(
        [sys.executable, "-m", "xlserve.server.cli", "bench", "throughput", "--model", str(checkpoint),
         "--concurrency", ",".join(map(str, LEVELS)), "--max-tokens", str(MAX_TOKENS), "--requests-per-stream", "1",
         "--min-requests", str(MIN_REQUESTS), "--rounds", str(ROUNDS), "--threads", "1", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "throughput.json").read_text())
    cores = result["cpu_count"]
    assert cores == os.cpu_count() and cores >= 1
    assert (result["max_tokens"], result["rounds"], result["threads"]) == (MAX_TOKENS, ROUNDS, 1)

    # every level asked for, in each of the three measurements
    for kind in ("http", "engine", "engine_ceiling"):
        assert [r["concurrency"] for r in result[kind]] == LEVELS, kind
    # one stream alone sends MIN_REQUESTS requests, two streams half as many each
    assert result["requests_per_stream"] == {"1": MIN_REQUESTS, "2": MIN_REQUESTS // 2}
    assert [r["requests"] for r in result["http"]] == [MIN_REQUESTS, MIN_REQUESTS]

    rows = result["http"] + result["engine"] + result["engine_ceiling"]
    for row in rows:
        assert row["generated_tokens"] == MAX_TOKENS * row["requests"] > 0, row
        assert row["wall_s"] > 0 and row["tokens_per_s"] > 0, row
        # the reported rate is the tokens over the wall time (wall_s is rounded to 0.1 ms)
        assert abs(row["tokens_per_s"] - row["generated_tokens"] / row["wall_s"]) <= 0.01 * row["tokens_per_s"], row
        assert len(row["tokens_per_s_rounds"]) == ROUNDS and all(r > 0 for r in row["tokens_per_s_rounds"]), row
        assert row["tokens_per_s"] in row["tokens_per_s_rounds"]  # a real round, the median one
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] < row["wall_s"], row
        assert 0 <= row["itl_p50_s"] <= row["itl_p99_s"] < row["wall_s"], row  # two tokens may share a read

    for row in result["http"]:
        # shares are CPU seconds per wall second (1.0 = one core busy); /proc's are whole clock
        # ticks read at both ends, so each may be off by one tick over the row's wall time
        slack = TICK_S / row["wall_s"]
        shares = {key: row[key] for key in ("server_cpu_share", "engine_process_cpu_share", "client_cpu_share")}
        for key, value in shares.items():
            assert 0 <= value <= cores + slack, (key, row)
        assert sum(shares.values()) <= cores + 3 * slack, row  # three processes on `cores` cores
        # the engine process generated every token of the row: it was busy, for many ticks
        assert row["engine_process_cpu_share"] > 0, row
        assert row["server_cpu_share"] > 0, row  # the API process streamed every token

    goals = result["goals"]
    assert set(goals["http_share_of_engine"]) == set(goals["http_share_of_ceiling"]) == {str(c) for c in LEVELS}
    for level, value in goals["http_share_of_engine"].items():
        (http,) = [r for r in result["http"] if str(r["concurrency"]) == level]
        (engine,) = [r for r in result["engine"] if str(r["concurrency"]) == level]
        assert abs(value - http["tokens_per_s"] / engine["tokens_per_s"]) <= 0.001
    assert goals["http_overhead_goal_met"] == all(v >= 0.9 for v in goals["http_share_of_engine"].values())

    # the plot is a real PNG image of a sensible size
    png = (out / "throughput.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 400 and height >= 200, (width, height)

    # the table names every level
    assert "http/eng" in done.stdout
    table = done.stdout[done.stdout.index("http/eng"):].splitlines()[1:1 + len(LEVELS)]
    assert [int(line.split("|")[0]) for line in table] == LEVELS, table
    # nothing was written into the working directory (no bench-results/, no state/ but the one set)
    assert {p.name for p in tmp_path.iterdir()} <= {"txl-tiny", "results", "state"}, list(tmp_path.iterdir())
