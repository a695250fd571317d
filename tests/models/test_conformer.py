"""The Conformer (Gulati et al. 2020) as a causal byte LM: its windowed relative attention and its
causal convolution against brute-force definitions, the chunking invariant, batching, the
fixed-size state and its checks, checkpoints, training."""

import math
from dataclasses import replace

import pytest
import torch
from torch.autograd.functional import jacobian

from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models.conformer import Conformer, ConformerConfig
from xlserve.models.layers.causal_conv import ConvWindowMemory
from xlserve.models.layers.relative import sinusoid_encoding
from xlserve.models.layers.ring_buffer import ring_positions
from xlserve.models.registry import build_model
from xlserve.models.training.presets import preset_config
from xlserve.models.training.train import STANDARD_RECIPE, train
from tests.models.helpers import (
    assert_rows_batch_like_single_rows, assert_state_round_trips, run_in_chunks,
    state_bytes_after_4_kb_and_64_kb, tokens,
)

MEM_LEN, KERNEL = 8, 5  # a query sees itself and 7 positions before it; the convolution 4 before it
D_MODEL, N_HEAD, D_HEAD = 32, 2, 8


def small_model(**overrides) -> Conformer:
    torch.manual_seed(0)
    settings = dict(n_layer=2, d_model=D_MODEL, n_head=N_HEAD, d_head=D_HEAD, d_inner=64, kernel_size=KERNEL,
                    mem_len=MEM_LEN)
    model = Conformer(ConformerConfig(**{**settings, **overrides})).eval()
    with torch.no_grad():  # weights large enough that attention is far from uniform and positions matter
        for layer in model.layers:
            layer.attention.qkv_net.weight.normal_(std=0.3)
            layer.attention.r_net.weight.normal_(std=0.3)
        model.r_w_bias.normal_(std=0.5)
        model.r_r_bias.normal_(std=0.5)
    return model


def relative_tables(model) -> list[torch.Tensor]:
    """W_kR R_d for d = 0 .. mem_len − 1, per layer: (mem_len, H, D)."""
    R = sinusoid_encoding(torch.arange(model.config.mem_len), model.config.d_model)
    return [layer.attention.r_net(R).view(-1, N_HEAD, D_HEAD) for layer in model.layers]


def empty_ring(batch=1):
    return torch.zeros(batch, N_HEAD, MEM_LEN - 1, D_HEAD)


def influence(output, inputs) -> torch.Tensor:
    """|d output / d inputs| summed over the feature dimensions: output (T, F) of inputs (S, G)
    -> (T, S), brute force through the full Jacobian."""
    J = jacobian(output, inputs)  # (T, F, S, G)
    return J.abs().sum(dim=(1, 3))


# -- (a) attention window and convolution, against their definitions ----------------------------


def test_attention_sees_itself_and_the_mem_len_minus_1_positions_before_it():
    """In one call, the attention output at t has a non-zero gradient with respect to the input at
    s exactly when 0 <= t − s <= mem_len − 1: causal, and nothing beyond the window."""
    model = small_model()
    attention, table = model.layers[0].attention, relative_tables(model)[0]
    T = 30
    x = torch.randn(T, D_MODEL, generator=torch.Generator().manual_seed(1))
    position = torch.zeros(1, dtype=torch.long)

    def output(inputs):
        return attention(inputs[None], position, empty_ring(), empty_ring(), table, model.r_w_bias[0],
                         model.r_r_bias[0])[0][0]

    seen = influence(output, x) > 0  # (T, T)
    distance = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    assert torch.equal(seen, (distance >= 0) & (distance <= MEM_LEN - 1))


def test_attention_reads_exactly_the_ring_slots_its_window_reaches():
    """After 20 positions, the next call's query t (position 20 + t) depends on the ring slot
    holding position p exactly when 1 <= 20 + t − p <= mem_len − 1 (the ring's slot rule)."""
    model = small_model()
    text = tokens(1, 20, 2)
    with torch.no_grad():
        _, state = model(text, model.init_state(1))
    attention, table = model.layers[1].attention, relative_tables(model)[1]
    x = torch.randn(1, 10, D_MODEL, generator=torch.Generator().manual_seed(3))

    def output(ring_keys):
        return attention(x, state.position, ring_keys[None], state.values[1], table, model.r_w_bias[1],
                         model.r_r_bias[1])[0][0]

    J = jacobian(output, state.keys[1][0])  # (T, d_model, H, C, D)
    seen = J.abs().sum(dim=(1, 2, 4)) > 0  # (T, C)
    distance = (20 + torch.arange(10))[:, None] - ring_positions(state.position, MEM_LEN - 1)  # (T, C)
    assert torch.equal(seen, (distance >= 1) & (distance <= MEM_LEN - 1))


