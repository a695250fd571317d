"""`xlserve bench real-size --quick` end to end on small shapes (the reference shapes are run
alone, never in the tests): each shape is built by transformers' own classes, converted, served by
a real `xlserve serve`, fed histories and appends committed through a real SessionCache to disk and
to a real redis-server, and decoded beside the reference."""

import json
import shutil
import statistics

import pytest

pytest.importorskip("transformers")

from xlserve.server.cli import main as cli  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make test installs it)")
    out = tmp_path_factory.mktemp("real-size") / "real-size.json"
    cli(["bench", "real-size", "--quick", "--threads", "1", "--max-fed-history", "128", "--out", str(out)])
    assert out.with_suffix(".png").read_bytes().startswith(PNG_SIGNATURE)
    return json.loads(out.read_text())


def test_every_shape_is_served_and_sized(result):
    assert result["benchmark"] == "real-size" and result["quick"]
    assert [shape["shape"] for shape in result["shapes"]] == ["transfo-xl-wt103", "xlnet-large", "reformer-enwik8"]
    assert result["read_bandwidth_bytes_per_s"] > 1e8
    for shape in result["shapes"]:
        served = shape["served"]
        assert served["ready_s"] > 0 and served["resident_bytes"] > served["proportional_bytes"] > 10 << 20
        # a greedy completion streamed over HTTP, a chunk per token, timed between tokens
        assert served["served_prompt_tokens"] == result["setting"]["decode_prompt"]
        assert served["served_new_tokens"] == result["setting"]["decode_tokens"]
        assert served["served_decode_tokens_per_s"] > 0 and served["served_first_token_s"] > 0
        # and as many clients at once as the largest in-process batch, each streaming every token
        assert served["served_batch"] == max(result["setting"]["batch_sizes"]) == 2
        assert served["served_batch_new_tokens"] == result["setting"]["decode_tokens"] * result["setting"]["decode_rounds"]
        # over the span every client decodes in, or (short completions on a busy machine) the whole span
        assert served["served_batch_tokens_per_s"] > 0 and served["served_batch_overlapped"] in (True, False)
        full = shape["state_bytes_per_session"]
        # /v1/models reports the same state bytes per session as the model computes from its shapes
        assert served["served_state_bytes_per_session"] == full["float32"] > 0
        assert full["bfloat16"] < full["float32"]
        # the state a session holds once its memory is full, measured after the longest history
        if shape["shape"] != "reformer-enwik8":  # (its state grows until max_context)
            longest = max((row for row in shape["appends"] if "skipped" not in row), key=lambda row: row["history_tokens"])
            assert longest["state_bytes"] == full["float32"]
        # a full session moves out and back in over HTTP at the default body limits
        assert served["served_state_export_s"] > 0 and served["served_state_import_s"] > 0
        if shape["shape"] != "reformer-enwik8":  # full: its export holds the state's bytes, and a header
            assert full["float32"] < served["served_state_export_bytes"] < full["float32"] + (1 << 20)
        # the server's default budgets, each tier's sessions counted against its own
        fits = shape["sessions_per_tier"]["float32"]
        assert fits["budgets"] == {"device": 1 << 30, "host": 4 << 30, "disk": 64 << 30}
        for tier in ("device", "host", "disk"):
            assert fits[tier] == fits["budgets"][tier] // full["float32"]


def test_appends_are_timed_and_their_bytes_counted_on_disk_and_in_redis(result):
    for shape in result["shapes"]:
        rows = [row for row in shape["appends"] if "skipped" not in row]
        assert rows, shape["shape"]
        for row in rows:
            assert row["forward_s"] > 0 and row["commit_disk_s"] > 0 and row["commit_redis_s"] > 0
            assert row["new_positions_bytes"] > 0
            # a commit writes at least its new positions
            for store in ("disk", "redis"):
                written = row[f"bytes_per_commit_{store}"]
                # a delta: well under the whole state, which every commit wrote before delta commits
                assert row["new_positions_bytes"] <= written < 0.75 * row["whole_blob_bytes"], (shape["shape"], store)
                if shape["shape"] != "reformer-enwik8":  # (its local windows change in place: slots)
                    # the goal, at these shapes too: the new positions and the next-token row
                    assert written <= 2 * row["new_positions_bytes"], (shape["shape"], store)
    # a capped feed is said per row, and only where the state is of fixed size past its memory
    fed = {(shape["shape"], row["history_tokens"]): row["history_fed_tokens"]
           for shape in result["shapes"] for row in shape["appends"] if "skipped" not in row}
    assert fed == {("transfo-xl-wt103", 64): 64, ("transfo-xl-wt103", 256): 128, ("xlnet-large", 64): 64,
                   ("xlnet-large", 256): 128, ("reformer-enwik8", 64): 64}
    # the Reformer's state grows until max_context: a history past it is skipped, not failed
    reformer = result["shapes"][2]
    assert any("skipped" in row and "max_context" in row["skipped"] for row in reformer["appends"])


