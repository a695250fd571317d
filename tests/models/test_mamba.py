"""Mamba (Gu and Dao 2023): the chunked selective scan against the recurrence, and the state
invariants every architecture keeps. Parity with transformers: tests/models/test_convert_recurrent.py."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tests.models.helpers import (
    assert_rows_batch_like_single_rows, assert_same_as_one_pass, assert_state_round_trips,
    state_bytes_after_4_kb_and_64_kb, tokens,
)
from xlserve.models.checkpoint import load_checkpoint
from xlserve.models.mamba import SCAN_EXPONENT_LIMIT, Mamba, MambaConfig, selective_scan
from xlserve.models.training.presets import preset_config
from xlserve.models.training.train import STANDARD_RECIPE, train


def small_model(seed: int = 0, **overrides) -> Mamba:
    torch.manual_seed(seed)
    config = MambaConfig(n_layer=2, d_model=32, d_inner=64, d_state=8, d_conv=4, dt_rank=4, chunk_size=16, **overrides)
    return Mamba(config).eval()


def recurrence(u, dt, A, B, C, h):
    """The paper's recurrence, one position at a time."""
    outputs = []
    for t in range(u.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        outputs.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(outputs, dim=1), h


@pytest.mark.parametrize("decay_scale", [0.1, 20.0])
def test_the_chunked_scan_is_the_recurrence(decay_scale):
    """Two cumulative sums per chunk give the recurrence's outputs and state; with decays large
    enough that a chunk's exponent passes SCAN_EXPONENT_LIMIT, the split keeps them finite and exact."""
    g = torch.Generator().manual_seed(0)
    u, dt = torch.randn(2, 70, 6, generator=g), torch.rand(2, 70, 6, generator=g) * decay_scale
    A, B, C = -torch.rand(6, 5, generator=g) * 4, torch.randn(2, 70, 5, generator=g), torch.randn(2, 70, 5, generator=g)
    h = torch.randn(2, 6, 5, generator=g)
    if decay_scale > 1:
        assert float((dt[:, :32, :, None] * A).sum(1).min()) < -SCAN_EXPONENT_LIMIT  # the split is exercised
    y, after = selective_scan(u, dt, A, B, C, h, chunk_size=32)
    expected, expected_after = recurrence(u, dt, A, B, C, h)
    assert torch.isfinite(y).all()
    assert (y - expected).abs().max() < 1e-4 and (after - expected_after).abs().max() < 1e-5


def test_the_scan_s_gradients_stay_finite_when_a_chunk_decays_near_the_limit():
    """Training went NaN at step ~350 of mamba-stdlib: a chunk whose decay reached |P| ≈ 59 (under
    SCAN_EXPONENT_LIMIT, so not split) had a quotient whose gradient holds 1 / exp(P)², past
    float32's range. The gradients must be finite and equal the recurrence's."""
    g = torch.Generator().manual_seed(0)
    u, dt = torch.randn(2, 32, 8, generator=g), torch.rand(2, 32, 8, generator=g) * 3.2 + 0.05
    A = -(torch.rand(8, 4, generator=g) + 0.05)
    A[0, 0] = -1.0
    B, C = torch.randn(2, 32, 4, generator=g), torch.randn(2, 32, 4, generator=g)
    h = torch.zeros(2, 8, 4)
    exponent = float((dt.sum(1) * A.amin(1)).min())
    assert -SCAN_EXPONENT_LIMIT < exponent < -44  # one piece, past where exp(P)² underflows
    grads = []
    for scan in (lambda *a: selective_scan(*a, chunk_size=32), recurrence):
        inputs = [t.clone().requires_grad_(True) for t in (u, dt, A, B, C)]
        y, after = scan(*inputs, h)
        (y.sum() + after.sum()).backward()
        grads.append([t.grad for t in inputs])
    for ours, expected in zip(*grads):
        assert torch.isfinite(ours).all()
        assert torch.allclose(ours, expected, rtol=1e-3, atol=1e-3)


def test_the_kept_decay_rates_follow_the_weights():
    """A = −exp(A_log) is kept between calls outside autograd: an in-place change of A_log (an
    optimiser step, a load) and a new tensor (load_state_dict with assign) must both be seen, and
    with autograd on it is computed in the graph."""
    mixer = small_model(3).layers[0].mixer
    with torch.no_grad():
        kept = mixer.decay_rates()
        assert mixer.decay_rates() is kept and torch.equal(kept, -torch.exp(mixer.A_log))
        mixer.A_log.add_(2.0)
        assert torch.equal(mixer.decay_rates(), -torch.exp(mixer.A_log))
        fresh = {name: value.clone() - 1.0 if name == "A_log" else value for name, value in mixer.state_dict().items()}
        mixer.load_state_dict(fresh, assign=True)
        assert torch.equal(mixer.decay_rates(), -torch.exp(fresh["A_log"]))
    with_graph = mixer.decay_rates()
    assert with_graph.requires_grad and with_graph is not mixer.decay_rates()
    with torch.inference_mode():  # weights made here (as a load may make them) have no version counter
        mixer.A_log = torch.nn.Parameter(torch.zeros_like(mixer.A_log), requires_grad=False)
        assert mixer.A_log.is_inference() and torch.equal(mixer.decay_rates(), -torch.ones_like(mixer.A_log))


@pytest.mark.parametrize("chunk", [1, 5, 16, 37])
def test_chunked_feeding_equals_one_pass(chunk):
    assert_same_as_one_pass(small_model(), tokens(2, 90, 3), chunk)


def test_rows_of_different_histories_batch_like_single_rows():
    model = small_model(1)
    histories = [tokens(1, n, 10 + n) for n in (1, 7, 40)]
    assert_rows_batch_like_single_rows(model, histories, tokens(3, 5, 4), tokens(3, 4, 5))


def test_state_round_trips_through_safetensors(tmp_path):
    model = small_model(2)
    _, state = model(tokens(1, 30, 6), model.init_state(1))
    assert_state_round_trips(model, state, 30, tokens(1, 9, 7), tmp_path)


def test_state_is_constant_from_4_kb_to_64_kb():
    torch.manual_seed(8)
    model = Mamba(MambaConfig(n_layer=1, d_model=16, d_inner=32, d_state=4, dt_rank=2, chunk_size=64)).eval()  # narrow: 64 KB of bytes cost little
    small, large, state = state_bytes_after_4_kb_and_64_kb(model, seed=8)
    c = model.config
    assert small == large == c.n_layer * ((c.d_conv - 1) * c.d_inner * 4 + c.d_inner * c.d_state * 4) + 8
    assert model.full_state_bytes() == large


def test_states_the_model_could_not_have_made_are_refused():
    model = small_model(3)
    _, state = model(tokens(1, 2, 9), model.init_state(1))
    nan = replace(state, ssm=[state.ssm[0].clone().fill_(math.nan), state.ssm[1]])
    with pytest.raises(ValueError, match="'ssm.0' holds NaN"):
        model.check_state(nan, 2)
    # after 2 tokens the first K − 1 − 2 = 1 convolution input is still the zero padding
    padded = replace(state, conv_inputs=[state.conv_inputs[0].clone().fill_(1.0), state.conv_inputs[1]])
    with pytest.raises(ValueError, match="'conv_inputs.0' holds inputs before the first"):
        model.check_state(padded, 2)
    with pytest.raises(ValueError, match="'ssm.0' has shape"):
        model.check_state(replace(state, ssm=[state.ssm[0][:, :3], state.ssm[1]]), 2)


def test_training_a_few_steps_with_the_standard_loop(tmp_path):
    """`xlserve train --arch mamba` runs (the tiny preset; mamba-stdlib's is "stdlib"), and the
    checkpoint it writes loads and computes what the trained model does."""
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 3, batch_size=4, segment_len=32,
                     eval_every=1000, save_every=2, quick_eval_bytes=1000, warmup_steps=1)
    model = train("mamba", "tiny", tmp_path / "out", recipe, log=lambda s: None)
    loaded = load_checkpoint(tmp_path / "out")
    text = tokens(1, 20, 24)
    with torch.no_grad():
        assert torch.equal(model.eval()(text, model.init_state(1))[0], loaded(text, loaded.init_state(1))[0])
    assert preset_config("mamba", "stdlib") == preset_config("mamba", "small")