def test_attention_output_is_the_relative_score_softmax_pair_by_pair():
    """Layer 0's attention output, served token by token from the ring, equals the definition
    computed densely over the whole text: s_ij = ((q_i + u)·k_j + (q_i + v)·W_kR R_{i−j}) / √D
    over 0 <= i − j <= mem_len − 1, softmax, weighted sum of values, output projection."""
    model = small_model()
    n = 30
    text = tokens(1, n, 4)
    block = model.layers[0]
    outputs = []
    hook = block.attention.register_forward_hook(lambda module, args, out: outputs.append(out[0]))
    run_in_chunks(model, text, 1)
    hook.remove()
    served = torch.cat(outputs, dim=1)[0]  # (n, d_model)
    with torch.no_grad():
        x = model.embedding(text)
        x = x + 0.5 * block.ff1(block.ff1_norm(x))  # x̃, the attention's input
        q, k, v = block.attention.qkv_net(block.attention.norm(x))[0].view(n, 3, N_HEAD, D_HEAD).unbind(1)
        table = relative_tables(model)[0]
        u, w = model.r_w_bias[0], model.r_r_bias[0]
        expected = torch.zeros(n, N_HEAD, D_HEAD)
        for i in range(n):
            for h in range(N_HEAD):
                window = range(max(0, i - MEM_LEN + 1), i + 1)
                scores = torch.stack([((q[i, h] + u[h]) @ k[j, h] + (q[i, h] + w[h]) @ table[i - j, h])
                                      / math.sqrt(D_HEAD) for j in window])
                expected[i, h] = sum(p * v[j, h] for p, j in zip(scores.softmax(0), window))
        expected = block.attention.o_net(expected.reshape(n, -1))
    assert (served - expected).abs().max().item() < 1e-5


def test_convolution_reads_itself_and_the_k_minus_1_positions_before_it():
    """The convolution module's output at t depends on its input at s exactly when
    0 <= t − s <= K − 1, and on the carried inputs exactly where they are among those K."""
    model = small_model()
    convolution = model.layers[0].convolution
    T = 20
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(T, D_MODEL, generator=generator)
    recent = torch.randn(KERNEL - 1, D_MODEL, generator=generator)
    seen = influence(lambda inputs: convolution(inputs[None], recent[None])[0][0], x) > 0  # (T, T)
    distance = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    assert torch.equal(seen, (distance >= 0) & (distance <= KERNEL - 1))
    # carried slot r holds position r − (K − 1) (before the chunk's first, 0)
    from_recent = influence(lambda r: convolution(x[None], r[None])[0][0], recent) > 0  # (T, K − 1)
    distance = torch.arange(T)[:, None] - (torch.arange(KERNEL - 1) - (KERNEL - 1))[None, :]
    assert torch.equal(from_recent, distance <= KERNEL - 1)
    # and the buffer after the chunk is its last K − 1 inputs of the depthwise convolution
    _, after = convolution(x[None], recent[None])
    assert after.shape == (1, KERNEL - 1, D_MODEL)


def test_the_model_sees_exactly_its_receptive_field_in_any_chunking():
    """Stacked, position t depends on bytes t − n_layer·(mem_len + K − 2) .. t: fed in chunks of 7
    through the state, changing the byte just beyond changes nothing, just inside it does."""
    model = small_model()
    reach = model.receptive_field
    assert reach == 1 + 2 * (MEM_LEN - 1 + KERNEL - 1)
    text = tokens(1, 60, 6)
    base, _ = run_in_chunks(model, text, 7)
    for offset, changes in ((reach, False), (reach - 1, True)):
        other = text.clone()
        other[0, 59 - offset] = (other[0, 59 - offset] + 1) % 256
        out, _ = run_in_chunks(model, other, 7)
        if changes:
            assert (out[0, 59] - base[0, 59]).abs().max().item() > 1e-6
        else:
            assert torch.equal(out[0, 59], base[0, 59])


