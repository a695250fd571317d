"""Adaptive attention span (models/adaptive_span.py): the soft span mask as the paper defines it,
chunking, batching, the per-head state and its size, checkpoints, state checks, training."""

import math
from dataclasses import replace

import pytest
import torch

from xlserve.models.adaptive_span import AdaptiveSpan, AdaptiveSpanConfig, SpanMemory
from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models.layers.relative import sinusoid_encoding
from xlserve.models.training.train import STANDARD_RECIPE, train
from tests.models.helpers import assert_state_round_trips, run_in_chunks, tokens

MAX_SPAN, RAMP = 20, 4
# spans set by hand (z per layer and head): short, fractional, zero and the maximum
SPANS = [[3.0, 12.5], [0.0, 20.0]]


def small_model(spans=SPANS, **overrides) -> AdaptiveSpan:
    torch.manual_seed(0)
    values = dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, max_span=MAX_SPAN, ramp=RAMP)
    config = AdaptiveSpanConfig(**{**values, **overrides})
    model = AdaptiveSpan(config)
    set_spans(model, spans)
    return model.eval()


def set_spans(model: AdaptiveSpan, spans) -> None:
    with torch.no_grad():
        for layer, row in zip(model.layers, spans):
            layer.span_fraction.copy_(torch.tensor(row) / model.config.max_span)


def kept(z: float) -> int:
    return math.ceil(z) + RAMP - 1


# -- (a) the attention pattern ---------------------------------------------------------------


def test_attention_weights_are_the_papers_ramp_renormalised():
    """Every weight a_tr equals m_z(t - r) exp(s_tr) / sum_q m_z(t - q) exp(s_tq), with m_z(x) =
    clamp((R + z - x) / R, 0, 1) and s Transformer-XL's relative score, computed pair by pair."""
    model = small_model()
    layer = model.layers[0]
    B, M, T, H, D = 2, 9, 30, 2, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, H, D, generator=g)
    keys = torch.randn(B, M + T, H, D, generator=g)
    u, v = torch.randn(H, D, generator=g), torch.randn(H, D, generator=g)
    seen = torch.tensor([4, 100])  # row 0 owns only its last 4 memory positions
    K = M + T
    index = torch.arange(K)
    distance = (M + torch.arange(T))[:, None] - index[None, :]
    visible = (index[None, None, :] >= (M - seen.clamp(max=M))[:, None, None]).expand(B, H, K)
    R = sinusoid_encoding(torch.arange(K), 32)
    with torch.no_grad():
        rel_keys = layer.r_net(R).view(K, H, D)
        weights = layer.attention_weights(q, keys, rel_keys, distance, visible, u, v)

    expected = torch.zeros(B, H, T, K, dtype=torch.float64)
    spans = [z for z in SPANS[0]]
    for b in range(B):
        for h in range(H):
            z = spans[h]
            for t in range(T):
                numerators = {}
                for r in range(K):
                    x = M + t - r
                    if x < 0 or not visible[b, h, r]:
                        continue
                    m = min(max((RAMP + z - x) / RAMP, 0.0), 1.0)
                    s = (q[b, t, h] + u[h]) @ keys[b, r, h] + (q[b, t, h] + v[h]) @ rel_keys[x, h]
                    numerators[r] = m * math.exp(float(s) / math.sqrt(D))
                total = sum(numerators.values())
                for r, value in numerators.items():
                    expected[b, h, t, r] = value / total
    assert (weights.double() - expected).abs().max().item() < 1e-6
    # head 0 (z = 3, R = 4) weighs distances 0 .. 6 (ceil(z) + R positions) and nothing further
    last = weights[1, 0, -1]
    assert last[K - 7 :].gt(0).all() and last[: K - 7].eq(0).all()


def test_a_token_beyond_every_span_changes_nothing():
    """One layer: a query sees ceil(z) + R positions (itself included) per head, so changing the
    token just beyond the longest head's reach changes nothing, and the one just inside does."""
    model = small_model(spans=[[3.0, 12.5]], n_layer=1)
    reach = max(kept(z) for z in [3.0, 12.5]) + 1  # 16 + 1 = 17 positions, the query included
    ids = tokens(1, 40, seed=5)
    with torch.no_grad():
        base, _ = model(ids, model.init_state(1))
        for offset, changes in ((reach, False), (reach - 1, True)):
            other = ids.clone()
            other[0, 39 - offset] = (other[0, 39 - offset] + 1) % 256
            out, _ = model(other, model.init_state(1))
            if changes:
                assert (out[0, 39] - base[0, 39]).abs().max().item() > 1e-6
            else:
                assert torch.equal(out[0, 39], base[0, 39])


