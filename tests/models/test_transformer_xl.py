"""Transformer-XL invariants that need no reference weights."""

import pytest
import torch

from xlserve.models.layers.xl_memory import XLMemory
from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig
from tests.models.helpers import run_in_chunks


def small_model(**overrides) -> TransformerXL:
    torch.manual_seed(0)
    config = TransformerXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=16)
    for key, value in overrides.items():
        setattr(config, key, value)
    return TransformerXL(config).eval()


@pytest.mark.parametrize("pre_norm", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 7, 10, 16, 24, 64])
def test_same_length_is_chunk_invariant(chunk, pre_norm):
    # chunks shorter and longer than mem_len (16) all agree with one pass
    model = small_model(pre_norm=pre_norm, same_length=True)
    tokens = torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(1))
    whole, whole_state = run_in_chunks(model, tokens, 60)
    chunked, chunked_state = run_in_chunks(model, tokens, chunk)
    assert (whole - chunked).abs().max().item() < 1e-5
    for a, b in zip(whole_state.keys, chunked_state.keys):
        assert (a - b).abs().max().item() < 1e-5


def test_clamp_len_changes_far_positions_but_stays_chunk_invariant():
    model = small_model(clamp_len=4)
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    whole, _ = run_in_chunks(model, tokens, 40)
    chunked, _ = run_in_chunks(model, tokens, 5)
    assert (whole - chunked).abs().max().item() < 1e-5
    unclamped, _ = run_in_chunks(small_model(), tokens, 40)
    assert (whole - unclamped).abs().max().item() > 1e-4


def test_without_same_length_chunks_agree_only_up_to_mem_len_plus_one():
    """Documented difference: without same_length a long chunk sees further back."""
    model = small_model(same_length=False)
    short = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(3))  # mem_len + 1
    one_pass, _ = run_in_chunks(model, short, 17)
    by_token, _ = run_in_chunks(model, short, 1)
    assert (one_pass - by_token).abs().max().item() < 1e-5

    long = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))
    one_pass, _ = run_in_chunks(model, long, 48)
    by_token, _ = run_in_chunks(model, long, 1)
    assert (one_pass[:, :17] - by_token[:, :17]).abs().max().item() < 1e-5
    assert (one_pass[:, 17:] - by_token[:, 17:]).abs().max().item() > 1e-4


def test_cached_greedy_decode_equals_full_forward():
    """Greedy decoding one token at a time against the memory gives the log-probs that one
    full forward over prompt + generated text gives (the receptive field spans layers, so the
    comparison is with the whole text, not the last mem_len tokens)."""
    model = small_model()
    prompt = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        log_probs, state = model(prompt, model.init_state(1))
        generated, step_log_probs = [], []
        for _ in range(25):
            token = log_probs[:, -1].argmax(-1, keepdim=True)  # (1, 1)
            generated.append(token)
            step_log_probs.append(log_probs[:, -1])
            log_probs, state = model(token, state)
        text = torch.cat([prompt, *generated], dim=1)
        full, _ = model(text, model.init_state(1))
    for i, expected in enumerate(step_log_probs):
        assert (full[:, 29 + i] - expected).abs().max().item() < 1e-5
        assert full[:, 29 + i].argmax().item() == generated[i].item()


def test_memory_is_bounded_and_detached():
    model = small_model().train()
    tokens = torch.randint(0, 256, (2, 40))
    log_probs, state = model(tokens, model.init_state(2))
    assert state.length == 16
    assert all(not k.requires_grad for k in state.keys)
    assert state.nbytes() == 2 * 2 * (2 * 16 * 2 * 16 * 4) + 2 * 16  # layers*(k,v)*B*M*H*D*4 + valid


def test_mem_len_zero_makes_calls_independent():
    model = small_model().with_mem_len(0)
    tokens = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        first, state = model(tokens[:, :10], model.init_state(1))
        second, _ = model(tokens[:, 10:], state)
        alone, _ = model(tokens[:, 10:], model.init_state(1))
    assert state.length == 0
    assert torch.equal(second, alone)