def test_in_training_a_row_depends_on_neither_other_rows_nor_its_future():
    """The convolution module normalises each position over its channels (no batch statistics):
    even in training mode a row's log-probs are the same alone and in a batch, and changing later
    bytes changes nothing before them."""
    model = small_model().train()
    text = tokens(3, 40, 7)
    batched, _ = model(text, model.init_state(3))
    alone, _ = model(text[1:2], model.init_state(1))
    assert (batched[1] - alone[0]).abs().max().item() < 1e-5
    changed = text.clone()
    changed[:, 25:] = tokens(3, 15, 8)
    later, _ = model(changed, model.init_state(3))
    assert torch.equal(later[:, :25], batched[:, :25])


# -- (b) the chunking invariant -----------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_any_chunking_gives_the_one_pass_log_probs(chunk):
    model = small_model()
    text = tokens(2, 200, 9)  # 25 windows long
    whole, whole_state = run_in_chunks(model, text, 200)
    served, state = run_in_chunks(model, text, chunk)
    assert (served - whole).abs().max().item() < 1e-5
    assert torch.equal(state.position, whole_state.position)
    for (name, a), (_, b) in zip(state._named_tensors(), whole_state._named_tensors()):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-5, name


def test_long_calls_run_in_pieces_with_the_same_result():
    model = small_model()
    text = tokens(1, 150, 10)
    whole, _ = run_in_chunks(model, text, 150)
    model.max_piece_positions = 16
    pieces, _ = run_in_chunks(model, text, 150)
    assert (pieces - whole).abs().max().item() < 1e-5


def test_a_decode_step_reads_only_the_window():
    model = small_model()
    with torch.no_grad():
        _, state = model(tokens(1, 100, 11), model.init_state(1))
        keys = []
        hook = model.layers[1].attention.register_forward_hook(lambda m, args, out: keys.append(args[2].shape))
        model(tokens(1, 1, 12), state)
        hook.remove()
    assert keys == [(1, N_HEAD, MEM_LEN - 1, D_HEAD)]


# -- (c) batching -------------------------------------------------------------------------------


def test_rows_of_different_histories_batch_like_single_rows():
    model = small_model()
    histories = [tokens(1, 0, 13), tokens(1, 3, 14), tokens(1, 41, 15), tokens(1, 333, 16)]
    step = tokens(4, 5, 17)
    batch_state, parts, _ = assert_rows_batch_like_single_rows(model, histories, step, step[:, :1])
    with torch.no_grad():
        taken = batch_state.take([3, 1])
        assert taken.position.tolist() == [338, 8]
        again, _ = model(step[[3, 1], :2], taken)
        for i, row in enumerate([3, 1]):
            own, _ = model(step[row : row + 1, :2], parts[row])
            assert (again[i] - own[0]).abs().max().item() < 1e-5
        assert batch_state.put_row(0, parts[2])
        for (name, a), (_, b) in zip(batch_state._named_tensors(), parts[2]._named_tensors()):
            assert torch.equal(a[0], b[0]), name
        model.check_state(batch_state)
    assert not batch_state.put_row(0, parts[2])  # under autograd: refused, nothing changed


# -- (d) the state round-trips ------------------------------------------------------------------


def test_state_round_trips_through_safetensors_bit_identically(tmp_path):
    model = small_model()
    with torch.no_grad():
        _, state = model(tokens(1, 77, 18), model.init_state(1))
    assert isinstance(state, ConvWindowMemory)
    assert_state_round_trips(model, state, 77, tokens(1, 9, 19), tmp_path)


# -- (e) bounded state --------------------------------------------------------------------------


def test_state_bytes_are_equal_after_4_kb_and_64_kb_of_history():
    torch.manual_seed(0)
    model = build_model("conformer", preset_config("conformer", "tiny")).eval()
    c = model.config
    at_4k, at_64k, _ = state_bytes_after_4_kb_and_64_kb(model, seed=20)
    formula = 8 + c.n_layer * ((c.kernel_size - 1) * c.d_model + 2 * c.n_head * (c.mem_len - 1) * c.d_head) * 4
    assert at_4k == at_64k == formula == model.init_state(1).nbytes() == model.state_bytes()


def test_the_presets_sizes():
    torch.manual_seed(0)
    small = build_model("conformer", preset_config("conformer", "small"))
    assert 1.5e6 <= sum(p.numel() for p in small.parameters()) <= 2.5e6
    assert small.config.mem_len == 128 and small.config.kernel_size == 15


# -- (f) checkpoints ----------------------------------------------------------------------------