# -- (b) chunking ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunks_give_one_pass(chunk):
    """The mask depends on distance only and the state keeps every reachable position, so any
    chunking of a history longer than max span + ramp gives the one pass's log-probs."""
    model = small_model()
    ids = tokens(2, 150, seed=1)
    whole, whole_state = run_in_chunks(model, ids, 150)
    chunked, chunked_state = run_in_chunks(model, ids, chunk)
    assert (whole - chunked).abs().max().item() < 1e-5
    for a, b in zip(whole_state.keys, chunked_state.keys):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-5
    assert torch.equal(whole_state.position, chunked_state.position)


def test_greedy_decoding_matches_a_full_forward():
    model = small_model()
    prompt = tokens(1, 30, seed=4)
    with torch.no_grad():
        log_probs, state = model(prompt, model.init_state(1))
        generated, steps = [], []
        for _ in range(40):
            token = log_probs[:, -1].argmax(-1, keepdim=True)
            generated.append(token)
            steps.append(log_probs[:, -1])
            log_probs, state = model(token, state)
        full, _ = model(torch.cat([prompt, *generated], dim=1), model.init_state(1))
    for i, expected in enumerate(steps):
        assert (full[:, 29 + i] - expected).abs().max().item() < 1e-5


# -- (c) batching ----------------------------------------------------------------------------


def test_rows_of_different_histories_batch_like_each_alone():
    model = small_model()
    histories = [tokens(1, n, seed=n) for n in (0, 5, 90)]
    with torch.no_grad():
        alone = [run_in_chunks(model, h, 64)[1] if h.shape[1] else model.init_state(1) for h in histories]
        batch = SpanMemory.concat(alone)
        model.check_state(batch)
        step = tokens(3, 6, seed=9)
        batched, batch_next = model(step, batch)
        for row, state in enumerate(alone):
            own, own_next = model(step[row : row + 1], state)
            assert (batched[row] - own[0]).abs().max().item() < 1e-5
            split = batch_next.split()[row]
            model.check_state(split, tokens=histories[row].shape[1] + 6)
            assert [k.shape for k in split.keys] == [k.shape for k in own_next.keys]
            assert all((a - b).abs().max().item() < 1e-5 for a, b in zip(split.keys, own_next.keys))
        # take: rows leave and the rest continue as before
        kept_rows = batch_next.take([2, 0])
        again, _ = model(step[[2, 0], :2], kept_rows)
        for i, row in enumerate([2, 0]):
            own, _ = model(step[row : row + 1, :2], batch_next.split()[row])
            assert (again[i] - own[0]).abs().max().item() < 1e-5


# -- (d) serialisation -----------------------------------------------------------------------


def test_state_round_trips_through_safetensors_bit_identically(tmp_path):
    model = small_model()
    _, state = run_in_chunks(model, tokens(1, 70, seed=2), 70)
    assert isinstance(state, SpanMemory)
    assert_state_round_trips(model, state, 70, tokens(1, 5, seed=3), tmp_path)


# -- (e) state size --------------------------------------------------------------------------


def test_state_keeps_each_heads_span_plus_ramp_and_no_more():
    """Once full, a head keeps ceil(z) + R - 1 positions, whatever the history: the served state
    is smaller than the maximum span would need by the ratio the spans predict."""
    model = small_model()
    n = [kept(z) for row in SPANS for z in row]  # [6, 16, 3, 23]
    D = 16
    sizes = []
    for length in (10, 100, 300):
        _, state = run_in_chunks(model, tokens(1, length, seed=length), 64)
        assert [k.shape[1] for k in state.keys] == [min(x, length) for x in n]
        sizes.append(state.nbytes())
    assert sizes[1] == sizes[2] == 8 * D * sum(n) + 8 == model.state_bytes_when_full()
    full_span = 8 * D * 4 * (MAX_SPAN + RAMP - 1) + 8  # every head at z = S
    predicted = sum(n) / (4 * (MAX_SPAN + RAMP - 1))
    assert abs((sizes[2] - 8) / (full_span - 8) - predicted) < 1e-12
    assert sizes[2] < full_span
    # the same model with every span at the maximum keeps exactly that
    widest = small_model(spans=[[MAX_SPAN] * 2] * 2)
    _, state = run_in_chunks(widest, tokens(1, 100), 64)
    assert state.nbytes() == full_span


def test_spans_report():
    model = small_model()
    report = model.spans_report()
    assert [r["spans"] for r in report] == SPANS
    assert [r["kept_positions"] for r in report] == [[6, 16], [3, 23]]


