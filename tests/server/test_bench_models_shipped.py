"""`xlserve bench models --quick` on every shipped checkpoint (weights/*-stdlib), as a user runs
it: every one gets a full row. The Reformer stops at 2,048 tokens, past the text quick mode
reads; its limit must not become a measurement point there (it was an IndexError).

16 s on 2 cores alone, 23 s beside other tests (12 checkpoints, the vanilla transformer's
byte-by-byte window the slowest, about 6 s);
the numbers themselves are not checked, only that each was measured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
SHIPPED = sorted(path.name for path in (REPOSITORY / "weights").glob("*-stdlib") if (path / "card.md").is_file())


def test_quick_models_bench_measures_every_shipped_checkpoint(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra draws the plot")
    assert "reformer-stdlib" in SHIPPED and len(SHIPPED) >= 12
    out = tmp_path / "models-quick.json"
    done = subprocess.run([sys.executable, "-m", "xlserve.server.cli", "bench", "models", "--quick",
                           "--threads", "1", "--out", str(out)],
                          cwd=REPOSITORY, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    result = json.loads(out.read_text())
    rows = {row["model"]: row for row in result["results"]}
    assert sorted(rows) == SHIPPED
    for name, row in rows.items():
        # quick mode's histories are all within every shipped model's limit: nothing is missing
        assert all(size is not None and size > 0 for size in row["state_bytes"].values()), name
        assert all(seconds is not None and seconds > 0 for seconds in row["append_s"].values()), name
        assert set(row["decode_tokens_per_s"]) == {str(batch) for batch in result["batch_sizes"]}, name
        assert all(rate > 0 for rate in row["decode_tokens_per_s"].values()), name
        assert name in done.stdout

    reformer = rows["reformer-stdlib"]
    assert reformer["history_limit"] == 2048
    # no requested history reaches the limit in quick mode, so the limit is not measured
    assert reformer["state_bytes_at_history_limit"] is None
    assert max(int(history) for history in reformer["history_fed_tokens"]) < reformer["history_limit"]
