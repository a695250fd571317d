"""RWKV-4 (Peng et al. 2023): the chunked WKV against the paper's sums, and the state invariants
every architecture keeps. Parity with transformers: tests/models/test_convert_recurrent.py."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tests.models.helpers import (
    assert_rows_batch_like_single_rows, assert_same_as_one_pass, assert_state_round_trips,
    state_bytes_after_4_kb_and_64_kb, tokens,
)
from xlserve.models.rwkv import EMPTY_EXPONENT, Rwkv, RwkvConfig, wkv


def small_model(seed: int = 0, **overrides) -> Rwkv:
    torch.manual_seed(seed)
    return Rwkv(RwkvConfig(n_layer=3, d_model=32, d_attention=24, d_ffn=64, rescale_every=2, **overrides)).eval()


def test_wkv_is_the_papers_weighted_average():
    """wkv_t = (Σ_{s<t} e^{−(t−1−s)w + k_s} v_s + e^{u+k_t} v_t) / (the same without v), in
    float64 straight from the definition; keys large enough that the plain sums would overflow
    float32 are handled by the carried exponent."""
    g = torch.Generator().manual_seed(0)
    T, A = 75, 6
    k, v = torch.randn(2, T, A, generator=g) * 40, torch.randn(2, T, A, generator=g)
    w, u = torch.rand(A, generator=g) * 2, torch.randn(A, generator=g)
    empty = torch.zeros(2, A)
    out, num, den, mx = wkv(w, u, k, v, empty, empty, torch.full((2, A), EMPTY_EXPONENT))
    k64, v64, w64, u64 = k.double(), v.double(), w.double(), u.double()
    expected = []
    for t in range(T):
        s = torch.arange(t, dtype=torch.float64)
        exponents = torch.cat([k64[:, :t] - (t - 1 - s)[None, :, None] * w64, (u64 + k64[:, t])[:, None]], dim=1)
        weights = torch.exp(exponents - exponents.amax(dim=1, keepdim=True))
        expected.append((weights * v64[:, : t + 1]).sum(1) / weights.sum(1))
    assert torch.isfinite(out).all()
    assert (out.double() - torch.stack(expected, 1)).abs().max() < 1e-4


@pytest.mark.parametrize("chunk", [1, 7, 32, 45])
def test_chunked_feeding_equals_one_pass(chunk):
    assert_same_as_one_pass(small_model(), tokens(2, 90, 3), chunk, atol=1e-4)


def test_rows_of_different_histories_batch_like_single_rows():
    model = small_model(1)
    histories = [tokens(1, n, 10 + n) for n in (1, 7, 40)]
    assert_rows_batch_like_single_rows(model, histories, tokens(3, 5, 4), tokens(3, 4, 5), atol=1e-4)


def test_state_round_trips_through_safetensors(tmp_path):
    model = small_model(2)
    _, state = model(tokens(1, 30, 6), model.init_state(1))
    assert_state_round_trips(model, state, 30, tokens(1, 9, 7), tmp_path)


def test_state_is_constant_from_4_kb_to_64_kb():
    torch.manual_seed(8)
    model = Rwkv(RwkvConfig(n_layer=1, d_model=16, d_attention=16, d_ffn=32)).eval()  # narrow: 64 KB of bytes cost little
    small, large, _ = state_bytes_after_4_kb_and_64_kb(model, seed=8)
    c = model.config
    assert small == large == c.n_layer * (2 * c.d_model * 4 + 3 * c.d_attention * 4) + 8
    assert model.full_state_bytes() == large


def test_states_the_model_could_not_have_made_are_refused():
    model = small_model(3)
    _, state = model(tokens(1, 5, 9), model.init_state(1))
    negative = replace(state, denominator=[state.denominator[0].neg(), *state.denominator[1:]])
    with pytest.raises(ValueError, match="'denominator.0' holds negative values"):
        model.check_state(negative, 5)
    with pytest.raises(ValueError, match="'numerator.2' holds NaN"):
        model.check_state(replace(state, numerator=[*state.numerator[:2], state.numerator[2].clone().fill_(math.nan)]), 5)
    fresh = model.init_state(1)
    with pytest.raises(ValueError, match="'attn_shift.0' is not 0 before the first token"):
        model.check_state(replace(fresh, attn_shift=[fresh.attn_shift[0] + 1, *fresh.attn_shift[1:]]), 0)
