"""The Longformer (Beltagy et al. 2020): its dilated sliding-window + global attention pattern, the
chunking invariant, batching, the bounded ring-buffer state and its checks."""

from dataclasses import replace

import pytest
import torch

from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models.layers.ring_buffer import ring_positions
from xlserve.models.longformer import Longformer, LongformerConfig, SlidingWindowMemory
from xlserve.models.registry import build_model
from xlserve.models.training.presets import preset_config
from xlserve.models.training.train import STANDARD_RECIPE, train
from tests.models.helpers import (
    assert_rows_batch_like_single_rows, assert_same_as_one_pass, assert_state_round_trips,
    run_in_chunks, state_bytes_after_4_kb_and_64_kb, tokens,
)

WINDOWS = [4, 3, 5]
DILATIONS = [[1, 2, 3], [1, 1, 1], [2, 1, 4]]  # heads of different dilations, as the paper's char LM
G = 3


def small_model(**overrides) -> Longformer:
    torch.manual_seed(0)
    settings = dict(n_layer=3, d_model=32, n_head=3, d_head=8, d_inner=64, window=WINDOWS, dilation=DILATIONS,
                    n_global=G)
    config = LongformerConfig(**{**settings, **overrides})
    model = Longformer(config).eval()
    with torch.no_grad():  # biases large enough to matter in the log-probs
        for layer in model.layers:
            layer.attention.window_bias.normal_(std=1.0)
            if layer.attention.global_bias is not None:
                layer.attention.global_bias.normal_(std=1.0)
    return model


def reference_bias(attention, n: int) -> torch.Tensor:
    """(H, n, n) from the paper's definition, position by position: query i of head h (dilation
    d) sees i − k·d for k < w with bias r_h[k], and every j < g it does not already see in its
    window with bias s_h[j]; −inf elsewhere (the future, and the rest of the past)."""
    w = attention.window
    H = attention.dilation.shape[0]
    out = torch.full((H, n, n), float("-inf"))
    for h in range(H):
        d = int(attention.dilation[h])
        for i in range(n):
            for j in range(i + 1):
                if (i - j) % d == 0 and (i - j) // d < w:
                    out[h, i, j] = attention.window_bias[h, (i - j) // d]
                elif j < G:
                    out[h, i, j] = attention.global_bias[h, j]
    return out


def record_patterns(model, n: int) -> list:
    """Wrap every layer's `pattern` so that each call's bias lands in a dense (B, H, n, n) table
    at the absolute (query, key) positions; returns the tables, one per layer. Fails if a call
    shows a query the same key position twice (a global position also in the window counts once)."""
    tables = [None] * len(model.layers)
    for index, layer in enumerate(model.layers):
        def recording(query_positions, key_positions, key_valid, windowed, global_kind,
                      original=layer.attention.pattern, index=index):
            bias = original(query_positions, key_positions, key_valid, windowed, global_kind)  # (B, H, T, K)
            if tables[index] is None:
                tables[index] = torch.full((bias.shape[0], bias.shape[1], n, n), float("-inf"))
            for b in range(bias.shape[0]):
                for h in range(bias.shape[1]):
                    for t in range(bias.shape[2]):
                        visible = torch.isfinite(bias[b, h, t])
                        positions = key_positions[b][visible]
                        assert len(set(positions.tolist())) == len(positions), "a key position counted twice"
                        tables[index][b, h, query_positions[b, t], positions] = bias[b, h, t][visible]
            return bias

        layer.attention.pattern = recording
    return tables


# -- (a) the attention pattern ------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64, 80])
def test_pattern_is_the_papers_dilated_window_plus_global_positions(chunk):
    """Served from the ring buffer and the global store, in any chunking, every query sees
    exactly the positions of the definition, with its bias."""
    model = small_model()
    n = 80
    tables = record_patterns(model, n)
    run_in_chunks(model, tokens(2, n, 1), chunk)
    with torch.no_grad():
        for layer, dense in zip(model.layers, tables):
            expected = reference_bias(layer.attention, n)
            for row in dense:  # rows at one position share one pattern (one row of bias)
                assert torch.equal(row, expected)


def test_layer_output_is_dense_attention_under_the_reference_mask():
    """The first layer's attention output equals softmax(q kᵀ/√D + bias) v computed densely
    over the whole text with the reference mask, when served token by token from the state."""
    model = small_model()
    n = 40
    text = tokens(1, n, 2)
    attention = model.layers[0].attention
    outputs = []
    hook = attention.register_forward_hook(lambda m, args, out: outputs.append(out[0]))
    run_in_chunks(model, text, 1)
    hook.remove()
    served = torch.cat(outputs, dim=1)  # (1, n, d_model)
    with torch.no_grad():
        x = model.layers[0].attn_norm(model.embedding(text))
        q, k, v = attention.qkv_net(x).view(1, n, 3, 3, 8).permute(2, 0, 3, 1, 4)  # (1, H, n, D)
        scores = q @ k.transpose(-1, -2) / 8 ** 0.5 + reference_bias(attention, n)[None]
        dense = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, n, -1)
        expected = attention.o_net(dense)
    assert (served - expected).abs().max().item() < 1e-5


