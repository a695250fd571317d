"""`xlserve bench models --quick` runs end to end on two tiny random checkpoints (the real run is
done alone on the shipped ones): one row per checkpoint with every field, a constant-state
architecture's state the same size after both histories, bits per byte from evaluation.json or
marked missing, and a real PNG beside the JSON."""

import json
import subprocess
import sys

from tests.e2e.server_process import make_checkpoint

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIELDS = {"model", "architecture", "state_kind", "parameters", "bits_per_byte", "bits_per_byte_scored_bytes",
          "state_bytes", "append_s", "append_s_rounds", "append_time_spread", "decode_tokens_per_s",
          "decode_tokens_per_s_runs", "decode_after_tokens", "history_fed_tokens", "history_limit",
          "state_bytes_at_history_limit", "seconds"}


def cli(*args, cwd):
    done = subprocess.run([sys.executable, "-m", "xlserve.server.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_models_bench_quick(tmp_path):
    weights = tmp_path / "weights"
    for arch in ("performer", "adaptive-span"):
        make_checkpoint(weights / f"{arch}-tiny", arch=arch)
        (weights / f"{arch}-tiny" / "card.md").write_text(f"# {arch}-tiny\n")
    # only the performer has a held-out evaluation; the other's bits per byte are missing
    (weights / "performer-tiny" / "evaluation.json").write_text(json.dumps(
        [{"memory": "trained", "bits_per_byte": 7.5, "scored_bytes": 1000},
         {"memory": "none", "bits_per_byte": 8.0, "scored_bytes": 1000}]))
    (weights / "not-a-checkpoint").mkdir()  # no config.json, no card: not a row
    out = tmp_path / "results" / "models.json"
    stdout = cli("bench", "models", "--quick", "--weights-dir", str(weights), "--threads", "1", "--out", str(out),
                 cwd=tmp_path)

    result = json.loads(out.read_text())
    assert result["benchmark"] == "models" and result["quick"] and result["threads"] == 1
    histories, states, batches = result["histories"], result["state_histories"], result["batch_sizes"]
    assert len(histories) >= 2 and len(states) == 2 and batches == [1, 16]
    rows = {row["model"]: row for row in result["results"]}
    assert list(rows) == ["adaptive-span-tiny", "performer-tiny"]  # every checkpoint with a card, sorted
    for name, row in rows.items():
        assert set(row) == FIELDS, name
        assert row["architecture"] == name.removesuffix("-tiny")
        assert row["parameters"] > 0
        assert set(row["state_bytes"]) == {str(h) for h in states}
        assert all(n > 0 for n in row["state_bytes"].values())
        assert set(row["append_s"]) == {str(h) for h in histories}
        for h in histories:
            rounds = row["append_s_rounds"][str(h)]
            assert len(rounds) == result["repeats"] and all(t > 0 for t in rounds)
            assert min(rounds) <= row["append_s"][str(h)] <= max(rounds)  # the median
        assert set(row["decode_tokens_per_s"]) == {str(b) for b in batches}
        assert all(rate > 0 for rate in row["decode_tokens_per_s"].values())
        # these architectures carry their state: every history was fed whole
        assert row["history_fed_tokens"] == {str(h): h for h in sorted(set(histories) | set(states))}

    performer, span = rows["performer-tiny"], rows["adaptive-span-tiny"]
    assert performer["bits_per_byte"] == 7.5 and performer["bits_per_byte_scored_bytes"] == 1000
    assert span["bits_per_byte"] is None
    # Performer's state is constant in the history: the same bytes after both histories
    assert performer["state_kind"] == "linear"
    assert performer["state_bytes"][str(states[0])] == performer["state_bytes"][str(states[1])]

    # the table names every checkpoint and says which have no evaluation
    assert "performer-tiny" in stdout and "adaptive-span-tiny" in stdout and "7.5000" in stdout
    assert "no held-out evaluation" in stdout
    png = out.with_suffix(".png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 1000


def test_models_bench_named_checkpoint_and_fixed_context(tmp_path):
    """--models takes a path; a fixed-context model (vanilla) is fed only its last window of
    each history, and the state is still that of the whole history (same bytes)."""
    checkpoint = tmp_path / "vanilla-tiny"
    make_checkpoint(checkpoint, arch="vanilla")
    out = tmp_path / "models.json"
    cli("bench", "models", "--quick", "--models", str(checkpoint), "--batch-sizes", "1,2", "--threads", "1",
        "--out", str(out), cwd=tmp_path)
    (row,) = json.loads(out.read_text())["results"]
    assert row["model"] == "vanilla-tiny" and row["bits_per_byte"] is None
    context = json.loads((checkpoint / "config.json").read_text())["config"]["context_len"]
    assert all(fed == min(int(h), context) for h, fed in row["history_fed_tokens"].items())
    assert len(set(row["state_bytes"].values())) == 1
    assert set(row["decode_tokens_per_s"]) == {"1", "2"}


def test_a_model_that_stops_at_max_context_has_no_row_past_it(tmp_path):
    """A Reformer refuses a history longer than its axial positions (max_context): the bench
    measures what fits and reports null (`-` in the table) for the rest, instead of failing."""
    import torch

    from xlserve.models.checkpoint import save_checkpoint
    from xlserve.models.reformer import Reformer, ReformerConfig

    torch.manual_seed(0)
    model = Reformer(ReformerConfig(attn_layers=["lsh", "local"], d_model=16, n_head=2, d_head=8, d_inner=32,
                                    lsh_chunk=4, n_hashes=2, n_buckets=4, local_chunk=4,
                                    axial_pos_shape=[16, 16], axial_pos_dims=[6, 10]))
    assert model.max_context == 256 and model.sliding_window is None
    checkpoint = tmp_path / "reformer-small-axial"
    save_checkpoint(model, checkpoint)
    out = tmp_path / "models.json"
    stdout = cli("bench", "models", "--models", str(checkpoint), "--histories", "64,200", "--state-histories", "32,256",
                 "--append", "64", "--decode", "4", "--repeats", "1", "--batch-sizes", "1,2", "--threads", "1",
                 "--out", str(out), cwd=tmp_path)
    (row,) = json.loads(out.read_text())["results"]
    assert row["history_limit"] == 256
    assert row["state_bytes"]["32"] < row["state_bytes"]["256"]  # its state grows with the history
    assert row["append_s"]["64"] > 0 and row["append_s"]["200"] is None  # 200 + 64 > 256: not measured
    assert row["append_s_rounds"]["200"] is None and row["append_time_spread"] == 0
    assert row["history_fed_tokens"] == {"32": 32, "64": 64, "200": 200, "256": 256}
    assert all(rate > 0 for rate in row["decode_tokens_per_s"].values())
    (line,) = [line for line in stdout.splitlines() if line.startswith("| reformer-small-axial")]
    assert line.split("|")[-4].strip() == "-"  # the append after 200 tokens
    assert row["state_bytes_at_history_limit"] == row["state_bytes"]["256"] and row["decode_after_tokens"] == 32

    # every state history past the limit (a stdlib Reformer against the default 4 KB / 64 KB): the
    # state is given at the limit, and decoding starts from the longest history that leaves room
    stdout = cli("bench", "models", "--models", str(checkpoint), "--histories", "64,200", "--state-histories",
                 "512,1024", "--append", "64", "--decode", "4", "--repeats", "1", "--batch-sizes", "1,2",
                 "--threads", "1", "--out", str(out), cwd=tmp_path)
    (row,) = json.loads(out.read_text())["results"]
    assert row["state_bytes"] == {"512": None, "1024": None} and row["state_bytes_at_history_limit"] > 0
    assert row["decode_after_tokens"] == 200 and all(rate > 0 for rate in row["decode_tokens_per_s"].values())
    assert "reformer-small-axial (256; state there " in stdout and "decoded after 200 tokens)" in stdout
    assert out.with_suffix(".png").stat().st_size > 0  # plotted at the state it stops with
