"""Mamba-2 (Dao and Gu 2024): the chunked SSD form against the recurrence, and the state
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
from xlserve.models.mamba2 import Mamba2, Mamba2Config, ssd_scan


def small_model(seed: int = 0, **overrides) -> Mamba2:
    torch.manual_seed(seed)
    config = Mamba2Config(n_layer=2, d_model=32, n_head=4, head_dim=16, d_state=8, n_groups=2, chunk_size=16,
                          **overrides)
    return Mamba2(config).eval()


@pytest.mark.parametrize("decay_scale", [0.1, 30.0])
def test_the_chunked_ssd_form_is_the_recurrence(decay_scale):
    """Masked "attention" inside chunks plus the carried state gives the per-head recurrence,
    also when a chunk decays far past float32's exponent range (every exponent is ≤ 0)."""
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(2, 50, 3, 4, generator=g), torch.rand(2, 50, 3, generator=g) * decay_scale
    A, h = -torch.rand(3, generator=g) * 5, torch.randn(2, 3, 4, 5, generator=g)
    B, C = torch.randn(2, 50, 3, 5, generator=g), torch.randn(2, 50, 3, 5, generator=g)
    y, after = ssd_scan(x, dt, A, B, C, h, chunk_size=16)
    outputs, state = [], h
    for t in range(50):
        state = torch.exp(dt[:, t] * A)[..., None, None] * state + (x[:, t] * dt[:, t, :, None])[..., None] * B[:, t, :, None, :]
        outputs.append((state * C[:, t, :, None, :]).sum(-1))
    assert torch.isfinite(y).all()
    assert (y - torch.stack(outputs, 1)).abs().max() < 1e-4 and (after - state).abs().max() < 1e-5


@pytest.mark.parametrize("chunk", [1, 6, 16, 41])
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
    model = Mamba2(Mamba2Config(n_layer=1, d_model=16, n_head=2, head_dim=16, d_state=8, chunk_size=64)).eval()  # narrow: 64 KB of bytes cost little
    small, large, _ = state_bytes_after_4_kb_and_64_kb(model, seed=8)
    c = model.config
    assert small == large == c.n_layer * ((c.d_conv - 1) * c.conv_dim * 4 + c.n_head * c.head_dim * c.d_state * 4) + 8
    assert model.full_state_bytes() == large


def test_states_the_model_could_not_have_made_are_refused():
    model = small_model(3)
    _, state = model(tokens(1, 5, 9), model.init_state(1))
    with pytest.raises(ValueError, match="'ssm.1' holds NaN"):
        model.check_state(replace(state, ssm=[state.ssm[0], state.ssm[1].clone().fill_(math.nan)]), 5)
    with pytest.raises(ValueError, match="'position' says 5 tokens, the session has seen 6"):
        model.check_state(state, 6)
    with pytest.raises(ValueError, match="n_head 6 is not a multiple of n_groups 4"):
        Mamba2(Mamba2Config(n_head=6, n_groups=4))