def test_training_keeps_the_layers_longest_span_plus_a_margin(monkeypatch):
    """In training every head of a layer keeps ceil(max z) + R - 1 + margin positions (capped at
    S + R - 1), and the loss is what keeping the maximum for every head gives: the trimmed keys
    had no weight."""
    spans = [[3.0, 12.5], [0.0, 5.0]]
    model = small_model(spans=spans, max_span=64).train()
    margin = AdaptiveSpan.TRAINING_SPAN_MARGIN
    text = tokens(2, 150)
    _, state = model(text[:, :100], model.init_state(2))
    expected = [kept(12.5) + margin] * 2 + [kept(5.0) + margin] * 2
    assert [k.shape[1] for k in state.keys] == expected and not any(k.requires_grad for k in state.keys)
    trimmed = model.training_loss(text[:, 100:-1], text[:, 101:], state, 0.5)[0]

    monkeypatch.setattr(AdaptiveSpan, "TRAINING_SPAN_MARGIN", 10_000)  # keep everything any span reaches
    _, full_state = model(text[:, :100], model.init_state(2))
    assert all(k.shape[1] == 64 + RAMP - 1 for k in full_state.keys)
    full = model.training_loss(text[:, 100:-1], text[:, 101:], full_state, 0.5)[0]
    torch.testing.assert_close(trimmed, full, rtol=0, atol=1e-6)


# -- (f) checkpoints -------------------------------------------------------------------------


def test_checkpoint_round_trip_gives_identical_log_probs(tmp_path):
    model = small_model()
    save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.kept_positions() == model.kept_positions()
    ids = tokens(1, 40, seed=6)
    with torch.no_grad():
        assert torch.equal(model(ids, model.init_state(1))[0], loaded(ids, loaded.init_state(1))[0])


# -- (g) state checks ------------------------------------------------------------------------


def test_check_state_refuses_poisoned_states():
    model = small_model()
    _, state = run_in_chunks(model, tokens(1, 60, seed=7), 60)
    model.check_state(state, tokens=60)
    model.check_state(model.init_state(1), tokens=0)

    def poisoned(**changes):
        tensors = state.to_tensors()
        tensors.update(changes)
        return SpanMemory.from_tensors(tensors)

    nan = state.keys[1].clone()
    nan[0, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="keys.1"):
        model.check_state(poisoned(**{"keys.1": nan}))
    with pytest.raises(ValueError, match="keys.2"):  # keys and values of a head disagree
        model.check_state(poisoned(**{"keys.2": state.keys[2][:, 1:].contiguous()}))
    with pytest.raises(ValueError, match="keys.1"):  # shorter than the head's span + ramp
        short = {"keys.1": state.keys[1][:, 1:].contiguous(), "values.1": state.values[1][:, 1:].contiguous()}
        model.check_state(poisoned(**short))
    with pytest.raises(ValueError, match="position"):
        model.check_state(state, tokens=61)
    with pytest.raises(ValueError, match="position"):
        model.check_state(poisoned(position=torch.tensor([-1])))
    with pytest.raises(ValueError, match="positions"):  # a state of 60 tokens claiming 5
        model.check_state(poisoned(position=torch.tensor([5])), tokens=5)
    with pytest.raises(ValueError, match="keys.0"):  # a wrong head width
        model.check_state(poisoned(**{"keys.0": torch.zeros(1, 6, 8), "values.0": torch.zeros(1, 6, 8)}))


# -- training --------------------------------------------------------------------------------


def test_training_loss_adds_the_span_penalty_and_trains_the_spans():
    model = small_model(span_penalty=0.5).train()
    inputs, targets = tokens(2, 33)[:, :-1], tokens(2, 33)[:, 1:]
    state = model.init_state(2)
    loss, _ = model.training_loss(inputs, targets, state, 0.0)
    log_probs, _ = model(inputs, state)
    nll = -log_probs.gather(-1, targets[..., None]).mean()
    assert abs(loss.item() - nll.item() - 0.5 * sum(map(sum, SPANS)) / 4) < 1e-5
    loss.backward()
    assert all(layer.span_fraction.grad is not None and layer.span_fraction.grad.abs().sum() > 0
               and torch.isfinite(layer.span_fraction.grad).all()
               for layer in model.layers)


def test_three_training_steps_of_the_tiny_preset(tmp_path):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 3, batch_size=4, segment_len=32, eval_every=1000,
                     save_every=1000, quick_eval_bytes=500, warmup_steps=2)
    model = train("adaptive-span", "tiny", tmp_path / "out", recipe, log=lambda s: None)
    assert isinstance(model, AdaptiveSpan)
    loaded = load_checkpoint(tmp_path / "out")
    assert loaded.spans_report() == model.spans_report()
