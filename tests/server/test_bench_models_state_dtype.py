"""`xlserve bench models --state-dtype bfloat16`: its scoring in turns is the model's held-out
bits per byte (the same as one pass for a chunking-invariant model), and the quick run reports,
per checkpoint, bytes and bits per byte with float32 and with bfloat16 state."""

import json
import math
import subprocess
import sys

import pytest
import torch

from xlserve.models.registry import build_model
from xlserve.models.training.presets import preset_config
from xlserve.server.bench.models import turn_bits_per_byte

from tests.e2e.server_process import make_checkpoint

TEXT = list(b"import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n" * 4)


def one_pass_bits_per_byte(model, tokens: list[int]) -> float:
    with torch.inference_mode():
        log_probs, _ = model(torch.tensor([tokens]), model.init_state(1))
    picked = log_probs[0, :-1].gather(1, torch.tensor(tokens[1:])[:, None])
    return -float(picked.sum()) / math.log(2) / (len(tokens) - 1)


@pytest.mark.parametrize("architecture", ["performer", "linformer"])
def test_scoring_in_turns_is_the_one_pass_score_and_16_bits_stay_close(architecture):
    torch.manual_seed(0)
    model = build_model(architecture, preset_config(architecture, "tiny")).eval()
    assert model.chunking_invariant
    with torch.inference_mode():
        whole = turn_bits_per_byte(model, TEXT, len(TEXT), None)
        in_turns = turn_bits_per_byte(model, TEXT, 37, None)
        rounded = turn_bits_per_byte(model, TEXT, 37, torch.bfloat16)
    assert whole == pytest.approx(one_pass_bits_per_byte(model, TEXT), abs=1e-6)
    assert in_turns == pytest.approx(whole, abs=1e-4)  # float tolerance of a chunking-invariant model
    assert rounded != in_turns and abs(rounded - in_turns) <= 0.01  # the state was rounded, and it costs little


def test_quick_run_reports_bytes_and_bits_per_byte_in_both_dtypes(tmp_path):
    weights = tmp_path / "weights"
    checkpoint = weights / "performer-tiny"
    make_checkpoint(checkpoint, arch="performer")
    (checkpoint / "card.md").write_text("# performer-tiny\n")
    out = tmp_path / "models.json"
    done = subprocess.run([sys.executable, "-m", "xlserve.server.cli", "bench", "models", "--quick", "--weights-dir",
                           str(weights), "--threads", "1", "--batch-sizes", "1", "--state-dtype", "bfloat16",
                           "--out", str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["state_dtype"] == "bfloat16" and result["state_dtype_bound"] == 0.01
    compared = result["results"][0]["state_dtype"]
    assert compared["dtype"] == "bfloat16" and compared["scored_tokens"] == 1024 and compared["turn_tokens"] == 128
    for history in result["state_histories"]:
        full, half = compared["state_bytes"]["float32"][str(history)], compared["state_bytes"]["bfloat16"][str(history)]
        assert full == result["results"][0]["state_bytes"][str(history)]
        assert 2 * half - full == 8  # the floating tensors halved; the int64 position as it was
    bits = compared["bits_per_byte"]
    assert bits["float32"] > 0 and bits["bfloat16"] > 0
    assert compared["difference"] == pytest.approx(bits["bfloat16"] - bits["float32"])
    assert compared["within_bound"] == (abs(compared["difference"]) <= 0.01)
    assert "bits/byte bfloat16" in done.stdout and "performer-tiny" in done.stdout
