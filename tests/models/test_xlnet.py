"""XLNet invariants that need no reference weights: two-stream attention, permutation masks,
left-to-right serving over the memory."""

import itertools

import pytest
import torch

from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models.layers.xl_memory import XLMemory
from xlserve.models.xlnet import XLNet, XLNetConfig, permutation_masks
from tests.models.helpers import run_in_chunks, tokens


def small_model(**overrides) -> XLNet:
    torch.manual_seed(0)
    values = dict(n_layer=3, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=16, same_length=True)
    values.update(overrides)
    return XLNet(XLNetConfig(**values)).eval()


def random_orders(batch, length, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(length, generator=g) for _ in range(batch)])


# -- permutation language modeling ------------------------------------------------------------------


def test_permutation_masks_match_a_brute_force_construction():
    order = random_orders(3, 9)
    content, query, predicted = permutation_masks(order, n_predict=2)
    for b in range(3):
        z = order[b].tolist()
        for i, j in itertools.product(range(9), range(9)):
            before = z.index(j) < z.index(i)  # j comes before i in the factorisation order
            assert content[b, i, j].item() == (before or i == j)
            assert query[b, i, j].item() == before
        assert predicted[b].tolist() == z[-2:]


def test_query_stream_never_sees_its_own_token():
    model = small_model()
    text, order = tokens(2, 10, 3), random_orders(2, 10, 4)
    _, state = model(tokens(2, 5, 5), model.init_state(2))  # with a memory too
    with torch.no_grad():
        base, predicted, _ = model.permuted(text, state, order, n_predict=3)
        for k in range(3):
            changed = text.clone()
            rows = torch.arange(2)
            changed[rows, predicted[:, k]] = (text[rows, predicted[:, k]] + 7) % 256
            again, _, _ = model.permuted(changed, state, order, n_predict=3)
            # the prediction of the perturbed position is unchanged ...
            assert (again[rows, k] - base[rows, k]).abs().max().item() < 1e-6
            # ... while positions later in the order, which do see it, change
            for later in range(k + 1, 3):
                assert (again[rows, later] - base[rows, later]).abs().max().item() > 1e-6


def test_identity_order_equals_left_to_right_serving():
    model = small_model(same_length=False, mem_len=None)
    text = tokens(2, 12, 6)
    identity = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        permuted, predicted, _ = model.permuted(text, model.init_state(2), identity, n_predict=11)
        served, _ = model(text, model.init_state(2))
    assert predicted[0].tolist() == list(range(1, 12))
    assert (permuted - served[:, :-1]).abs().max().item() < 1e-5


def test_one_segment_makes_the_segment_term_a_no_op():
    model = small_model()
    with torch.no_grad():
        for layer in model.layers:  # large enough segment vectors for their effect to show
            layer.seg_embed.normal_(std=1.0)
            layer.r_s_bias.normal_(std=1.0)
    text, order = tokens(1, 8, 7), random_orders(1, 8, 8)
    with torch.no_grad():
        without, _, _ = model.permuted(text, model.init_state(1), order, 3)
        same, _, _ = model.permuted(text, model.init_state(1), order, 3, segment_ids=torch.zeros(1, 8, dtype=torch.long))
        pair, _, _ = model.permuted(text, model.init_state(1), order, 3,
                                    segment_ids=torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]))
    assert (without - same).abs().max().item() < 1e-5
    assert (without - pair).abs().max().item() > 1e-4  # vs ~1e-7 float noise above


def test_training_predicts_the_last_sixth_and_learns():
    model = small_model(mem_len=8).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    inputs = tokens(4, 12, 9) % 4  # a small alphabet: unigram statistics are learnable quickly
    state, losses = model.init_state(4), []
    for step in range(25):
        loss, state = model.training_loss(inputs, None, state, step / 25)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert state.length == 8 and all(not k.requires_grad for k in state.keys)
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


# -- serving ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 40])
def test_same_length_is_chunk_invariant(chunk):
    model = small_model(same_length=True, mem_len=16)
    text = tokens(2, 40, 10)
    whole, whole_state = run_in_chunks(model, text, 40)
    chunked, chunked_state = run_in_chunks(model, text, chunk)
    assert (whole - chunked).abs().max().item() < 1e-5
    assert chunked_state.length == 16
    for a, b in zip(whole_state.keys, chunked_state.keys):
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("chunk", [1, 4, 9])
def test_unbounded_memory_incremental_decoding_equals_one_pass(chunk):
    model = small_model(same_length=False, mem_len=None)
    text = tokens(1, 30, 11)
    whole, _ = run_in_chunks(model, text, 30)
    chunked, state = run_in_chunks(model, text, chunk)
    assert (whole - chunked).abs().max().item() < 1e-5
    assert state.length == 30 and model.state_grows_with_context


def test_without_same_length_chunks_agree_up_to_mem_len_plus_one():
    """Documented: like Transformer-XL with same_length=False, a long chunk sees further back."""
    model = small_model(same_length=False, mem_len=8)
    short = tokens(1, 9, 12)
    one_pass, _ = run_in_chunks(model, short, 9)
    by_token, _ = run_in_chunks(model, short, 1)
    assert (one_pass - by_token).abs().max().item() < 1e-5
    long = tokens(1, 24, 12)
    one_pass, _ = run_in_chunks(model, long, 24)
    by_token, _ = run_in_chunks(model, long, 1)
    assert (one_pass[:, 9:] - by_token[:, 9:]).abs().max().item() > 1e-4