def test_without_global_positions_nothing_outside_the_window_is_seen():
    model = small_model(n_global=0)
    assert model.max_context == 1 + (4 - 1) * 3 + (3 - 1) * 1 + (5 - 1) * 4
    text = tokens(1, 60, 3)
    changed = text.clone()
    changed[0, 0] = (changed[0, 0] + 1) % 256  # beyond every query's receptive field from position 29 on
    a, _ = run_in_chunks(model, text, 60)
    b, _ = run_in_chunks(model, changed, 60)
    assert (a[:, model.max_context :] - b[:, model.max_context :]).abs().max().item() < 1e-6
    assert not torch.equal(a[:, 5], b[:, 5])


def test_global_positions_stay_visible_far_away():
    model = small_model()
    text = tokens(1, 200, 4)
    changed = text.clone()
    changed[0, 1] = (changed[0, 1] + 1) % 256  # a global position
    a, _ = run_in_chunks(model, text, 200)
    b, _ = run_in_chunks(model, changed, 200)
    assert (a[0, -1] - b[0, -1]).abs().max().item() > 1e-4


# -- (b) the chunking invariant -------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_any_chunking_gives_the_one_pass_log_probs(chunk):
    model = small_model()
    text = tokens(2, 300, 5)
    assert_same_as_one_pass(model, text, chunk)


def test_long_calls_run_in_pieces_with_the_same_result():
    model = small_model()
    text = tokens(1, 150, 6)
    whole, _ = run_in_chunks(model, text, 150)
    model.max_piece_positions = 16
    pieces, _ = run_in_chunks(model, text, 150)
    assert (pieces - whole).abs().max().item() < 1e-5


def test_a_decode_step_reads_only_the_ring_and_the_globals():
    model = small_model()
    with torch.no_grad():
        _, state = model(tokens(1, 500, 7), model.init_state(1))
        seen = []
        hook = model.layers[2].attention.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
        keys = []
        original = model.layers[2].attention.attend
        model.layers[2].attention.attend = lambda q, k, v, bias: keys.append(k.shape[2]) or original(q, k, v, bias)
        model(tokens(1, 1, 8), state)
        hook.remove()
    assert seen == [1] and keys == [G + 5 * 4 + 1]


# -- (c) batching ---------------------------------------------------------------------------------


def test_rows_of_different_histories_batch_like_single_rows():
    model = small_model()
    histories = [tokens(1, 0, 9), tokens(1, 2, 10), tokens(1, 41, 11), tokens(1, 333, 12)]
    step = tokens(4, 5, 13)
    batch_state, parts, _ = assert_rows_batch_like_single_rows(model, histories, step, step[:, :1])
    with torch.no_grad():
        taken = batch_state.take([3, 1])
        assert taken.position.tolist() == [batch_state.position[3].item(), batch_state.position[1].item()]
        assert batch_state.put_row(0, parts[2])
        assert torch.equal(batch_state.ring_keys[1][0], parts[2].ring_keys[1][0])
        assert batch_state.position[0] == parts[2].position[0]


# -- (d) the state round-trips -------------------------------------------------------------------


def test_state_round_trips_through_safetensors_bit_identically(tmp_path):
    model = small_model()
    with torch.no_grad():
        _, state = model(tokens(1, 77, 14), model.init_state(1))
    assert isinstance(state, SlidingWindowMemory)
    assert_state_round_trips(model, state, 77, tokens(1, 9, 15), tmp_path)


# -- (e) bounded state ----------------------------------------------------------------------------


def test_state_bytes_are_equal_after_4_kb_and_64_kb_of_history():
    torch.manual_seed(0)
    model = build_model("longformer", preset_config("longformer", "tiny")).eval()
    c = model.config
    at_4k, at_64k, _ = state_bytes_after_4_kb_and_64_kb(model, seed=16)
    formula = 8 + sum(2 * c.n_head * (C + c.n_global) * c.d_head * 4 for C in model.capacities)
    assert at_4k == at_64k == formula == model.init_state(1).nbytes()