@pytest.mark.parametrize("architecture", ["mamba", "mamba2"])
def test_a_16_bit_model_keeps_its_residual_stream_in_float32(architecture):
    """Served in bfloat16 (a GPU's `--dtype`), a Mamba keeps the sum of its blocks' outputs in
    float32, as mamba_ssm and transformers do for the published checkpoints (residual_in_fp32):
    each block's input is rounded, the stream over all layers is not. Its log-probabilities then
    stay close to the float32 model's."""
    from xlserve.models.registry import build_model

    torch.manual_seed(0)
    model = build_model(architecture, {**preset_config(architecture, "tiny"), "n_layer": 8}).eval()
    half = build_model(architecture, {**preset_config(architecture, "tiny"), "n_layer": 8}).eval()
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16)
    streams = []
    hooks = [block.register_forward_hook(lambda module, inputs, output: streams.append(output[0].dtype))
             for block in half.layers]
    tokens = torch.tensor([list(b"def main(argv):\n    return len(argv)\n")])
    with torch.inference_mode():
        full, _ = model(tokens, model.init_state(1))
        rounded, _ = half(tokens, half.init_state(1))
    for hook in hooks:
        hook.remove()
    assert streams == [torch.float32] * 8
    assert rounded.dtype == torch.float32 and (rounded.exp() - full.exp()).abs().max() < 0.02
