"""∞-former invariants: chunking semantics, incremental decoding, constant state, state I/O."""

import dataclasses

import pytest
import torch
from safetensors.torch import load, save

from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models.infinity_former import ContinuousMemory, InfinityFormer, InfinityFormerConfig
from xlserve.models.registry import build_model
from xlserve.models.training.presets import preset_config
from xlserve.models.training.train import training_loss

SEGMENT = 8


def small_model(**overrides) -> InfinityFormer:
    torch.manual_seed(0)
    config = InfinityFormerConfig(
        n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, segment_len=SEGMENT, n_basis=16,
        n_samples=8, sticky_bins=16,
    )
    model = InfinityFormer(dataclasses.replace(config, **overrides))
    # make the long-term read sharp enough to matter at random init
    for layer in model.layers:
        torch.nn.init.normal_(layer.ltm_density, std=0.5)
        torch.nn.init.normal_(layer.ltm_v.weight, std=0.3)
    return model.eval()


def run_in_chunks(model, tokens, chunks, state=None):
    """Feed `tokens` in calls of the given sizes (an int: that size repeatedly)."""
    state = state if state is not None else model.init_state(tokens.shape[0])
    if isinstance(chunks, int):
        chunks = [chunks] * -(-tokens.shape[1] // chunks)
    outputs, start = [], 0
    with torch.no_grad():
        for size in chunks:
            log_probs, state = model(tokens[:, start : start + size], state)
            outputs.append(log_probs)
            start += size
    assert start >= tokens.shape[1]
    return torch.cat(outputs, dim=1), state


def max_state_difference(a: ContinuousMemory, b: ContinuousMemory) -> float:
    ta, tb = a.to_tensors(), b.to_tensors()
    assert ta.keys() == tb.keys()
    return max((ta[k].double() - tb[k].double()).abs().max().item() for k in ta)


def tokens_for(batch, length, seed):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_within_a_segment_token_by_token_equals_one_pass():
    model = small_model()
    tokens = tokens_for(2, 3 * SEGMENT, 1)
    _, state = run_in_chunks(model, tokens[:, : 2 * SEGMENT], 2 * SEGMENT)  # a filled long-term memory
    one_pass, one_state = run_in_chunks(model, tokens[:, 2 * SEGMENT :], SEGMENT, state)
    by_token, token_state = run_in_chunks(model, tokens[:, 2 * SEGMENT :], 1, state)
    assert (one_pass - by_token).abs().max().item() < 1e-5
    assert max_state_difference(one_state, token_state) < 1e-5


@pytest.mark.parametrize("sticky", [True, False])
@pytest.mark.parametrize("chunks", [1, 3, 7, SEGMENT, 13, 40, [5, 11, 2, 30, 1, 100]])
def test_any_chunking_crosses_the_same_boundaries_and_agrees(chunks, sticky):
    """Boundaries sit at absolute multiples of segment_len, so every chunking updates the
    long-term memory at the same positions and gives the same log-probs."""
    model = small_model(sticky_memories=sticky)
    tokens = tokens_for(2, 75, 2)  # nine boundaries
    whole, whole_state = run_in_chunks(model, tokens, 75)
    chunked, chunked_state = run_in_chunks(model, tokens, chunks)
    assert (whole - chunked).abs().max().item() < 1e-4
    assert torch.equal(whole_state.position, chunked_state.position)
    assert max_state_difference(whole_state, chunked_state) < 1e-4


def test_cached_greedy_decode_equals_full_forward():
    model = small_model()
    prompt = tokens_for(1, 13, 4)
    with torch.no_grad():
        log_probs, state = model(prompt, model.init_state(1))
        generated, step_log_probs = [], []
        for _ in range(30):  # crosses several segment boundaries
            token = log_probs[:, -1].argmax(-1, keepdim=True)
            generated.append(token)
            step_log_probs.append(log_probs[:, -1])
            log_probs, state = model(token, state)
        text = torch.cat([prompt, *generated], dim=1)
        full, _ = model(text, model.init_state(1))
    for i, expected in enumerate(step_log_probs):
        assert (full[:, 12 + i] - expected).abs().max().item() < 1e-4
        assert full[:, 12 + i].argmax().item() == generated[i].item()


def test_long_term_memory_carries_what_the_short_term_memory_cannot():
    """With 2 layers, short-term attention reaches at most 3 segments back; beyond that only the
    continuous memory can carry information."""
    model = small_model()
    tokens = tokens_for(1, 8 * SEGMENT, 5)
    changed = tokens.clone()
    changed[:, :SEGMENT] = tokens_for(1, SEGMENT, 6)
    late = slice(5 * SEGMENT, None)
    with_ltm = (run_in_chunks(model, tokens, 64)[0] - run_in_chunks(model, changed, 64)[0])[:, late]
    assert with_ltm.abs().max().item() > 1e-4
    off = model.with_long_term_memory(False)
    without = (run_in_chunks(off, tokens, 64)[0] - run_in_chunks(off, changed, 64)[0])[:, late]
    assert without.abs().max().item() == 0.0
    assert model.config.long_term_memory  # the view left the model alone


def test_sticky_memories_change_the_update_and_are_deterministic():
    tokens = tokens_for(1, 5 * SEGMENT, 7)
    sticky, sticky_state = run_in_chunks(small_model(), tokens, 40)
    again, again_state = run_in_chunks(small_model(), tokens, 40)
    assert torch.equal(sticky, again)
    assert max_state_difference(sticky_state, again_state) == 0.0
    even, even_state = run_in_chunks(small_model(sticky_memories=False), tokens, 40)
    assert (sticky_state.coefficients[0] - even_state.coefficients[0]).abs().max().item() > 1e-4


def test_state_size_is_constant_in_the_history():
    # the tiny preset with longer segments: 100k tokens are 390 sequential memory updates
    model = build_model("infinity-former", {**preset_config("infinity-former", "tiny"), "segment_len": 256}).eval()
    fresh = model.init_state(1).nbytes()
    sizes = {}
    state, seen = model.init_state(1), 0
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for target in (1_000, 10_000, 100_000):
            while seen < target:
                size = min(8_192, target - seen)
                log_probs, state = model(torch.randint(0, 256, (1, size), generator=generator), state)
                seen += size
            sizes[target] = state.nbytes()
            assert torch.isfinite(log_probs).all()
            assert all(torch.isfinite(b).all() and b.abs().max() < 1e3 for b in state.coefficients)
    assert state.position.item() == 100_000
    assert sizes[1_000] == sizes[10_000] == sizes[100_000] == fresh


def test_batched_rows_at_different_positions_match_single_rows():
    model = small_model()
    a, b = tokens_for(1, 5, 9), tokens_for(1, 19, 10)  # different offsets within their segments
    with torch.no_grad():
        _, state_a = model(a, model.init_state(1))
        _, state_b = model(b, model.init_state(1))
        step = tokens_for(2, 12, 11)  # each row crosses a boundary at a different place
        single_a, next_a = model(step[:1], state_a)
        single_b, next_b = model(step[1:], state_b)
        batched, next_batch = model(step, ContinuousMemory.concat([state_a, state_b]))
    assert (batched[0] - single_a[0]).abs().max().item() < 1e-5
    assert (batched[1] - single_b[0]).abs().max().item() < 1e-5
    split_a, split_b = next_batch.split()
    assert max_state_difference(split_a, next_a) < 1e-5
    assert max_state_difference(split_b, next_b) < 1e-5


def test_take_keeps_the_rows_asked_for():
    """State.take's default (split, then concat): the kept rows, in the order asked."""
    model = small_model()
    with torch.no_grad():
        states = [model(tokens_for(1, 7, seed), model.init_state(1))[1] for seed in (1, 2, 3)]
        batch = ContinuousMemory.concat(states)
        taken = batch.take([2, 0])
    assert taken.batch_size == 2
    assert max_state_difference(taken.split()[0], states[2]) == 0
    assert max_state_difference(taken.split()[1], states[0]) == 0


def test_state_round_trips_and_restores_bit_identically():
    model = small_model()
    tokens = tokens_for(1, 30, 12)
    _, state = run_in_chunks(model, tokens[:, :21], 21)
    # through safetensors bytes, as a session spilled to disk and restored
    restored = ContinuousMemory.from_tensors(load(save(state.to_tensors())))
    model.check_state(restored)
    continued, _ = run_in_chunks(model, tokens[:, 21:], 9, state)
    after_restore, _ = run_in_chunks(model, tokens[:, 21:], 9, restored)
    assert torch.equal(continued, after_restore)

    with pytest.raises(ValueError, match="missing"):
        ContinuousMemory.from_tensors({k: v for k, v in state.to_tensors().items() if k != "position"})
    wrong = state.to_tensors()
    wrong["coefficients.0"] = torch.zeros(1, 5, 32)
    with pytest.raises(ValueError, match="coefficients.0"):
        model.check_state(ContinuousMemory.from_tensors(wrong))
    with pytest.raises(ValueError):
        model.check_state(small_model(n_layer=3).init_state(1))


def test_saved_checkpoint_gives_identical_log_probs(tmp_path):
    model = small_model()
    save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert isinstance(loaded, InfinityFormer) and loaded.config == model.config
    tokens = tokens_for(1, 40, 13)
    assert torch.equal(run_in_chunks(model, tokens, 40)[0], run_in_chunks(loaded, tokens, 40)[0])


def test_training_loss_trains_the_continuous_attention_and_detaches_the_state():
    model = small_model().train()
    tokens = tokens_for(2, 2 * SEGMENT + 1, 14)
    _, state = training_loss(model, tokens[:, :SEGMENT], tokens[:, 1 : SEGMENT + 1], model.init_state(2), 0.0)
    inputs, targets = tokens[:, SEGMENT:-1], tokens[:, SEGMENT + 1 :]
    loss, after = training_loss(model, inputs, targets, state, 0.5)
    assert torch.isfinite(loss)
    loss.backward()
    layer = model.layers[0]
    for p in (layer.ltm_k.weight, layer.ltm_v.weight, layer.ltm_density, layer.ltm_o.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert not any(t.requires_grad for t in after.to_tensors().values())
    assert after.position.tolist() == [2 * SEGMENT, 2 * SEGMENT]
    # the loss is the NLL plus the (positive) KL regulariser
    with torch.no_grad():
        log_probs, _ = model(inputs, state)
    nll = -log_probs.gather(-1, targets[..., None]).mean()
    assert loss.item() > nll.item() + 1e-6
    unregularised = small_model(kl_weight=0.0).train()
    assert torch.allclose(training_loss(unregularised, inputs, targets, state, 0.5)[0], nll, atol=1e-6)


def test_empty_call_and_interface_flags():
    model = small_model()
    state = model.init_state(3)
    log_probs, after = model(torch.zeros(3, 0, dtype=torch.long), state)
    assert log_probs.shape == (3, 0, 256) and log_probs.dtype == torch.float32
    assert after is state
    assert model.state_kind == "continuous" and not model.state_grows_with_context
    assert model.max_context is None


def test_presets_are_within_the_standard_budget():
    small = build_model("infinity-former", preset_config("infinity-former", "small"))
    assert 1_500_000 <= sum(p.numel() for p in small.parameters()) <= 2_500_000
