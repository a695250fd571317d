"""The vanilla character transformer (Al-Rfou et al. 2018): its losses and its served window."""

import pytest
import torch

from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models.training.train import training_loss as standard_training_loss
from xlserve.models.vanilla import ByteWindow, VanillaConfig, VanillaTransformer, intermediate_layer_weights
from tests.models.helpers import run_in_chunks, tokens

L = 12  # context of the test model


def small_model(**overrides) -> VanillaTransformer:
    torch.manual_seed(0)
    config = VanillaConfig(n_layer=3, d_model=32, n_head=2, d_head=16, d_inner=64, context_len=L, **overrides)
    return VanillaTransformer(config).eval()


def window_reference(model, text):
    """For every position t, the log-probs of one fresh forward over the window of the last L
    bytes ending at t (positions counted from the window's start)."""
    rows = []
    with torch.no_grad():
        for t in range(text.shape[1]):
            window = text[:, max(0, t - L + 1) : t + 1]
            log_probs, _ = model(window, model.init_state(text.shape[0]))
            rows.append(log_probs[:, -1])
    return torch.stack(rows, dim=1)


# -- the loss -------------------------------------------------------------------------------------


def test_without_auxiliary_losses_the_loss_is_the_plain_next_byte_loss():
    model = small_model(aux_positions=False, aux_layers=False, aux_targets=False).train()
    inputs, targets = tokens(3, L, 2), tokens(3, L, 3)
    log_probs, _ = model(inputs, model.init_state(3))  # one window: position L-1 sees all of it
    plain = -log_probs[:, -1].gather(-1, targets[:, -1:]).mean()
    loss, state = model.training_loss(inputs, targets, model.init_state(3), fraction_done=0.1)
    assert abs(loss.item() - plain.item()) < 1e-5
    assert state.length == 0  # no memory between windows


def test_multiple_positions_alone_is_the_standard_loop_loss():
    model = small_model(aux_positions=True, aux_layers=False, aux_targets=False).train()
    inputs, targets = tokens(2, L, 4), tokens(2, L, 5)
    loss, _ = model.training_loss(inputs, targets, model.init_state(2), 0.0)
    log_probs, _ = model(inputs, model.init_state(2))
    plain = -log_probs.gather(-1, targets[..., None]).mean()
    assert abs(loss.item() - plain.item()) < 1e-5


def test_multiple_targets_add_half_the_two_ahead_loss():
    model = small_model(aux_layers=False, aux_targets=True).train()
    inputs, targets = tokens(2, L, 6), tokens(2, L, 7)
    loss, _ = model.training_loss(inputs, targets, model.init_state(2), 0.0)
    hidden, _, _, _ = model._stack(inputs, 0, None)
    next_loss = torch.nn.functional.cross_entropy(model.head(hidden).flatten(0, 1), targets.flatten())
    second = torch.nn.functional.cross_entropy(model.second_head(hidden[:, :-1]).flatten(0, 1), targets[:, 1:].flatten())
    assert abs(loss.item() - (next_loss + 0.5 * second).item()) < 1e-5


@pytest.mark.parametrize("n_layer", [2, 4, 64])
def test_intermediate_layers_drop_at_l_over_2n(n_layer):
    for l in range(1, n_layer):
        cut = l / (2 * n_layer)
        assert intermediate_layer_weights(n_layer, cut - 1e-6)[l - 1] == 1.0
        assert intermediate_layer_weights(n_layer, cut)[l - 1] == 0.0
    assert intermediate_layer_weights(n_layer, 0.5) == [0.0] * (n_layer - 1) + [1.0]
    assert intermediate_layer_weights(n_layer, 0.99)[-1] == 1.0


def test_intermediate_layer_losses_follow_the_schedule():
    """3 layers: layer 1 counts before 1/6 of training, layer 2 before 2/6, the top always."""
    model = small_model(aux_layers=True, aux_targets=False).train()
    inputs, targets = tokens(2, L, 8), tokens(2, L, 9)
    _, _, _, outputs = model._stack(inputs, 0, None, all_layers=True)
    per_layer = [
        torch.nn.functional.cross_entropy(model.head(model.final_norm(h)).flatten(0, 1), targets.flatten()).item()
        for h in outputs
    ]
    for fraction, active in [(0.0, [1, 2, 3]), (0.17, [2, 3]), (0.34, [3]), (0.9, [3])]:
        loss, _ = model.training_loss(inputs, targets, model.init_state(2), fraction)
        assert abs(loss.item() - sum(per_layer[l - 1] for l in active)) < 1e-4


def test_training_loss_trains():
    model = small_model().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    inputs = tokens(4, L, 10) % 8  # a small alphabet
    targets = torch.roll(inputs, -1, dims=1)
    first = None
    for step in range(30):
        loss, _ = standard_training_loss(model, inputs, targets, model.init_state(4), step / 30)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.7 * first


# -- serving ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 5, 12, 40])
def test_served_decoding_equals_a_forward_over_each_window(chunk):
    """Before the window slides (first L bytes) and after it: every prediction is the model's
    prediction from the window of the last L bytes, whatever the chunking."""
    model = small_model()
    text = tokens(2, 3 * L + 5, 11)
    expected = window_reference(model, text)
    served, state = run_in_chunks(model, text, chunk)
    assert (served - expected).abs().max().item() < 1e-5
    assert torch.equal(state.tokens, text[:, -L:])
    assert state.cache_length == 0 and not state.cached.any()  # slid: the cache is gone


def test_cache_is_used_until_the_window_is_full():
    model = small_model()
    text = tokens(1, L, 12)
    with torch.no_grad():
        _, state = model(text[:, :5], model.init_state(1))
        assert state.length == 5 and state.cache_length == 5 and state.fully_cached
        _, state = model(text[:, 5:6], state)
        assert state.cache_length == 6
        _, state = model(text[:, 6:], state)
    assert state.length == L and state.cache_length == 0  # the next byte shifts every position