def test_a_compaction_cycle_counts_the_whole_write_amortized_over_its_commits(result):
    """After the longest history each store takes appends until a compaction has run: the
    cycle's bytes are its delta commits and one whole write, which the median commit leaves out."""
    from xlserve.server.bench.real_size import MAX_CYCLE_COMMITS
    from xlserve.server.settings import CacheSettings

    assert result["setting"]["compact_ratio"] == CacheSettings.model_fields["compact_ratio"].default
    for shape in result["shapes"]:
        cycles = [row for row in shape["appends"] if "compaction_cycle" in row]
        if shape["shape"] == "reformer-enwik8":  # its 256 positions hold no bounded cycle here
            assert not cycles
            continue
        (row,) = cycles
        assert row["history_tokens"] == 256
        for store in ("disk", "redis"):
            cycle = row["compaction_cycle"][store]
            assert cycle["compacted"] and 2 <= cycle["commits"] <= MAX_CYCLE_COMMITS
            assert 0 < cycle["base_blob_bytes"] <= row["whole_blob_bytes"]
            assert cycle["bytes"] >= row["whole_blob_bytes"] + (cycle["commits"] - 1) * row["new_positions_bytes"]
            # one whole write over the cycle's commits: more than the median commit, and no more than
            # the commits and a whole write (the store's own framing, a Redis command's, aside)
            assert row[f"bytes_per_commit_{store}"] < cycle["bytes_per_commit"]
            assert cycle["bytes"] <= 1.2 * (cycle["commits"] * row[f"bytes_per_commit_{store}"] + row["whole_blob_bytes"])
            assert cycle["bytes_per_commit_over_new_positions"] == pytest.approx(
                cycle["bytes_per_commit"] / row["new_positions_bytes"])
            # and its time: the commits' and the compaction's behind them, over the commits (the
            # median commit's ratio left the compaction's seconds out)
            assert cycle["commit_s"] > 0 and cycle["compaction_s"] > 0
            assert cycle["seconds_per_commit"] == pytest.approx((cycle["commit_s"] + cycle["compaction_s"]) / cycle["commits"])
            assert cycle["append_with_commit_over_forward_amortized"] == pytest.approx(
                (row["forward_s"] + cycle["seconds_per_commit"]) / row["forward_s"])


def test_decode_matches_the_reference_and_reports_int8_and_bandwidth(result):
    for shape in result["shapes"]:
        rows = {row["batch_size"]: row for row in shape["decode"]}
        assert set(rows) == {1, 2}
        for batch, row in rows.items():
            assert row["xlserve_float32_tokens_per_s"] > 0 and row["xlserve_int8_tokens_per_s"] > 0
            assert row["reference_tokens_per_s"] > 0
            assert 0 < row["float32_bandwidth_fraction"] < 1.5
            # and each float32 round's against the bandwidth read beside it (before and after it, the larger)
            assert len(row["read_bandwidth_beside_rounds_bytes_per_s"]) == row["rounds"]
            assert all(read > 1e8 for read in row["read_bandwidth_beside_rounds_bytes_per_s"])
            assert row["float32_bandwidth_fraction_by_round"] == pytest.approx([
                row["weight_bytes_per_step_float32"] * tokens_per_s / batch / read
                for tokens_per_s, read in zip(row["xlserve_float32_tokens_per_s_by_round"],
                                              row["read_bandwidth_beside_rounds_bytes_per_s"])])
            assert row["float32_bandwidth_fraction_beside"] == pytest.approx(
                statistics.median(row["float32_bandwidth_fraction_by_round"]))
            # counting each row's state too: more bytes per step, so a larger fraction at the same speed
            assert row["state_bytes_per_row"] > 0
            assert row["bytes_read_per_step_float32"] == row["weight_bytes_per_step_float32"] + batch * row["state_bytes_per_row"]
            assert row["float32_read_fraction"] > row["float32_bandwidth_fraction"]
            assert row["float32_read_fraction"] == pytest.approx(
                row["xlserve_float32_tokens_per_s"] / row["float32_ceiling_tokens_per_s"])
            assert row["weight_bytes_per_step_int8"] < row["weight_bytes_per_step_float32"]
            # the runs took their rounds in turn: tokens/s is the median round's, within the spread
            assert row["rounds"] == result["setting"]["decode_rounds"] == 2
            for kind in ("float32", "int8"):
                slowest, fastest = row[f"xlserve_{kind}_tokens_per_s_spread"]
                assert slowest <= row[f"xlserve_{kind}_tokens_per_s"] <= fastest
            assert len(row["int8_over_float32_by_round"]) == 2
            if shape["shape"] != "reformer-enwik8" or batch == 1:
                assert row["identical_tokens"], (shape["shape"], batch)
        # a batch gains at most its size over one row, less as its rows' states weigh
        assert 1 < rows[2]["ceiling_over_batch_1"] < 2
        # every ratio is the median of the same ratio within each round, never a ratio of medians:
        # each round's ratio is that round's tokens/s of the one over the other's
        for kind in ("float32", "int8"):
            by_round = rows[2][f"{kind}_over_batch_1_by_round"]
            assert by_round == pytest.approx([batched / alone for batched, alone in zip(
                rows[2][f"xlserve_{kind}_tokens_per_s_by_round"], rows[1][f"xlserve_{kind}_tokens_per_s_by_round"])])
            assert len(by_round) == 2 and rows[2][f"{kind}_over_batch_1"] == pytest.approx(statistics.median(by_round))
            assert rows[1][f"{kind}_over_batch_1"] == 1.0
        for row in rows.values():
            assert row["int8_over_float32_by_round"] == pytest.approx([int8 / float32 for int8, float32 in zip(
                row["xlserve_int8_tokens_per_s_by_round"], row["xlserve_float32_tokens_per_s_by_round"])])
            assert row["int8_over_float32"] == pytest.approx(statistics.median(row["int8_over_float32_by_round"]))
            # the reference decoded amid xlserve's rounds, after the middle one
            assert row["reference_after_round"] == 2


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_per_step_count_the_output_tables_of_an_adaptive_softmax(tied):
    """A decode step reads the adaptive softmax's tables whole (tied to the input's or its own)
    and one row of an input table: tied, every parameter once; untied, all but the input tables."""
    from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig
    from xlserve.models.quantize import weight_bytes_per_step

    model = TransformerXL(TransformerXLConfig(n_layer=1, d_model=64, n_head=2, d_head=32, d_inner=128, vocab_size=1000,
                                              adaptive=True, cutoffs=[100, 400], div_val=2, mem_len=8,
                                              tie_embedding=tied))
    every_parameter = sum(p.numel() * p.element_size() for p in model.parameters())
    input_tables = sum(t.weight.numel() * t.weight.element_size() for t in model.embedding.tables)
    assert weight_bytes_per_step(model) == every_parameter - (0 if tied else input_tables)


