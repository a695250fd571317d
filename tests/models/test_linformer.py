"""The causal Linformer (Wang et al. 2020, served by segments): the attention against a brute-force
reference of its definition (E·K and F·V of each completed segment, causal keys of the open one),
the chunking invariant, batching, the bounded state, checkpoints, state checks and training."""

from dataclasses import replace

import pytest
import torch

import xlserve.models.linformer as linformer
from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models.linformer import CompressedSegmentMemory, Linformer, LinformerConfig, pooling_projection
from xlserve.models.registry import build_model
from xlserve.models.training.presets import preset_config
from xlserve.models.training.train import STANDARD_RECIPE, train
from tests.models.helpers import (
    assert_rows_batch_like_single_rows, assert_same_as_one_pass, assert_state_round_trips,
    run_in_chunks, state_bytes_after_4_kb_and_64_kb, tokens,
)

L, K, M = 8, 3, 3  # segment length, compressed slots per segment, compressed segments kept
H, D = 2, 8


def small_model(**overrides) -> Linformer:
    torch.manual_seed(0)
    settings = dict(n_layer=2, d_model=32, n_head=H, d_head=D, d_inner=64, segment_len=L, compressed_len=K,
                    memory_segments=M)
    model = Linformer(LinformerConfig(**{**settings, **overrides})).eval()
    with torch.no_grad():  # projections and biases far from their start, so that they matter
        for layer in model.layers:
            layer.attention.slot_bias.normal_(std=1.0)
            layer.attention.key_projection.normal_(std=0.5)
            layer.attention.value_projection.normal_(std=0.5)
    return model


def reference_attention(attention, x: torch.Tensor) -> torch.Tensor:
    """The attention output (1, n, d_model) for the layer inputs x (1, n, d_model) of a whole text,
    query by query from the definition: query i of segment s = i div L sees, for each age
    a = 1 .. M with s − a >= 0, the k slots E·K_{s−a} (bias b_h[M − a, r]) and F·V_{s−a}, and the
    keys j = sL .. i of its own segment (bias 0); one softmax over all of them."""
    n = x.shape[1]
    q, k, v = attention.qkv_net(x)[0].view(n, 3, H, D).unbind(1)  # (n, H, D) each
    E, F = attention.key_projection, attention.value_projection  # (k, L)
    out = torch.zeros(n, H, D)
    for i in range(n):
        s = i // L
        for h in range(H):
            scores, values = [], []
            for a in range(1, M + 1):
                if s - a < 0:
                    continue
                segment = slice((s - a) * L, (s - a + 1) * L)
                scores.append((E @ k[segment, h]) @ q[i, h] / D ** 0.5 + attention.slot_bias[h, M - a])  # (k,)
                values.append(F @ v[segment, h])  # (k, D)
            scores.append(k[s * L : i + 1, h] @ q[i, h] / D ** 0.5)
            values.append(v[s * L : i + 1, h])
            out[i, h] = torch.cat(scores).softmax(0) @ torch.cat(values)
    return attention.o_net(out.reshape(1, n, H * D))


def sees(i: int, j: int) -> bool:
    """Whether query i depends on position j through one layer: j in its own segment up to i,
    or anywhere in one of the M segments before it (through their compressed slots)."""
    si, sj = i // L, j // L
    return (si == sj and j <= i) or si - M <= sj <= si - 1


# -- (a) the attention pattern and weights ---------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64, 80])
def test_every_layer_attends_as_the_brute_force_definition(chunk):
    """Served from the state in any chunking, over ten segments (the memory of three full and
    shifting), every layer's attention output is the reference's for the inputs it was given."""
    model = small_model()
    n = 80
    calls = [[] for _ in model.layers]
    hooks = [layer.attention.register_forward_hook(lambda m, args, out, i=i: calls[i].append((args[0], out[0])))
             for i, layer in enumerate(model.layers)]
    run_in_chunks(model, tokens(1, n, 1), chunk)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for recorded, layer in zip(calls, model.layers):
            inputs = torch.cat([x for x, _ in recorded], dim=1)  # (1, n, d_model)
            served = torch.cat([y for _, y in recorded], dim=1)
            assert (served - reference_attention(layer.attention, inputs)).abs().max().item() < 1e-5