def test_ring_positions_follow_the_slot_rule():
    seen = torch.tensor([0, 3, 5, 11])
    positions = ring_positions(seen, 5)
    assert positions.tolist() == [[-5, -4, -3, -2, -1], [0, 1, 2, -2, -1], [0, 1, 2, 3, 4], [10, 6, 7, 8, 9]]


# -- (f) checkpoints ------------------------------------------------------------------------------


def test_save_and_load_give_identical_log_probs(tmp_path):
    model = small_model()
    save_checkpoint(model, tmp_path / "longformer")
    loaded = load_checkpoint(tmp_path / "longformer")
    text = tokens(1, 60, 17)
    with torch.no_grad():
        a, _ = model(text, model.init_state(1))
        b, _ = loaded(text, loaded.init_state(1))
    assert torch.equal(a, b)
    assert loaded.state_kind == "window" and not loaded.state_grows_with_context and loaded.max_context is None
    assert loaded.capacities == [4 * 3, 3, 5 * 4]


# -- (g) checking states from outside -------------------------------------------------------------


def test_check_state_accepts_real_states_and_refuses_poisoned_ones():
    model = small_model()
    model.check_state(model.init_state(1), 0)
    with torch.no_grad():
        for n in (1, 2, 5, 300):
            model.check_state(model(tokens(1, n, 18), model.init_state(1))[1], n)
        _, state = model(tokens(1, 5, 19), model.init_state(1))

    def poisoned(change):
        tensors = {name: t.clone() for name, t in state.to_tensors().items()}  # to_tensors may share storage
        change(tensors)
        return SlidingWindowMemory.from_tensors(tensors)

    cases = [
        (lambda t: t["ring_keys.0"].view(-1).__setitem__(0, float("nan")), "ring_keys.0.*NaN"),
        (lambda t: t["global_values.2"].view(-1).__setitem__(0, float("inf")), "global_values.2.*NaN or infinite"),
        (lambda t: t.__setitem__("ring_values.1", torch.zeros(1, 3, 4, 8)), "ring_values.1"),
        (lambda t: t.__setitem__("ring_keys.2", t["ring_keys.2"][:, :, :7]), "ring_keys.2"),
        (lambda t: t.__setitem__("position", torch.tensor([-1])), "negative"),
        (lambda t: t["ring_keys.0"][0, 0, 11].fill_(1.0), "ring_keys.0.*no position has reached"),  # slot 11: empty after 5
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            model.check_state(poisoned(change), 5)
    with pytest.raises(ValueError, match="do not match"):
        model.check_state(poisoned(lambda t: t.pop("global_keys.2")), 5)
    model.check_state(poisoned(lambda t: t["global_values.1"][0, 2, 2].fill_(0.5)), 5)  # a written slot: plausible
    with pytest.raises(ValueError, match="position"):
        model.check_state(state, 6)  # the session says 6 tokens, the state 5
    with torch.no_grad():
        _, early = model(tokens(1, 2, 24), model.init_state(1))
    tensors = {name: t.clone() for name, t in early.to_tensors().items()}
    tensors["global_keys.0"][0, 0, 2] = 1.0  # global slot 2 after only 2 positions
    with pytest.raises(ValueError, match="global_keys.0.*no position has reached"):
        model.check_state(SlidingWindowMemory.from_tensors(tensors), 2)


# -- training -------------------------------------------------------------------------------------


def test_three_training_steps_with_the_standard_loop(tmp_path):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 3, batch_size=4, segment_len=32, eval_every=1000,
                     save_every=3, quick_eval_bytes=2000, warmup_steps=2)
    model = train("longformer", "tiny", tmp_path / "lf", recipe, log=lambda s: None)
    loaded = load_checkpoint(tmp_path / "lf")
    text = tokens(1, 50, 20)
    with torch.no_grad():
        assert torch.equal(model(text, model.init_state(1))[0], loaded(text, loaded.init_state(1))[0])


def test_gradients_reach_the_position_biases():
    model = small_model().train()
    inputs, targets = tokens(2, 20, 21), tokens(2, 20, 22)
    _, state = model(tokens(2, 30, 23), model.init_state(2))  # a carried state, as in training
    log_probs, _ = model(inputs, state)
    (-log_probs.gather(-1, targets[..., None]).mean()).backward()
    for layer in model.layers:
        assert layer.attention.window_bias.grad.abs().sum() > 0
        assert layer.attention.global_bias.grad.abs().sum() > 0