def test_incremental_steps_use_the_cache():
    """While the window is not full a single-byte step runs one position through the layers."""
    model = small_model()
    text = tokens(1, 6, 13)
    with torch.no_grad():
        _, state = model(text[:, :5], model.init_state(1))
        calls = []
        hook = model.layers[0].register_forward_hook(lambda m, args, out: calls.append(args[0].shape[1]))
        model(text[:, 5:], state)
        hook.remove()
    assert calls == [1]


def test_lost_cache_is_rebuilt_with_the_same_result():
    model = small_model()
    text = tokens(1, 9, 14)
    with torch.no_grad():
        _, state = model(text[:, :6], model.init_state(1))
        with_cache, _ = model(text[:, 6:], state)
        without, _ = model(text[:, 6:], state._without_cache())
    assert (with_cache - without).abs().max().item() < 1e-5


def test_batched_rows_of_different_lengths_match_single_rows():
    model = small_model()
    a, b = tokens(1, 4, 15), tokens(1, 2 * L, 16)
    step = tokens(2, 3, 17)
    with torch.no_grad():
        _, state_a = model(a, model.init_state(1))
        _, state_b = model(b, model.init_state(1))
        single_a, next_a = model(step[:1], state_a)
        single_b, next_b = model(step[1:], state_b)
        batched, next_batch = model(step, ByteWindow.concat([state_a, state_b]))
    assert (batched[0] - single_a[0]).abs().max().item() < 1e-5
    assert (batched[1] - single_b[0]).abs().max().item() < 1e-5
    split_a, split_b = next_batch.split()
    assert torch.equal(split_a.tokens, next_a.tokens) and torch.equal(split_b.tokens, next_b.tokens)
    assert split_a.fully_cached and split_b.cache_length == 0  # a has not slid, b has
    model.check_state(split_a)
    model.check_state(split_b)


def test_batched_rows_that_have_not_slid_keep_decoding_incrementally():
    """The engine keeps a batch between steps: rows of different lengths keep their own caches,
    so each step still runs one position per row through the layers."""
    model = small_model()
    with torch.no_grad():
        _, state_a = model(tokens(1, 3, 20), model.init_state(1))
        _, state_b = model(tokens(1, 6, 21), model.init_state(1))
        batch = ByteWindow.concat([state_a, state_b])
        assert batch.cached.all() and batch.cache_length == 6
        seen = []
        hook = model.layers[0].register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape[:2])))
        step = tokens(2, 1, 22)
        out, batch = model(step, batch)
        out2, batch = model(step, batch)
        hook.remove()
        a, b = batch.split()
        single_a, _ = model(torch.cat([tokens(1, 3, 20), step[:1], step[:1]], 1), model.init_state(1))
    assert seen == [(1, 1)] * 4  # two steps x two rows, one position each
    assert a.fully_cached and a.length == 5 and b.length == 8
    assert (out2[0, -1] - single_a[0, -1]).abs().max().item() < 1e-5


def test_state_round_trips_through_flat_tensors():
    model = small_model()
    _, state = model(tokens(1, 7, 18), model.init_state(1))
    restored = ByteWindow.from_tensors(state.to_tensors())
    model.check_state(restored)
    assert torch.equal(restored.tokens, state.tokens) and restored.fully_cached
    with pytest.raises(ValueError, match="missing"):
        ByteWindow.from_tensors({k: v for k, v in state.to_tensors().items() if k != "tokens"})
    too_long = state.to_tensors()
    too_long["tokens"] = torch.zeros(1, L + 1, dtype=torch.long)
    too_long["valid"] = torch.ones(1, L + 1, dtype=torch.bool)
    too_long.update({k: v[:, :0] for k, v in too_long.items() if k.startswith(("keys", "values"))})
    with pytest.raises(ValueError, match="context_len"):
        model.check_state(ByteWindow.from_tensors(too_long))
    bad_ids = state.to_tensors()
    bad_ids["tokens"] = bad_ids["tokens"] + 300
    with pytest.raises(ValueError, match="ids outside"):
        model.check_state(ByteWindow.from_tensors(bad_ids))
    wrong = state.to_tensors()
    wrong["keys.0"] = torch.zeros(1, 7, 3, 16)
    with pytest.raises(ValueError, match="keys.0"):
        model.check_state(ByteWindow.from_tensors(wrong))


def test_save_and_load_give_identical_log_probs(tmp_path):
    model = small_model()
    save_checkpoint(model, tmp_path / "vanilla")
    loaded = load_checkpoint(tmp_path / "vanilla")
    text = tokens(1, L + 4, 19)
    with torch.no_grad():
        a, _ = model(text, model.init_state(1))
        b, _ = loaded(text, loaded.init_state(1))
    assert torch.equal(a, b)
    assert loaded.max_context == L and loaded.state_kind == "window"


def test_strided_window_evaluation_at_stride_one_is_the_sliding_evaluation():
    from xlserve.models.training.evaluate import document_nll, windowed_document_nll

    model = small_model()
    data = bytes(tokens(1, 3 * L + 5, 11)[0].tolist())
    sliding, count = document_nll(model, data, chunk_len=7)
    for stride in (1, 5, L):
        windowed, windowed_count = windowed_document_nll(model, data, stride)
        assert windowed_count == count
        if stride == 1:
            assert abs(windowed - sliding) < 1e-3
    for short in (data[:1], data[:2], data[: L + 1]):  # documents within one window
        assert abs(windowed_document_nll(model, short, 4)[0] - document_nll(model, short, 7)[0]) < 1e-3