def test_a_query_depends_exactly_on_its_segment_and_the_compressed_ones_before_it():
    """One layer, a call that starts mid-segment after a history: the log-probs of query i have a
    gradient with respect to position j (a token of the call, an open slot or a compressed
    group of the state) exactly where `sees(i, j)`: causal, and the oldest segments dropped."""
    model = small_model(n_layer=1)
    history, chunk = tokens(1, 13, 2), tokens(1, 40, 3)
    start = history.shape[1]
    with torch.no_grad():
        _, state = model(history, model.init_state(1))
    leaves = [t.clone().requires_grad_(True) for t in (state.open_keys[0], state.open_values[0],
                                                       state.slot_keys[0], state.slot_values[0])]
    embedded = []
    hook = model.embedding.register_forward_hook(lambda m, args, out: embedded.append(out) or out.retain_grad())
    log_probs, _ = model(chunk, CompressedSegmentMemory([leaves[0]], [leaves[1]], [leaves[2]], [leaves[3]],
                                                         state.position))
    hook.remove()
    segment_start, completed = start - start % L, start // L
    for t in range(chunk.shape[1]):
        for tensor in leaves + embedded:
            tensor.grad = None
        log_probs[0, t, 7].backward(retain_graph=True)
        seen = set()
        for j in range(L):  # open slot j: position segment_start + j
            if (leaves[0].grad[0, :, j].abs().sum() + leaves[1].grad[0, :, j].abs().sum()) > 0:
                seen.add(segment_start + j)
        for m in range(M):  # group m: segment completed − M + m, all its positions
            if (leaves[2].grad[0, :, m].abs().sum() + leaves[3].grad[0, :, m].abs().sum()) > 0:
                segment = completed - M + m
                seen |= set(range(segment * L, (segment + 1) * L))
        for u in range(chunk.shape[1]):
            if embedded[0].grad[0, u].abs().sum() > 0:
                seen.add(start + u)
        i = start + t
        assert seen == {j for j in range(i + 1) if sees(i, j)}, i


def test_the_future_never_changes_the_past():
    """The published Linformer is not causal (E mixes the whole sequence); this one is: changing a
    token changes no log-prob before it, in a text of many segments."""
    model = small_model()
    text = tokens(1, 100, 4)
    a, _ = run_in_chunks(model, text, 100)
    for j in (5, 8, 47, 99):
        changed = text.clone()
        changed[0, j] = (changed[0, j] + 1) % 256
        b, _ = run_in_chunks(model, changed, 100)
        assert torch.equal(a[:, :j], b[:, :j])
        assert not torch.equal(a[:, j], b[:, j])


def test_a_decode_step_attends_to_the_bounded_memory_only(monkeypatch):
    model = small_model()
    with torch.no_grad():
        _, state = model(tokens(1, 501, 5), model.init_state(1))  # 501 = 62·8 + 5: mid-segment
    shapes = []
    original = linformer.F.scaled_dot_product_attention
    monkeypatch.setattr(linformer.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: shapes.append(tuple(k.shape)) or original(q, k, v, **kw))
    with torch.no_grad():
        model(tokens(1, 1, 6), state)
    assert shapes == [(1, H, M * K + L + 1, D)] * 2  # M·k slots, the L open slots, the new position


# -- (b) the chunking invariant -------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_any_chunking_gives_the_one_pass_log_probs(chunk):
    model = small_model()
    text = tokens(2, 300, 7)  # 37 segments: the memory full and shifting many times
    assert_same_as_one_pass(model, text, chunk)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunks_with_the_tiny_preset(chunk):
    torch.manual_seed(0)
    model = build_model("linformer", preset_config("linformer", "tiny")).eval()
    text = tokens(1, 150, 8)  # 9 segments of 16, memory of 4
    whole, _ = run_in_chunks(model, text, 150)
    pieces, _ = run_in_chunks(model, text, chunk)
    assert (whole - pieces).abs().max().item() < 1e-5


def test_long_calls_run_in_pieces_with_the_same_result():
    model = small_model()
    text = tokens(1, 150, 9)
    whole, whole_state = run_in_chunks(model, text, 150)
    model.max_piece_positions = 5
    pieces, state = run_in_chunks(model, text, 150)
    assert (pieces - whole).abs().max().item() < 1e-5
    for a, b in zip(state._named_tensors(), whole_state._named_tensors()):
        assert (a[1] - b[1]).abs().max().item() < 1e-5, a[0]