def test_prediction_does_not_depend_on_the_token_it_predicts():
    model = small_model()
    text = tokens(1, 10, 13)
    changed = text.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 256
    with torch.no_grad():
        a, _ = model(text, model.init_state(1))
        b, _ = model(changed, model.init_state(1))
    assert (a[:, :6] - b[:, :6]).abs().max().item() < 1e-6  # position 5 predicts token 6
    assert (a[:, 6:] - b[:, 6:]).abs().max().item() > 1e-6


def test_one_generated_token_is_one_incremental_step():
    model = small_model()
    with torch.no_grad():
        _, state = model(tokens(1, 20, 14), model.init_state(1))
        seen = []
        hook = model.layers[0].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
        model(tokens(1, 1, 15), state)
        hook.remove()
    assert seen == [2]  # one content row and one query row


def test_batched_rows_of_different_lengths_match_single_rows():
    model = small_model()
    a, b = tokens(1, 5, 16), tokens(1, 30, 17)
    step = tokens(2, 3, 18)
    with torch.no_grad():
        _, state_a = model(a, model.init_state(1))
        _, state_b = model(b, model.init_state(1))
        single_a, next_a = model(step[:1], state_a)
        single_b, next_b = model(step[1:], state_b)
        batched, next_batch = model(step, XLMemory.concat([state_a, state_b]))
    assert (batched[0] - single_a[0]).abs().max().item() < 1e-5
    assert (batched[1] - single_b[0]).abs().max().item() < 1e-5
    split_a, split_b = next_batch.split()
    assert split_a.length == next_a.length and split_b.length == next_b.length


def test_state_round_trips_through_flat_tensors():
    model = small_model()
    _, state = model(tokens(1, 9, 19), model.init_state(1))
    restored = XLMemory.from_tensors(state.to_tensors())
    model.check_state(restored)
    assert all(torch.equal(x, y) for x, y in zip(state.values, restored.values))
    wrong = state.to_tensors()
    wrong["values.1"] = torch.zeros(1, 9, 2, 8)
    with pytest.raises(ValueError, match="values.1"):
        model.check_state(XLMemory.from_tensors(wrong))
    too_long = model.init_state(1)
    too_long.keys = [torch.zeros(1, 17, 2, 16)] * 3
    with pytest.raises(ValueError, match="mem_len"):
        model.check_state(XLMemory(too_long.keys, too_long.keys, torch.ones(1, 17, dtype=torch.bool)))


def test_save_and_load_give_identical_log_probs(tmp_path):
    model = small_model()
    save_checkpoint(model, tmp_path / "xlnet")
    loaded = load_checkpoint(tmp_path / "xlnet")
    text = tokens(1, 20, 20)
    a, _ = run_in_chunks(model, text, 6)
    b, _ = run_in_chunks(loaded, text, 6)
    assert torch.equal(a, b)


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("prompt_tokens", [12, 30])
def test_serving_gives_the_numbers_of_the_module_path(batch, quantize, prompt_tokens):
    """In eval mode without autograd a layer runs without module calls (TwoStreamLayer._serve:
    each product through its module's own forward, F.layer_norm, no dropout): a prompt and a
    decoding step give the numbers of the same calls through the modules (autograd on), with
    the memory not yet full and past it (same_length then hides the oldest keys), at batch 1 and
    5 (oneDNN's product: the weights are large enough), in float32 and int8."""
    from xlserve.models.linear import Linear, use_batched_products
    from xlserve.models.quantize import Int8Linear, quantize_model

    model = quantize_model(use_batched_products(small_model(n_layer=2, d_model=256, n_head=4, d_head=64, d_inner=4096,
                                                            mem_len=16)), quantize)
    assert isinstance(model.layers[0].ff_in, Int8Linear if quantize == "int8" else Linear)
    prompt = torch.randint(0, 256, (batch, prompt_tokens), generator=torch.Generator().manual_seed(5))
    token = torch.randint(0, 256, (batch, 1), generator=torch.Generator().manual_seed(6))
    called = []  # the serving path calls each product's forward itself: its module's hooks do not run
    model.layers[0].q_net.register_forward_hook(lambda *_: called.append(True))
    with torch.no_grad():
        served_prompt, state = model(prompt, model.init_state(batch))
        served_step, served_state = model(token, state)
    assert not called
    with torch.enable_grad():  # the parameters require a gradient: every module called
        module_prompt, _ = model(prompt, model.init_state(batch))
        module_step, module_state = model(token, state)
    assert called
    # int8 rounds each product's input to int8, where summation order can move a value by a step
    tolerance = 1e-4 if quantize == "none" else 2e-2
    assert (served_prompt - module_prompt).abs().max().item() < tolerance
    assert (served_step - module_step).abs().max().item() < tolerance
    for a, b in zip(served_state.keys + served_state.values, module_state.keys + module_state.values):
        assert (a - b).abs().max().item() < tolerance / 10