def test_the_decode_ceiling_shares_the_weights_read_across_a_batch_but_never_the_states():
    from xlserve.server.bench.common import decode_ceiling

    one = decode_ceiling(weight_bytes=1000, state_bytes=0, batch=1, bandwidth=1e6)
    assert one == {"bytes_read_per_step": 1000, "ceiling_tokens_per_s": 1000.0}
    # no state: eight rows cost one read of the weights, eight times the tokens
    assert decode_ceiling(1000, 0, 8, 1e6)["ceiling_tokens_per_s"] == 8000.0
    # wt103's weights (1,141 MB) with 38 MB of memory per row: eight rows gain 6.5x at most, not 8x
    gain = (decode_ceiling(1141, 38, 8, 1.0)["ceiling_tokens_per_s"] / decode_ceiling(1141, 38, 1, 1.0)["ceiling_tokens_per_s"])
    assert gain == pytest.approx(8 * (1141 + 38) / (1141 + 8 * 38))
    assert 6.4 < gain < 6.6


def test_a_rows_state_bytes_are_what_its_model_holds_after_those_tokens():
    from xlserve.models.mamba import Mamba, MambaConfig
    from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig
    from xlserve.server.bench.common import state_bytes_per_row

    xl = TransformerXL(TransformerXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, vocab_size=50,
                                           mem_len=20)).eval()
    # the memory grows with the tokens up to mem_len: keys and values of every layer, 4 bytes each
    assert state_bytes_per_row(xl, 20, 50) - state_bytes_per_row(xl, 10, 50) == 10 * 2 * 2 * 32 * 4 + 10
    assert state_bytes_per_row(xl, 30, 50) == state_bytes_per_row(xl, 20, 50)
    mamba = Mamba(MambaConfig(vocab_size=50, n_layer=2, d_model=16, d_inner=32)).eval()
    assert state_bytes_per_row(mamba, 5, 50) == state_bytes_per_row(mamba, 50, 50) == mamba.init_state(1).nbytes()


def test_a_model_whose_state_grows_without_bound_says_how_to_size_its_state_bodies():
    """Such a model has no full state to size the state-body limit by, which then stays at the
    request body limit: its longer sessions export but do not import back. The start-up log says
    which setting sizes them."""
    from xlserve.server.app import sessions_per_tier

    line = sessions_per_tier({"state_bytes_per_session": None}, {"device_bytes": 1, "host_bytes": 1, "disk_bytes": 1},
                             redis=False)
    assert "grows with every token" in line and "XLSERVE_MAX_STATE_BODY_BYTES" in line


def test_a_history_fed_short_still_fills_the_memory():
    """--max-fed-history below the memory's length left the state short of full while its row
    said the whole history: wt103's 8k and 64k rows would have been a memory of 1,024 positions,
    their whole blob and compaction cycle wrong. The feed is never shorter than mem_len."""
    from types import SimpleNamespace

    import torch

    from xlserve.models.registry import build_model
    from xlserve.models.training.presets import preset_config
    from xlserve.server.bench.real_size import measure_appends

    torch.manual_seed(0)
    model = build_model("transformer-xl", preset_config("transformer-xl", "tiny")).eval()  # mem_len 32
    args = SimpleNamespace(max_fed_history=8, append=4, appends=1, history_chunk=64, compact_ratio=1.5)
    with torch.inference_mode():
        row = measure_appends("tiny", model, 100, args, "", model.vocab_size)
    assert row["history_fed_tokens"] == model.config.mem_len == 32