# -- (c) batching ---------------------------------------------------------------------------------


def test_rows_of_different_histories_batch_like_single_rows():
    model = small_model()
    lengths = [0, 3, 8, 29, 333]  # fresh, mid-segment, on a boundary, memory filling, memory full
    histories = [tokens(1, n, 10 + n) for n in lengths]
    steps = tokens(5, 6, 11)  # crosses a boundary for some rows
    _, _, batch_state = assert_rows_batch_like_single_rows(model, histories, steps, tokens(5, 12, 12))
    parts = batch_state.split()
    assert [int(p.position) for p in parts] == [n + 18 for n in lengths]
    taken = batch_state.take([3, 1])
    assert torch.equal(taken.slot_keys[1][0], batch_state.slot_keys[1][3])
    assert taken.position.tolist() == [lengths[3] + 18, lengths[1] + 18]


def test_put_row_writes_a_row_in_place():
    model = small_model()
    with torch.no_grad():
        _, a = model(tokens(1, 4, 13), model.init_state(1))
        _, b = model(tokens(1, 45, 14), model.init_state(1))
        batch = CompressedSegmentMemory.concat([a, a.clone()])
        assert batch.put_row(1, b)
        step = tokens(2, 5, 15)
        out, _ = model(step, batch)
        alone, _ = model(step[1:], b)
    assert (out[1] - alone[0]).abs().max().item() < 1e-5
    assert int(batch.position[1]) == 45 and torch.equal(batch.open_values[0][1], b.open_values[0][0])
    with torch.enable_grad():
        assert not batch.put_row(0, b)  # never under autograd


# -- (d) the state round-trips -------------------------------------------------------------------


def test_state_round_trips_through_safetensors_bit_identically(tmp_path):
    model = small_model()
    with torch.no_grad():
        _, state = model(tokens(1, 77, 16), model.init_state(1))
    assert isinstance(state, CompressedSegmentMemory)
    assert_state_round_trips(model, state, 77, tokens(1, 19, 17), tmp_path)  # 19 crosses two boundaries


# -- (e) bounded state ----------------------------------------------------------------------------


def test_state_bytes_are_equal_after_4_kb_and_64_kb_of_history():
    torch.manual_seed(0)
    model = build_model("linformer", preset_config("linformer", "tiny")).eval()
    c = model.config
    formula = 8 + c.n_layer * 2 * c.n_head * (c.segment_len + c.memory_segments * c.compressed_len) * c.d_head * 4
    at_4k, at_64k, _ = state_bytes_after_4_kb_and_64_kb(model, seed=18)
    assert at_4k == at_64k == formula == model.init_state(1).nbytes()
    # the preset that ships: L = 64 open slots and 8 segments of 16 slots per layer
    small = build_model("linformer", preset_config("linformer", "small"))
    assert small.init_state(1).nbytes() == 8 + 4 * 2 * 4 * (64 + 8 * 16) * 48 * 4 == 1_179_656
    assert 1_800_000 <= sum(p.numel() for p in small.parameters()) <= 2_000_000


# -- (f) checkpoints ------------------------------------------------------------------------------


def test_save_and_load_give_identical_log_probs(tmp_path):
    model = small_model()
    save_checkpoint(model, tmp_path / "linformer")
    loaded = load_checkpoint(tmp_path / "linformer")
    text = tokens(1, 60, 19)
    with torch.no_grad():
        a, _ = model(text, model.init_state(1))
        b, _ = loaded(text, loaded.init_state(1))
    assert torch.equal(a, b)
    assert loaded.state_kind == "window" and not loaded.state_grows_with_context and loaded.max_context is None
    assert loaded.chunking_invariant
    assert torch.equal(loaded.layers[1].attention.key_projection, model.layers[1].attention.key_projection)


# -- (g) checking states from outside -------------------------------------------------------------


