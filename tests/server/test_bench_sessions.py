"""`xlserve bench sessions` over a model that stops at its max_context (the Reformer): the
histories it cannot hold are skipped and said so, the others measured."""

import json

import torch

from xlserve.models.checkpoint import save_checkpoint
from xlserve.models.registry import build_model
from xlserve.models.training.presets import preset_config
from xlserve.server.bench import sessions


def test_histories_past_max_context_are_skipped_not_failed(tmp_path, capsys):
    torch.manual_seed(0)
    model = build_model("reformer", {**preset_config("reformer", "tiny"), "axial_pos_shape": [2, 64]}).eval()
    assert model.max_context == 128 and model.sliding_window is None
    save_checkpoint(model, tmp_path / "reformer-128")
    sessions.main(["--models", str(tmp_path / "reformer-128"), "--histories", "64,128,512", "--repeats", "1",
                   "--no-redis", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert "H=   512  skipped: past its max_context 128, where it stops" in printed
    results = json.loads((tmp_path / "out" / "sessions.json").read_text())["results"]
    assert [row["history_tokens"] for row in results] == [64, 128]
    assert all(row["state_bytes"] > 0 for row in results)
