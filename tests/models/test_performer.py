"""The Performer (Choromanski et al. 2021): FAVOR+ causal attention by prefix sums, its constant
state, and everything the server does with that state."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import pytest
import torch

from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models.performer import (
    KernelSums, Performer, PerformerConfig, causal_favor_attention, favor_features, key_features,
    orthogonal_random_matrix, query_features,
)
from xlserve.models.registry import build_model
from xlserve.models.training.presets import preset_config
from xlserve.models.training.train import STANDARD_RECIPE, train
from xlserve.models.training.train import training_loss as standard_training_loss
from tests.models.helpers import assert_state_round_trips, run_in_chunks, tokens


def small_model(seed: int = 0, **overrides) -> Performer:
    torch.manual_seed(seed)
    config = PerformerConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, n_features=24,
                             conv_width=3, **overrides)
    return Performer(config).eval()


def tiny_model(seed: int = 0) -> Performer:
    torch.manual_seed(seed)
    return build_model("performer", preset_config("performer", "tiny")).eval()


# -- the feature map ------------------------------------------------------------------------------


def test_random_features_are_orthogonal_in_blocks_with_gaussian_lengths():
    w = orthogonal_random_matrix(40, 16, torch.Generator().manual_seed(3))
    assert w.shape == (40, 16)
    for start in (0, 16):  # two full blocks of exactly orthogonal rows
        block = w[start : start + 16]
        gram = block @ block.T
        assert (gram - torch.diag(torch.diagonal(gram))).abs().max() < 1e-4
    assert w[32:].shape == (8, 16)  # the last, partial block
    lengths = w.norm(dim=1)
    assert 2.5 < lengths.mean() < 5.5  # chi(16) has mean ~3.94


def test_features_estimate_the_softmax_kernel():
    """E[phi(x)ᵀphi(y)] = exp(xᵀy): with many features the estimate is close."""
    g = torch.Generator().manual_seed(4)
    x, y = 0.3 * torch.randn(5, 8, generator=g), 0.3 * torch.randn(7, 8, generator=g)
    w = orthogonal_random_matrix(8192, 8, g)
    estimate = favor_features(x, w) @ favor_features(y, w).T
    assert ((estimate - torch.exp(x @ y.T)).abs() / torch.exp(x @ y.T)).max() < 0.05


def test_stable_factors_are_the_paper_features_up_to_a_per_query_constant():
    """query_features(q)ᵀ key_features(k) = c(q) · phi(q)ᵀphi(k) with c depending on q only, and
    both factors are in [0, 1]."""
    g = torch.Generator().manual_seed(5)
    w = orthogonal_random_matrix(12, 6, g)
    q, k = torch.randn(4, 6, generator=g), torch.randn(9, 6, generator=g)
    stable = query_features(q, w) @ key_features(k, w).T  # (4, 9)
    paper = favor_features(q, w) @ favor_features(k, w).T
    ratio = stable / paper
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-4)
    for factor in (query_features(q, w), key_features(k, w)):
        assert factor.min() >= 0 and factor.max() <= 1
    assert torch.allclose(query_features(q, w).amax(-1), torch.ones(4))


# -- (a) the attention pattern against the brute-force T × T kernel attention --------------------


def brute_force_attention(q, k, v, w):
    """The paper's definition written out: A[i, j] = phi(q_i)ᵀphi(k_j) for j <= i, 0 after,
    each row divided by its sum, times V. q, k (B, H, T, D) already scaled by D^-¼."""
    T = q.shape[2]
    w = w.double()
    A = favor_features(q.double(), w) @ favor_features(k.double(), w).transpose(-1, -2)  # (B, H, T, T)
    A = A * torch.ones(T, T, dtype=torch.bool).tril()
    return (A / A.sum(-1, keepdim=True)) @ v.double()


@pytest.mark.parametrize("block", [1, 5, 64])
def test_prefix_sum_attention_is_the_masked_kernel_attention(block):
    g = torch.Generator().manual_seed(6)
    B, H, T, D, m = 2, 3, 70, 8, 20
    q, k, v = (torch.randn(B, H, T, D, generator=g) * 0.7 for _ in range(3))
    w = orthogonal_random_matrix(m, D, g)
    S, z = torch.zeros(B, H, m, D), torch.zeros(B, H, m)
    out, S_after, z_after = causal_favor_attention(query_features(q, w), key_features(k, w), v, S, z, block=block)
    expected = brute_force_attention(q, k, v, w)
    assert (out.double() - expected).abs().max() < 1e-5
    # the sums after the call are S_T and z_T of the paper
    phi_k = key_features(k, w)
    assert torch.allclose(S_after, phi_k.transpose(-1, -2) @ v, atol=1e-4)
    assert torch.allclose(z_after, phi_k.sum(2), atol=1e-4)


def test_prefix_sums_carried_between_calls_give_the_same_attention():
    g = torch.Generator().manual_seed(7)
    B, H, T, D, m = 1, 2, 50, 8, 16
    q, k, v = (torch.randn(B, H, T, D, generator=g) * 0.7 for _ in range(3))
    w = orthogonal_random_matrix(m, D, g)
    qf, kf = query_features(q, w), key_features(k, w)
    S, z = torch.zeros(B, H, m, D), torch.zeros(B, H, m)
    pieces = []
    for start, stop in [(0, 13), (13, 14), (14, 50)]:
        out, S, z = causal_favor_attention(qf[:, :, start:stop], kf[:, :, start:stop], v[:, :, start:stop], S, z)
        pieces.append(out)
    assert (torch.cat(pieces, 2).double() - brute_force_attention(q, k, v, w)).abs().max() < 1e-5


def test_a_layer_attends_with_the_brute_force_pattern():
    """A whole layer computed by hand with the explicit masked kernel matrix: the same output."""
    model = small_model()
    layer, c = model.layers[0], model.config
    x = torch.randn(2, 40, c.d_model, generator=torch.Generator().manual_seed(8))
    state = model.init_state(2)
    with torch.no_grad():
        out, _, _, _ = layer(x, state.value_sums[0], state.key_sums[0], state.recent_inputs[0])
        h = layer.attn_norm(x)
        padded = torch.cat([h.new_zeros(2, c.conv_width - 1, c.d_model), h], dim=1)
        mixed = torch.stack([(padded[:, t : t + c.conv_width] * layer.conv_weight.T).sum(1) for t in range(40)], 1)
        mixed = mixed + layer.conv_bias
        q, k, v = layer.qkv_net(mixed).view(2, 40, 3, c.n_head, c.d_head).permute(2, 0, 3, 1, 4)
        scale = c.d_head ** -0.25
        attended = brute_force_attention(q * scale, k * scale, v, layer.features).float()
        y = x + layer.o_net(attended.transpose(1, 2).reshape(2, 40, -1))
        y = y + layer.ff(layer.ff_norm(y))
    assert (out - y).abs().max() < 1e-5


def test_no_overflow_or_underflow_where_the_paper_features_fail_in_float32():
    """A long feature row (|w|²/2 > 88) makes the paper's phi(k) overflow for a key near it, and a
    long query makes every phi(q) underflow: float32 FAVOR+ from the paper's phi gives inf/NaN.
    The split factors stay finite and give the float64 brute-force answer. A query whose keys
    all underflow outputs 0, not NaN."""
    g = torch.Generator().manual_seed(9)
    B, H, T, D, m = 1, 1, 30, 8, 16
    w = orthogonal_random_matrix(m, D, g)
    w[0] = w[0] / w[0].norm() * 15.0  # |w_0|²/2 = 112.5
    q = torch.randn(B, H, T, D, generator=g) + 20 * w[1] / w[1].norm()  # |q|²/2 ~ 200
    k = torch.randn(B, H, T, D, generator=g) * 0.5 + w[0]
    v = torch.randn(B, H, T, D, generator=g)
    assert not torch.isfinite(favor_features(k, w)).all()  # the paper's key features overflow
    assert (favor_features(q, w) == 0).all()  # and every query feature underflows
    out, S, z = causal_favor_attention(query_features(q, w), key_features(k, w), v,
                                       torch.zeros(B, H, m, D), torch.zeros(B, H, m))
    assert torch.isfinite(out).all() and torch.isfinite(S).all() and torch.isfinite(z).all()
    assert (out.double() - brute_force_attention(q, k, v, w)).abs().max() < 1e-4
    far = torch.full((B, H, 3, D), 1e3)  # every key feature underflows to 0
    out, _, _ = causal_favor_attention(query_features(far, w), key_features(far, w), v[:, :, :3],
                                       torch.zeros(B, H, m, D), torch.zeros(B, H, m))
    assert torch.equal(out, torch.zeros_like(out))


# -- (b) chunking ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_any_chunking_gives_the_log_probs_of_one_pass(chunk):
    model = small_model()
    text = tokens(2, 150, 11)  # longer than a block (64) of the attention
    whole, whole_state = run_in_chunks(model, text, 150)
    served, state = run_in_chunks(model, text, chunk)
    assert (served - whole).abs().max() < 1e-5
    assert int(state.position[0]) == 150
    for a, b in zip(state.value_sums + state.key_sums, whole_state.value_sums + whole_state.key_sums):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(state.recent_inputs, whole_state.recent_inputs):
        assert torch.allclose(a, b, atol=1e-6)


def test_one_token_step_costs_the_same_after_a_long_history():
    """Decoding is incremental: a step runs one position through each layer, whatever came before."""
    model = small_model()
    _, state = run_in_chunks(model, tokens(1, 300, 12), 300)
    widths = []
    hook = model.layers[0].register_forward_hook(lambda m, args, out: widths.append(args[0].shape[1]))
    with torch.no_grad():
        model(tokens(1, 1, 13), state)
    hook.remove()
    assert widths == [1]


# -- (c) batching ---------------------------------------------------------------------------------


def test_rows_with_different_histories_decode_together():
    model = small_model()
    short, long = tokens(1, 9, 14), tokens(1, 120, 15)
    _, short_state = run_in_chunks(model, short, 9)
    _, long_state = run_in_chunks(model, long, 50)
    step = tokens(2, 5, 16)
    batch = KernelSums.concat([short_state, long_state])
    together, batch_after = run_in_chunks(model, step, 2, state=batch)
    alone_short, short_after = run_in_chunks(model, step[:1], 2, state=short_state)
    alone_long, long_after = run_in_chunks(model, step[1:], 2, state=long_state)
    assert (together - torch.cat([alone_short, alone_long])).abs().max() < 1e-5
    rows = batch_after.split()
    assert [int(r.position[0]) for r in rows] == [14, 125]
    for row, alone in zip(rows, [short_after, long_after]):
        for (name, a), (_, b) in zip(row.to_tensors().items(), alone.to_tensors().items()):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
    # take and put_row give the same rows
    taken = batch_after.take([1, 0])
    assert torch.equal(taken.value_sums[0][0], batch_after.value_sums[0][1])
    with torch.no_grad():
        target = batch_after.clone()
        assert target.put_row(0, rows[1])
    assert torch.equal(target.key_sums[1][0], rows[1].key_sums[1][0])
    assert int(target.position[0]) == 125 and int(target.position[1]) == 125


def test_state_bytes_do_not_depend_on_the_row_in_a_batch():
    model = small_model()
    one = model.init_state(1)
    _, after = run_in_chunks(model, tokens(1, 33, 17), 33)
    assert after.nbytes() == one.nbytes()
    assert KernelSums.concat([one, after]).nbytes() == 2 * one.nbytes()


# -- (d) the state through safetensors ------------------------------------------------------------


def test_state_round_trips_through_safetensors_bit_identically(tmp_path):
    model = small_model()
    _, state = run_in_chunks(model, tokens(1, 77, 18), 30)
    assert isinstance(state, KernelSums)
    assert set(state.to_tensors()) == {"value_sums.0", "value_sums.1", "key_sums.0", "key_sums.1",
                                       "recent_inputs.0", "recent_inputs.1", "position"}
    assert_state_round_trips(model, state, 77, tokens(1, 4, 19), tmp_path)


# -- (e) constant state ---------------------------------------------------------------------------


def test_state_bytes_equal_after_1k_10k_and_100k_tokens():
    model = tiny_model()
    c = model.config
    expected = c.n_layer * (4 * c.n_head * c.n_features * c.d_head + 4 * c.n_head * c.n_features
                            + 4 * (c.conv_width - 1) * c.d_model) + 8
    state, fed, sizes = model.init_state(1), 0, {}
    assert state.nbytes() == expected
    with torch.no_grad():
        for mark in (1_000, 10_000, 100_000):
            while fed < mark:
                n = min(4096, mark - fed)
                _, state = model(tokens(1, n, fed), state)
                fed += n
            sizes[mark] = (state.nbytes(), [tuple(t.shape) for t in state.to_tensors().values()])
            model.check_state(state, mark)  # finite sums, z within [0, tokens]
    assert sizes[1_000] == sizes[10_000] == sizes[100_000]
    assert sizes[1_000][0] == expected
    assert int(state.position[0]) == 100_000


# -- (f) checkpoints ------------------------------------------------------------------------------


def test_checkpoint_keeps_the_random_features_and_the_logits(tmp_path):
    model = small_model(seed=0)
    assert "layers.0.features" in model.state_dict()
    assert "layers.0.features" not in dict(model.named_parameters())  # never trained
    save_checkpoint(model, tmp_path / "ckpt")
    other_seed = small_model(seed=1)
    assert not torch.equal(other_seed.layers[0].features, model.layers[0].features)
    loaded = load_checkpoint(tmp_path / "ckpt")
    for i in range(model.config.n_layer):
        assert torch.equal(loaded.layers[i].features, model.layers[i].features)
    text = tokens(2, 40, 20)
    with torch.no_grad():
        assert torch.equal(model(text, model.init_state(2))[0], loaded(text, loaded.init_state(2))[0])


# -- (g) checking states from outside -------------------------------------------------------------


def session(model, length, seed=21):
    ids = tokens(1, length, seed)
    with torch.no_grad():
        log_probs, state = model(ids, model.init_state(1))
    return state, length, log_probs[0, -1]


def with_tensor(state, name, change):
    tensors = {key: value.clone() for key, value in state.to_tensors().items()}
    tensors[name] = change(tensors[name])
    return KernelSums.from_tensors(tensors)


def test_real_states_pass_the_checks():
    model = small_model()
    model.check_session(model.init_state(1), 0, None)
    for length in (1, 2, 50):
        model.check_session(*session(model, length))
    batch = KernelSums.concat([session(model, 1)[0], session(model, 30)[0]])
    with torch.no_grad():
        log_probs, stepped = model(tokens(2, 1, 22), batch)
    for row, seen, next_row in zip(stepped.split(), (2, 31), log_probs[:, -1]):
        model.check_session(row, seen, next_row)


def set_first(value):
    def change(tensor):
        tensor.view(-1)[0] = value
        return tensor
    return change


@pytest.mark.parametrize("name, change, message", [
    ("value_sums.1", set_first(float("nan")), "'value_sums.1' holds NaN"),
    ("key_sums.0", set_first(float("inf")), "'key_sums.0' holds NaN"),
    ("recent_inputs.0", set_first(float("nan")), "'recent_inputs.0' holds NaN"),
    ("key_sums.0", lambda t: t[:, :, :-1], "'key_sums.0' has shape"),
    ("value_sums.0", lambda t: t[:, :1], "'value_sums.0' has shape"),
    ("key_sums.1", set_first(-1.0), "'key_sums.1' holds values outside"),
    ("key_sums.1", set_first(1e6), "'key_sums.1' holds values outside"),
    ("position", lambda t: t + 1, "'position' says 51 tokens, the session has seen 50"),
    ("value_sums.0", lambda t: t.double(), "'value_sums.0' is torch.float64"),
])
def test_poisoned_states_are_refused(name, change, message):
    model = small_model()
    state, seen, next_row = session(model, 50)
    with pytest.raises(ValueError, match=message):
        model.check_session(with_tensor(state, name, change), seen, next_row)


def test_a_fresh_state_must_be_empty():
    model = small_model()
    fresh = model.init_state(1)
    with pytest.raises(ValueError, match="'value_sums.0' is not 0 before the first token"):
        model.check_state(with_tensor(fresh, "value_sums.0", set_first(0.5)), 0)
    one, _, _ = session(model, 1)
    with pytest.raises(ValueError, match="'recent_inputs.1' holds inputs before the first of 1 tokens"):
        model.check_state(with_tensor(one, "recent_inputs.1", set_first(0.5)), 1)
    layer_less = dataclasses.replace(one, key_sums=one.key_sums[:1])
    with pytest.raises(ValueError):
        model.check_state(layer_less)


# -- training -------------------------------------------------------------------------------------


def test_training_loss_trains_and_the_features_stay_fixed():
    model = small_model().train()
    features = [layer.features.clone() for layer in model.layers]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    inputs = tokens(4, 32, 23) % 8
    targets = torch.roll(inputs, -1, dims=1)
    first = None
    state = model.init_state(4)
    for step in range(30):
        loss, state = standard_training_loss(model, inputs, targets, model.init_state(4), step / 30)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.7 * first
    assert all(torch.equal(a, layer.features) for a, layer in zip(features, model.layers))


def test_standard_training_loop_runs_three_steps(tmp_path):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 3, batch_size=4, segment_len=32,
                     eval_every=1000, save_every=2, quick_eval_bytes=1000, warmup_steps=1)
    model = train("performer", "tiny", tmp_path / "out", recipe, log=lambda s: None)
    loaded = load_checkpoint(tmp_path / "out")
    text = tokens(1, 20, 24)
    with torch.no_grad():
        assert torch.equal(model.eval()(text, model.init_state(1))[0], loaded(text, loaded.init_state(1))[0])
    assert math.isfinite(float(loaded.layers[0].features.sum()))