def test_save_and_load_give_identical_log_probs(tmp_path):
    model = small_model()
    save_checkpoint(model, tmp_path / "conformer")
    loaded = load_checkpoint(tmp_path / "conformer")
    assert isinstance(loaded, Conformer) and loaded.config == model.config
    text = tokens(1, 60, 21)
    with torch.no_grad():
        a, _ = model(text, model.init_state(1))
        b, _ = loaded(text, loaded.init_state(1))
    assert torch.equal(a, b)
    assert loaded.state_kind == "window" and not loaded.state_grows_with_context and loaded.max_context is None
    assert loaded.chunking_invariant


# -- (g) checking states from outside -----------------------------------------------------------


def test_check_state_accepts_real_states_and_refuses_poisoned_ones():
    model = small_model()
    model.check_state(model.init_state(1), 0)
    with torch.no_grad():
        for n in (1, 2, 5, 100):
            model.check_state(model(tokens(1, n, 22), model.init_state(1))[1], n)
        _, state = model(tokens(1, 60, 23), model.init_state(1))

    def poisoned(change, source=state):
        tensors = {name: t.clone() for name, t in source.to_tensors().items()}  # to_tensors may share storage
        change(tensors)
        return ConvWindowMemory.from_tensors(tensors)

    cases = [
        (lambda t: t["keys.0"].view(-1).__setitem__(0, float("nan")), "'keys.0' holds NaN"),
        (lambda t: t["conv_inputs.1"].view(-1).__setitem__(3, float("inf")), "'conv_inputs.1' holds NaN or infinite"),
        (lambda t: t.__setitem__("values.1", torch.zeros(1, N_HEAD, MEM_LEN, D_HEAD)), "'values.1' has shape"),
        (lambda t: t.__setitem__("keys.1", t["keys.1"][:, :, :3]), "'keys.1' has shape"),
        (lambda t: t.__setitem__("conv_inputs.0", torch.zeros(1, KERNEL, D_MODEL)), "'conv_inputs.0' has shape"),
        (lambda t: t.__setitem__("keys.0", t["keys.0"].double()), "'keys.0' is torch.float64"),
        (lambda t: t.__setitem__("position", torch.tensor([-1])), "negative"),
        # a state of 60 positions claiming 3: ring slots 3 .. 6 cannot have been written yet
        (lambda t: t.__setitem__("position", torch.tensor([3])), "'keys.0' holds values in slots that no position"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            model.check_state(poisoned(change), 60)
    with pytest.raises(ValueError, match="do not match"):
        model.check_state(poisoned(lambda t: t.pop("values.1")), 60)
    with pytest.raises(ValueError, match="'position' says 60 tokens"):
        model.check_state(state, 61)  # the session says 61 tokens, the state 60
    with torch.no_grad():
        _, early = model(tokens(1, 2, 24), model.init_state(1))
    model.check_state(early, 2)
    # after 2 positions, convolution slots 0 .. K − 4 hold nothing yet
    with pytest.raises(ValueError, match="'conv_inputs.1' holds values in slots that no position"):
        model.check_state(poisoned(lambda t: t["conv_inputs.1"][0, 0].fill_(1.0), early), 2)
    model.check_state(poisoned(lambda t: t["conv_inputs.1"][0, KERNEL - 2].fill_(0.5), early), 2)  # written: plausible


# -- training -----------------------------------------------------------------------------------


def test_three_training_steps_with_the_standard_loop(tmp_path):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 3, batch_size=4, segment_len=32, eval_every=1000,
                     save_every=3, quick_eval_bytes=2000, warmup_steps=2)
    model = train("conformer", "tiny", tmp_path / "cf", recipe, log=lambda s: None)
    assert isinstance(model, Conformer)
    loaded = load_checkpoint(tmp_path / "cf")
    text = tokens(1, 50, 25)
    with torch.no_grad():
        assert torch.equal(model(text, model.init_state(1))[0], loaded(text, loaded.init_state(1))[0])


def test_gradients_reach_every_parameter_through_a_carried_state():
    model = small_model().train()
    _, state = model(tokens(2, 30, 26), model.init_state(2))  # a carried state, as in training
    assert not any(t.requires_grad for _, t in state._named_tensors())
    log_probs, _ = model(tokens(2, 20, 27), state)
    (-log_probs.gather(-1, tokens(2, 20, 28)[..., None]).mean()).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
