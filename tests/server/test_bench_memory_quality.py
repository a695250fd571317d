"""`xlserve bench memory-quality` on one long held-out file: every row is scored, and a Mamba
checkpoint gets its own row beside a Transformer-XL whose state takes as many bytes."""

from __future__ import annotations

import json

from xlserve.server import cli


def test_memory_quality_compares_mamba_with_transformer_xl_at_its_state_bytes(tmp_path):
    cli.main(["new", "--arch", "mamba", "--preset", "tiny", "--out", str(tmp_path / "mamba")])
    out = tmp_path / "memory-quality.json"
    cli.main(["bench", "memory-quality", "--max-files", "1", "--max-file-bytes", "3000",
              "--mamba", str(tmp_path / "mamba"), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["scored_bytes"] == 2999
    rows = {row["model"]: row for row in result["results"]}
    assert set(rows) == {"∞-former", "∞-former, long-term memory off", "Transformer-XL, equal state bytes",
                         "Transformer-XL, as trained", "Mamba", "Transformer-XL, Mamba's state bytes"}
    assert all(0 < row["bits_per_byte"] < 9 for row in rows.values())
    mamba, matched = rows["Mamba"], rows["Transformer-XL, Mamba's state bytes"]
    assert matched["memory"] == f"mem_len {result['mamba_equal_bytes_mem_len']}"
    # equal bytes within one remembered position of Transformer-XL (4 layers x keys and values x 192 x 4 bytes)
    assert abs(matched["state_bytes"] - mamba["state_bytes"]) <= 4 * 2 * 192 * 4
    assert (tmp_path / "memory-quality.png").is_file()