def test_check_state_accepts_real_states_and_refuses_poisoned_ones():
    model = small_model()
    model.check_state(model.init_state(1), 0)
    with torch.no_grad():
        for n in (1, 5, L, L * M, L * M + 3, 300):
            model.check_state(model(tokens(1, n, 20), model.init_state(1))[1], n)
        _, state = model(tokens(1, 13, 21), model.init_state(1))  # one segment done, 5 open positions
    good = state.to_tensors()

    def refused(changes: dict, match: str, tokens_seen: int = 13):
        poisoned = {**{k: v.clone() for k, v in good.items()}, **changes}
        with pytest.raises(ValueError, match=match):
            model.check_state(CompressedSegmentMemory.from_tensors(poisoned), tokens_seen)

    def changed(name: str, edit):
        tensor = good[name].clone()
        edit(tensor)
        return {name: tensor}

    refused(changed("slot_keys.0", lambda t: t.view(-1).__setitem__(-1, float("nan"))), "'slot_keys.0' holds NaN")
    refused(changed("open_values.1", lambda t: t.view(-1).__setitem__(0, float("inf"))), "'open_values.1' holds NaN")
    refused({"open_keys.1": good["open_keys.1"][:, :, 1:]}, "'open_keys.1'.*dimension 2 must be 8")  # a slot short
    refused({"slot_values.0": good["slot_values.0"][:, :, 1:]}, "'slot_values.0'.*dimension 2 must be 3")  # a group short
    refused({"position": torch.tensor([13], dtype=torch.int32)}, "'position' is torch.int32")
    # 12 positions would leave offset 4 of the open segment empty: it is not
    refused({"position": torch.tensor([12])}, r"'open_keys.0' holds values in slots .*position \[12\]", tokens_seen=12)
    refused({}, "'position' says 13", tokens_seen=14)
    refused({"position": torch.tensor([-1])}, "'position' holds a negative")
    refused(changed("open_keys.0", lambda t: t[0, 1, 5].fill_(1.0)), "'open_keys.0' holds values in slots")  # offset 5: empty
    refused(changed("slot_values.1", lambda t: t[0, 0, 1].fill_(0.5)), "'slot_values.1' holds values in slots")  # no such segment
    with pytest.raises(ValueError, match="do not match"):
        model.check_state(CompressedSegmentMemory.from_tensors({k: v for k, v in good.items() if k != "slot_keys.1"}))
    written = {**good, **changed("slot_keys.1", lambda t: t[0, 0, 2].fill_(0.5))}  # group 2: segment 0, plausible
    model.check_state(CompressedSegmentMemory.from_tensors(written), 13)


# -- training -------------------------------------------------------------------------------------


def test_three_training_steps_with_the_standard_loop(tmp_path):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 3, batch_size=4, segment_len=32, eval_every=1000,
                     save_every=3, quick_eval_bytes=2000, warmup_steps=2)
    model = train("linformer", "tiny", tmp_path / "lin", recipe, log=lambda s: None)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # a 32-byte step spans two segments of 16: the second sees the first compressed, so E learned
    c = model.config
    assert not torch.equal(model.layers[0].attention.key_projection.detach(),
                           pooling_projection(c.compressed_len, c.segment_len))
    loaded = load_checkpoint(tmp_path / "lin")
    text = tokens(1, 50, 22)
    with torch.no_grad():
        assert torch.equal(model(text, model.init_state(1))[0], loaded(text, loaded.init_state(1))[0])


def test_projections_learn_from_segments_completed_inside_a_call():
    """E and F get gradients where a query of the same call sees a segment completed in it;
    slots carried in the state are detached, so a call inside one segment gives E none."""
    model = small_model().train()
    with torch.no_grad():
        _, state = model(tokens(2, 3 * L, 23), model.init_state(2))
    for length, learns in ((L, False), (2 * L, True)):
        model.zero_grad()
        log_probs, _ = model(tokens(2, length, 24), state)
        (-log_probs.gather(-1, tokens(2, length, 25)[..., None]).mean()).backward()
        for layer in model.layers:
            attention = layer.attention
            assert attention.slot_bias.grad.abs().sum() > 0  # the state's slots are attended to either way
            for projection in (attention.key_projection, attention.value_projection):
                assert (projection.grad is not None and projection.grad.abs().sum() > 0) == learns


def test_pooling_projection_averages_contiguous_runs():
    assert torch.equal(pooling_projection(2, 4), torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]]))
    projection = pooling_projection(3, 8)
    assert torch.allclose(projection.sum(1), torch.ones(3)) and bool(((projection > 0).sum(0) == 1).all())