def test_batched_rows_of_different_lengths_match_single_rows():
    model = small_model()
    a = torch.randint(0, 256, (1, 5))
    b = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        _, state_a = model(a, model.init_state(1))
        _, state_b = model(b, model.init_state(1))
        step = torch.randint(0, 256, (2, 3))
        single_a, next_a = model(step[:1], state_a)
        single_b, next_b = model(step[1:], state_b)
        batched, next_batch = model(step, XLMemory.concat([state_a, state_b]))
    assert (batched[0] - single_a[0]).abs().max().item() < 1e-5
    assert (batched[1] - single_b[0]).abs().max().item() < 1e-5
    split_a, split_b = next_batch.split()
    assert split_a.length == next_a.length and split_b.length == next_b.length
    assert (split_a.keys[0] - next_a.keys[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("same_length", [True, False])
@pytest.mark.parametrize("history", [(0, 0, 0), (0, 7, 40)])  # memory each row has seen (mem_len 16)
def test_ragged_chunks_in_one_batch_match_each_row_alone(same_length, history):
    """forward(tokens, state, lengths): rows of different lengths, right-padded, in one call
    give each row's own log-probabilities at its real positions and a memory that continues
    exactly as that row's alone would (the prompt prefill of rows of different lengths)."""
    model = small_model(same_length=same_length)
    chunks = [torch.randint(0, 256, (1, n)) for n in (5, 20, 12)]  # 20 > mem_len: the window shifts
    with torch.no_grad():
        alone = []
        for seen, chunk in zip(history, chunks):
            state = model.init_state(1)
            if seen:
                _, state = model(torch.randint(0, 256, (1, seen)), state)
            alone.append(state)
        longest = max(c.shape[1] for c in chunks)
        tokens = torch.zeros(3, longest, dtype=torch.long)
        for row, chunk in enumerate(chunks):
            tokens[row, : chunk.shape[1]] = chunk[0]
        lengths = torch.tensor([c.shape[1] for c in chunks])
        batched, batch_state = model(tokens, XLMemory.concat(alone), lengths=lengths)
        step = torch.randint(0, 256, (3, 2))
        batched_next, _ = model(step, batch_state)
        for row, (chunk, state) in enumerate(zip(chunks, alone)):
            own, own_state = model(chunk, state)
            n = chunk.shape[1]
            torch.testing.assert_close(batched[row, :n], own[0], rtol=0, atol=1e-5)
            own_next, _ = model(step[row : row + 1], own_state)
            torch.testing.assert_close(batched_next[row], own_next[0], rtol=0, atol=1e-5)
            split = batch_state.split()[row]
            assert split.length == own_state.length
            torch.testing.assert_close(split.keys[1], own_state.keys[1], rtol=0, atol=1e-5)


def test_state_round_trips_through_flat_tensors():
    model = small_model()
    _, state = model(torch.randint(0, 256, (1, 9)), model.init_state(1))
    restored = XLMemory.from_tensors(state.to_tensors())
    model.check_state(restored)
    assert all(torch.equal(a, b) for a, b in zip(state.keys, restored.keys))
    with pytest.raises(ValueError, match="missing"):
        XLMemory.from_tensors({k: v for k, v in state.to_tensors().items() if k != "valid"})
    wrong = state.to_tensors()
    wrong["keys.0"] = torch.zeros(1, 3, 5, 16)
    with pytest.raises(ValueError, match="keys.0"):
        model.check_state(XLMemory.from_tensors(wrong))


@pytest.mark.parametrize("pre_norm", [True, False])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("prompt_tokens", [20, 40])
def test_a_decoding_step_gives_the_numbers_of_the_general_path(pre_norm, batch, quantize, prompt_tokens):
    """A decoding step (eval mode, no autograd, one position per row: RelativeAttentionLayer's
    `_decode`, which calls each product module's own forward and no dropout) against the same
    step through the modules (autograd on), after a prompt shorter than the memory and one
    longer (same_length then blocks the keys past mem_len). The weights are large enough for
    oneDNN's product at batch 5 (models/linear.py), and the int8 model multiplies through its
    copies on both paths."""
    from xlserve.models.linear import Linear, use_batched_products
    from xlserve.models.quantize import Int8Linear, quantize_model

    model = use_batched_products(small_model(pre_norm=pre_norm, d_model=256, n_head=4, d_head=64, d_inner=4096,
                                             mem_len=24, same_length=True))
    model = quantize_model(model, quantize)
    product = Int8Linear if quantize == "int8" else Linear
    assert isinstance(model.layers[0].ff[0], product)
    prompt = torch.randint(0, 256, (batch, prompt_tokens), generator=torch.Generator().manual_seed(5))
    token = torch.randint(0, 256, (batch, 1), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, state = model(prompt, model.init_state(batch))
    called = []  # the decoding step calls the product's forward itself: its module's hooks do not run
    model.layers[0].qkv_net.register_forward_hook(lambda *_: called.append(True))
    with torch.no_grad():
        decoded, decoded_state = model(token, state)
    assert not called
    with torch.enable_grad():  # the parameters require a gradient: the general path, every module called
        general, general_state = model(token, state)
    assert called
    # int8 rounds each product's input to int8, where a last-bit difference between the two
    # paths' attention (a batched product against an einsum) can move a value by one step
    tolerance = 1e-4 if quantize == "none" else 2e-2
    assert (decoded - general).abs().max().item() < tolerance
    for a, b in zip(decoded_state.keys + decoded_state.values, general_state.keys + general_state.values):
        assert (a - b).abs().max().item() < tolerance / 10


def test_without_a_memory_each_call_is_its_own_segment_so_chunking_matters():
    """mem_len 0 keeps nothing between calls: 12 tokens in one call and in two of 6 differ. The
    model said it was chunking-invariant all the same, so the prefix cache resumed a prompt from
    its prefix's empty memory and answered otherwise than a cold request. A negative mem_len,
    whose states the model then refused as its own, is refused when it is built."""
    model = small_model(mem_len=0)
    assert not model.chunking_invariant and small_model().chunking_invariant
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole, _ = model(tokens, model.init_state(1))
        first, state = model(tokens[:, :6], model.init_state(1))
        second, _ = model(tokens[:, 6:], state)
    assert not torch.allclose(whole, torch.cat([first, second], dim=1), atol=1e-4)
    with pytest.raises(ValueError, match="mem_len"):
        small_model(mem_len=-1)


def test_an_empty_chunk_changes_nothing():
    model = small_model()
    state = model.init_state(2)
    with torch.no_grad():
        log_probs, after = model(torch.zeros(2, 0, dtype=torch.long), state)
    assert log_probs.shape == (2, 0, model.vocab_size) and after is state
