"""LogSparse attention (Li et al. 2019): the pattern against the paper's definition, chunking,
batching, the bounded state, checkpoints, state checks and a training smoke run."""

from dataclasses import replace

import pytest
import torch

from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models.logsparse import (
    LogSparseConfig, LogSparseTransformer, LookbackMemory, gathered_attention, logsparse_distances, masked_attention,
    pattern_mask,
)
from xlserve.models.registry import build_model
from xlserve.models.training.presets import preset_config
from xlserve.models.training.train import STANDARD_RECIPE, train
from tests.models.helpers import assert_state_round_trips, run_in_chunks, state_bytes_after_4_kb_and_64_kb, tokens

R, W = 16, 3  # restart length and local window of the test model


def small_model(n_layer=2, restart_len=R, local_window=W, **overrides) -> LogSparseTransformer:
    torch.manual_seed(0)
    config = LogSparseConfig(n_layer=n_layer, d_model=32, n_head=2, d_head=16, d_inner=64,
                             restart_len=restart_len, local_window=local_window, **overrides)
    return LogSparseTransformer(config).eval()


def paper_mask(n: int, restart_len: int, local_window: int) -> torch.Tensor:
    """(n, n) bool, query i (row) may attend to key j (column), built from the paper's words:
    restart attention splits the input into subsequences of `restart_len` cells and applies
    LogSparse to each, so cell l (counted from its subsequence's start) sees
    I_l = {l - 2^floor(log2 l), ..., l - 2^1, l - 2^0, l}; local attention adds the window of
    its `local_window` most recent cells (itself included)."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        start = restart_len * (i // restart_len)
        l = i - start
        seen = {i}
        if l >= 1:
            top = l.bit_length() - 1  # floor(log2 l)
            seen |= {start + l - 2 ** k for k in range(top + 1)}
        seen |= {j for j in range(i - local_window + 1, i + 1) if j >= 0}
        for j in seen:
            mask[i, j] = True
    return mask


def table_mask(model: LogSparseTransformer, start: int, count: int, n: int) -> torch.Tensor:
    """The model's own pattern (`visible`) for queries start .. start+count-1, as rows of an
    (n, n) mask over absolute key positions."""
    S = model.reach
    positions = torch.arange(start, start + count)[None]
    index, allowed = model.visible(positions)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for t in range(count):
        for a in range(index.shape[2]):
            if allowed[0, t, a]:
                mask[start + t, start - S + int(index[0, t, a])] = True
    return mask


# -- (a) the pattern ------------------------------------------------------------------------------


@pytest.mark.parametrize("restart_len,local_window", [(16, 3), (16, 1), (13, 5), (64, 8), (256, 16), (1, 4)])
def test_pattern_table_is_the_papers_definition(restart_len, local_window):
    model = small_model(restart_len=restart_len, local_window=local_window)
    n = 3 * restart_len + 11
    expected = paper_mask(n, restart_len, local_window)
    for start in (0, 5, restart_len - 1, restart_len + 2):  # chunks starting anywhere
        start = min(start, n - 1)
        rows = torch.zeros(n, dtype=torch.bool)
        rows[start:] = True
        assert torch.equal(table_mask(model, start, n - start, n), expected & rows[:, None])


def test_state_keeps_exactly_the_longest_look_back():
    """S = max(w - 1, largest power of two <= R - 1): the farthest any query ever looks."""
    for restart_len, local_window, reach in [(16, 3, 8), (17, 3, 16), (256, 16, 128), (8, 20, 19), (1, 1, 0)]:
        assert small_model(restart_len=restart_len, local_window=local_window).reach == reach
        mask = paper_mask(4 * restart_len + local_window, restart_len, local_window)
        i, j = mask.nonzero(as_tuple=True)
        assert int((i - j).max()) == reach


def test_each_query_attends_to_at_most_window_plus_log_keys():
    distances, allowed = logsparse_distances(256, 16)
    assert allowed.shape[1] == 16 + 4  # the window, and steps 16, 32, 64, 128
    assert int(allowed[0].sum()) == 16 and int(allowed[255].sum()) == 20


def test_served_attention_follows_the_pattern():
    """Through the real one-layer model, over a call that starts mid-history: the log-probs of
    query i depend on key/value j (in the state or in the call) exactly where the paper's mask
    allows it."""
    model = small_model(n_layer=1)
    history, chunk = tokens(1, 37, 1), tokens(1, 30, 2)
    with torch.no_grad():
        _, state = model(history, model.init_state(1))
    S, start = model.reach, 37
    past_keys = state.keys[0].clone().requires_grad_(True)
    past_values = state.values[0].clone().requires_grad_(True)
    embedded = []
    hook = model.embedding.register_forward_hook(lambda m, args, out: embedded.append(out) or out.retain_grad())
    log_probs, _ = model(chunk, LookbackMemory([past_keys], [past_values], state.position))
    hook.remove()
    n = start + chunk.shape[1]
    expected = paper_mask(n, R, W)
    for t in range(chunk.shape[1]):
        for tensor in (past_keys, past_values, embedded[0]):
            tensor.grad = None
        log_probs[0, t, 7].backward(retain_graph=True)
        seen = set()
        for m in range(S):
            if (past_keys.grad[0, m].abs().sum() + past_values.grad[0, m].abs().sum()) > 0:
                seen.add(start - S + m)
        for u in range(chunk.shape[1]):
            if embedded[0].grad[0, u].abs().sum() > 0:
                seen.add(start + u)
        assert seen == set(expected[start + t].nonzero().flatten().tolist()), t


def test_long_chunks_attend_densely_under_the_same_pattern():
    """A long chunk's dense masked product is the gathered attention of the same pattern: the
    mask holds exactly the gathered keys, and the outputs agree."""
    model = small_model()
    S, T = model.reach, 40
    positions = (23 + torch.arange(T))[None].expand(2, T)
    index, allowed = model.visible(positions)
    mask = pattern_mask(index, allowed, S + T)  # (2, 1, T, S + T)
    for t in range(T):
        assert set(mask[0, 0, t].nonzero().flatten().tolist()) == set(index[0, t][allowed[0, t]].tolist())
    torch.manual_seed(1)
    q, keys, values = torch.randn(2, T, 2, 16), torch.randn(2, S + T, 2, 16), torch.randn(2, S + T, 2, 16)
    torch.testing.assert_close(masked_attention(q, keys, values, mask), gathered_attention(q, keys, values, index, allowed),
                               rtol=0, atol=1e-5)


# -- (b) chunking ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunks_give_the_log_probs_of_one_pass(chunk):
    model = small_model()
    text = tokens(2, 5 * R + 9, 3)
    whole, whole_state = run_in_chunks(model, text, text.shape[1])
    pieces, state = run_in_chunks(model, text, chunk)
    assert (whole - pieces).abs().max().item() < 1e-5
    assert torch.equal(state.position, whole_state.position)
    for a, b in zip(state.keys + state.values, whole_state.keys + whole_state.values):
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunks_with_the_tiny_preset(chunk):
    torch.manual_seed(0)
    model = build_model("logsparse", preset_config("logsparse", "tiny")).eval()
    text = tokens(1, 200, 4)  # crosses three subsequences of 64
    whole, _ = run_in_chunks(model, text, 200)
    pieces, _ = run_in_chunks(model, text, chunk)
    assert (whole - pieces).abs().max().item() < 1e-5


# -- (c) batching ---------------------------------------------------------------------------------


def test_rows_with_different_histories_decode_together():
    model = small_model()
    histories = [tokens(1, n, 10 + n) for n in (0, 5, 2 * R + 3)]
    steps = tokens(3, 9, 5)
    with torch.no_grad():
        alone, states = [], []
        for b, history in enumerate(histories):
            _, state = model(history, model.init_state(1))
            states.append(state)
            out, _ = run_in_chunks(model, steps[b : b + 1], 1, state)
            alone.append(out)
        batch = LookbackMemory.concat(states)
        together, batch = run_in_chunks(model, steps, 1, batch)
    for b in range(3):
        assert (together[b] - alone[b][0]).abs().max().item() < 1e-5
    assert batch.position.tolist() == [9, 14, 2 * R + 12]
    rows = batch.split()
    assert [int(r.position) for r in rows] == [9, 14, 2 * R + 12]
    taken = batch.take([2, 0])
    assert torch.equal(taken.keys[1][0], batch.keys[1][2]) and torch.equal(taken.position, batch.position[[2, 0]])
    for row in rows:
        model.check_state(row, int(row.position))


def test_put_row_writes_a_row_in_place():
    model = small_model()
    with torch.no_grad():
        _, a = model(tokens(1, 4, 6), model.init_state(1))
        _, b = model(tokens(1, 20, 7), model.init_state(1))
        batch = LookbackMemory.concat([a, a.clone()])
        assert batch.put_row(1, b)
        step = tokens(2, 1, 8)
        out, _ = model(step, batch)
        alone, _ = model(step[1:], b)
    assert (out[1] - alone[0]).abs().max().item() < 1e-5
    with torch.enable_grad():
        assert not batch.put_row(0, b)  # never under autograd


# -- (d) the state round-trips ------------------------------------------------------------------------


def test_state_round_trips_through_safetensors(tmp_path):
    model = small_model()
    text = tokens(1, 2 * R + 5, 9)
    with torch.no_grad():
        _, state = model(text, model.init_state(1))
    assert isinstance(state, LookbackMemory)
    assert_state_round_trips(model, state, text.shape[1], tokens(1, 11, 10), tmp_path)


# -- (e) the state is bounded -----------------------------------------------------------------------


def test_state_bytes_are_equal_after_4_kb_and_64_kb():
    torch.manual_seed(0)
    model = build_model("logsparse", preset_config("logsparse", "tiny")).eval()
    c = model.config
    formula = 2 * c.n_layer * model.reach * c.n_head * c.d_head * 4 + 8
    at_4k, at_64k, _ = state_bytes_after_4_kb_and_64_kb(model, seed=11)
    assert at_4k == at_64k == formula == model.init_state(1).nbytes()
    # the preset that ships: 128 positions per layer
    small = build_model("logsparse", preset_config("logsparse", "small"))
    assert small.reach == 128 and small.init_state(1).nbytes() == 2 * 4 * 128 * 4 * 48 * 4 + 8


# -- (f) checkpoints ---------------------------------------------------------------------------------


def test_save_and_load_give_identical_log_probs(tmp_path):
    model = small_model()
    save_checkpoint(model, tmp_path / "logsparse")
    loaded = load_checkpoint(tmp_path / "logsparse")
    text = tokens(1, 3 * R, 12)
    with torch.no_grad():
        a, _ = model(text, model.init_state(1))
        b, _ = loaded(text, loaded.init_state(1))
    assert torch.equal(a, b)
    assert loaded.state_kind == "window" and not loaded.state_grows_with_context and loaded.max_context is None
    assert "distances" not in loaded.state_dict()  # the pattern table is rebuilt from the config


# -- (g) checking states from outside ----------------------------------------------------------------


def test_check_state_accepts_real_states_and_refuses_poisoned_ones():
    model = small_model()
    for n in (0, 1, 5, R, 3 * R + 2):
        with torch.no_grad():
            _, state = model(tokens(1, n, 13), model.init_state(1)) if n else (None, model.init_state(1))
        model.check_state(state, n)
    with torch.no_grad():
        _, state = model(tokens(1, 5, 14), model.init_state(1))
    good = state.to_tensors()

    def refused(changes: dict, match: str, tokens_seen: int = 5):
        poisoned = {**good, **changes}
        with pytest.raises(ValueError, match=match):
            model.check_state(LookbackMemory.from_tensors(poisoned), tokens_seen)

    nan = good["keys.1"].clone()
    nan[0, -1, 0, 0] = float("nan")
    refused({"keys.1": nan}, "keys.1")
    refused({"values.0": good["values.0"][:, 1:]}, "values.0")  # a slot short
    refused({"position": torch.tensor([4])}, "position")  # does not fit 5 tokens
    refused({"position": torch.tensor([5])}, "position", tokens_seen=6)
    refused({"position": torch.tensor([5], dtype=torch.int32)}, "position")
    written = good["keys.0"].clone()
    written[0, 0] = 1.0  # a slot before the first position (5 seen, S = 8)
    refused({"keys.0": written}, "keys.0")
    with pytest.raises(ValueError, match="negative"):
        model.check_state(LookbackMemory.from_tensors({**good, "position": torch.tensor([-1])}))
    with pytest.raises(ValueError, match="do not match"):
        model.check_state(LookbackMemory.from_tensors({k: v for k, v in good.items() if k != "values.1"}))


# -- training ----------------------------------------------------------------------------------------


def test_three_training_steps_with_the_standard_loop(tmp_path):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 3, batch_size=4, segment_len=32,
                     eval_every=1000, save_every=3, quick_eval_bytes=2000, warmup_steps=2)
    model = train("logsparse", "tiny", tmp_path / "out", recipe, log=lambda s: None)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    loaded = load_checkpoint(tmp_path / "out")
    text = tokens(1, 40, 15)
    with torch.no_grad():
        assert torch.equal(model(text, model.init_state(1))[0], loaded(text, loaded.init_state(1))[0])


def test_a_decoding_step_scores_only_the_keys_it_attends_to(monkeypatch):
    """One new token: every layer gathers A = w + #steps keys for its one query, not the S kept."""
    import xlserve.models.logsparse as logsparse

    model = small_model(restart_len=64, local_window=3)
    with torch.no_grad():
        _, state = model(tokens(1, 100, 16), model.init_state(1))
    shapes = []
    original = logsparse.gathered_attention
    monkeypatch.setattr(logsparse, "gathered_attention",
                        lambda q, k, v, index, allowed, dropatt: shapes.append(tuple(index.shape)) or original(q, k, v, index, allowed, dropatt))
    with torch.no_grad():
        model(tokens(1, 1, 17), state)
    assert shapes == [(1, 1, 3 + 4)] * 2  # window 3, steps 4, 8, 16, 32; S = 32
    assert model.reach == 32
