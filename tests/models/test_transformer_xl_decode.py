"""Transformer-XL's inference decode path: memory buffers with room to grow (extend_memory) and
per-row attention products. States must stay values: continuing a state never changes it."""

import pytest
import torch

from xlserve.models.layers.buffers import MEMORY_ROOM, extend_memory
from xlserve.models.layers.xl_memory import XLMemory
from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig


def small_model(**overrides) -> TransformerXL:
    torch.manual_seed(0)
    config = TransformerXLConfig(**{"n_layer": 2, "d_model": 32, "n_head": 2, "d_head": 16, "d_inner": 64, "mem_len": 16,
                                    **overrides})
    return TransformerXL(config).eval()


def snapshot(state: XLMemory) -> dict:
    return {k: v.clone() for k, v in state.to_tensors().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@torch.inference_mode()
def test_continuing_a_state_twice_never_changes_it_or_the_first_continuation():
    model = small_model()
    prompt = torch.randint(0, 256, (2, 20))
    _, state = model(prompt, model.init_state(2))
    for _ in range(3):  # a few steps so the memory lives in a buffer with room
        _, state = model(torch.randint(0, 256, (2, 1)), state)
    before = snapshot(state)

    a, b = torch.tensor([[1], [2]]), torch.tensor([[3], [4]])
    lp_a, after_a = model(a, state)  # takes the room after `state`
    kept_a = snapshot(after_a)
    lp_b, after_b = model(b, state)  # the room is taken: must copy, not overwrite
    assert same(snapshot(state), before)
    assert same(snapshot(after_a), kept_a)

    # the same continuations from private copies of the state agree exactly
    lp_a2, _ = model(a, state.clone())
    lp_b2, after_b2 = model(b, state.clone())
    assert torch.equal(lp_a, lp_a2) and torch.equal(lp_b, lp_b2)
    assert same(snapshot(after_b), snapshot(after_b2))


@torch.inference_mode()
def test_long_decoding_through_many_buffer_refills_matches_copying_every_step():
    model = small_model()
    tokens = torch.randint(0, 256, (2, 3 * MEMORY_ROOM + 10))
    fast, slow = model.init_state(2), model.init_state(2)
    for i in range(tokens.shape[1]):
        lp_fast, fast = model(tokens[:, i : i + 1], fast)
        lp_slow, slow = model(tokens[:, i : i + 1], slow.clone())  # a fresh compact state every step
        assert torch.equal(lp_fast, lp_slow)
    assert fast.length == 16 and same(snapshot(fast), snapshot(slow))


@torch.inference_mode()
def test_split_rows_continue_like_the_batch():
    model = small_model(same_length=False)
    _, state = model(torch.randint(0, 256, (2, 30)), model.init_state(2))
    _, state = model(torch.randint(0, 256, (2, 1)), state)
    step = torch.randint(0, 256, (2, 1))
    batched, _ = model(step, state)
    row0, row1 = state.split()
    single0, _ = model(step[:1], row0)
    single1, _ = model(step[1:], row1)
    assert (batched - torch.cat([single0, single1])).abs().max().item() < 1e-5
    again, _ = model(step, state)  # the batch state itself is still intact
    assert torch.equal(again, batched)


@torch.inference_mode()
def test_extend_memory_is_a_concatenation():
    memory = torch.randn(2, 5, 3, 4)
    storages = set()
    for _ in range(MEMORY_ROOM + 3):
        new = torch.randn(2, 1, 3, 4)
        extended = extend_memory(memory, new)
        assert torch.equal(extended, torch.cat([memory, new], dim=1))
        storages.add(extended.untyped_storage().data_ptr())
        memory = extended[:, 1:]  # keep a sliding window, as the model does
    assert len(storages) == 2  # one copy when the first buffer's room ran out


def test_extend_memory_under_autograd_is_torch_cat():
    memory, new = torch.randn(2, 5, 3, 4, requires_grad=True), torch.randn(2, 1, 3, 4)
    extended = extend_memory(memory, new)
    assert torch.equal(extended, torch.cat([memory, new], dim=1)) and extended.is_contiguous()
    extended.sum().backward()
    assert torch.equal(memory.grad, torch.ones_like(memory))


def test_training_still_gets_gradients_through_the_segment():
    model = small_model().train()
    log_probs, state = model(torch.randint(0, 256, (2, 12)), model.init_state(2))
    log_probs2, _ = model(torch.randint(0, 256, (2, 1)), state)
    (log_probs.sum() + log_probs2.sum()).backward()
    assert model.layers[0].qkv_net.weight.grad is not None


@pytest.mark.parametrize("batch", [1, 2])
@torch.inference_mode()
def test_decoding_appends_in_place_to_one_buffer_per_layer_laid_out_for_the_products(batch):
    model = small_model()
    _, state = model(torch.randint(0, 256, (batch, 5)), model.init_state(batch))
    buffers = [t.untyped_storage().data_ptr() for t in (state.keys[0], state.values[0])]
    for _ in range(MEMORY_ROOM // 2):  # the memory slides (mem_len 16) inside the same buffers
        _, state = model(torch.randint(0, 256, (batch, 1)), state)
    assert [t.untyped_storage().data_ptr() for t in (state.keys[0], state.values[0])] == buffers
    assert state.keys[0].shape == state.values[0].shape == (batch, 16, 2, 16)
    for row in range(batch):
        for memory in (state.keys[0], state.values[0]):  # each head's keys and values: (M, D) rows
            assert all(memory[row, :, h].is_contiguous() for h in range(2))


@torch.inference_mode()
def test_concatenated_rows_decode_in_place_from_their_first_step():
    """Batching rows (XLMemory.concat) writes them into buffers with room in the batch's layout,
    so the batch's first step appends instead of copying every memory a second time; the rows'
    own states are untouched and the padding is zeros."""
    model = small_model()
    _, short = model(torch.randint(0, 256, (1, 3)), model.init_state(1))
    _, long = model(torch.randint(0, 256, (1, 9)), model.init_state(1))
    before = [snapshot(short), snapshot(long)]
    batch = XLMemory.concat([short, long])
    assert batch.length == 9 and batch.valid.tolist() == [[False] * 6 + [True] * 3, [True] * 9]
    for layer in range(2):
        padded = torch.cat([torch.zeros(1, 6, 2, 16), short.keys[layer]], dim=1)
        assert torch.equal(batch.keys[layer], torch.cat([padded, long.keys[layer]]))
    buffers = [t.untyped_storage().data_ptr() for t in (*batch.keys, *batch.values)]
    _, after = model(torch.randint(0, 256, (2, 1)), batch)
    assert [t.untyped_storage().data_ptr() for t in (*after.keys, *after.values)] == buffers
    assert same(snapshot(short), before[0]) and same(snapshot(long), before[1])


@pytest.mark.parametrize("rows", [[0, 2, 3], [1, 3], [3, 0]])
@torch.inference_mode()
def test_take_keeps_rows_like_split_and_concat_and_decodes_in_place(rows):
    """XLMemory.take (the rows a batch keeps when others leave) equals concatenating those rows'
    splits, drops padding that no kept row needs, leaves the batch as it was, and the result's
    first step appends in place."""
    model = small_model()
    rows_in = [torch.randint(0, 256, (1, n)) for n in (4, 12, 7, 9)]
    states = [model(tokens, model.init_state(1))[1] for tokens in rows_in]
    batch = XLMemory.concat(states)
    _, batch = model(torch.randint(0, 256, (4, 1)), batch)
    before = snapshot(batch)
    taken = batch.take(rows)
    parts = batch.split()
    expected = XLMemory.concat([parts[i] for i in rows])
    assert same(snapshot(taken), snapshot(expected))
    assert taken.length == max(parts[i].length for i in rows)
    assert same(snapshot(batch), before)
    buffers = [t.untyped_storage().data_ptr() for t in (*taken.keys, *taken.values)]
    step = torch.randint(0, 256, (len(rows), 1))
    log_probs, after = model(step, taken)
    assert [t.untyped_storage().data_ptr() for t in (*after.keys, *after.values)] == buffers
    torch.testing.assert_close(log_probs, model(step, expected)[0], rtol=0, atol=1e-6)


@torch.inference_mode()
def test_put_row_gives_a_new_row_the_place_of_another_in_place():
    """XLMemory.put_row writes a row into one place of a batch (left-padded to the batch's
    length) without touching the other rows or moving the buffers; the batch then decodes that
    row as it would alone. A row with a longer memory than the batch's does not fit."""
    model = small_model()
    _, batch = model(torch.randint(0, 256, (3, 10)), model.init_state(3))
    _, batch = model(torch.randint(0, 256, (3, 1)), XLMemory.concat(batch.split()))
    _, newcomer = model(torch.randint(0, 256, (1, 4)), model.init_state(1))
    others = [snapshot(row) for row in batch.split()]
    buffers = [t.untyped_storage().data_ptr() for t in (*batch.keys, *batch.values)]
    assert batch.put_row(1, newcomer)
    assert [t.untyped_storage().data_ptr() for t in (*batch.keys, *batch.values)] == buffers
    rows = batch.split()
    assert same(snapshot(rows[0]), others[0]) and same(snapshot(rows[2]), others[2])
    assert same(snapshot(rows[1]), snapshot(newcomer))
    step = torch.randint(0, 256, (3, 1))
    batched, _ = model(step, batch)
    torch.testing.assert_close(batched[1], model(step[1:2], newcomer)[0][0], rtol=0, atol=1e-5)
    _, longer = model(torch.randint(0, 256, (1, 14)), model.init_state(1))
    assert not batch.put_row(0, longer)


@pytest.mark.parametrize("memory", [16, 48])
@torch.inference_mode()
def test_decoding_scores_positions_with_the_kept_head_major_tables(memory):
    """One decoding row and a batch of two read each layer's table W_kR R_d, kept head-major
    (each head's distances contiguous) as an (R, H, D) view holding exactly W_kR R_d; both rows of
    the batch agree with the single row, over fewer positions than d_model (32) and more."""
    for clamp_len in (-1, 6):
        model = small_model(clamp_len=clamp_len, mem_len=memory)
        prompt = torch.randint(0, 256, (1, memory + 4))
        _, state = model(prompt, model.init_state(1))
        step = torch.randint(0, 256, (1, 1))
        single, _ = model(step, state)
        encoding, tables = model.relative_keys([layer.r_net for layer in model.layers], 0, memory, like=model.r_w_bias)
        c = model.config
        for layer, table in zip(model.layers, tables):
            assert table.shape == (memory + 1, c.n_head, c.d_head)
            assert table.stride() == (c.d_head, table.untyped_storage().nbytes() // (4 * c.n_head), 1)  # head-major
            torch.testing.assert_close(table, layer.r_net(encoding).view(-1, c.n_head, c.d_head))
        _, pair_state = model(prompt.expand(2, -1), model.init_state(2))
        pair, _ = model(step.expand(2, -1), pair_state)
        torch.testing.assert_close(pair, single.expand(2, -1, -1), rtol=0, atol=1e-5)
