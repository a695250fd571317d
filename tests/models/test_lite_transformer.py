"""The Lite Transformer (Wu et al. 2020): its Long-Short Range Attention (a windowed attention
half with a per-distance bias, a causal dynamic or lightweight convolution half), the chunking
invariant, batching, the bounded state and its checks."""

from dataclasses import replace

import pytest
import torch

from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models.layers.causal_conv import ConvWindowMemory
from xlserve.models.lite_transformer import LiteTransformer, LiteTransformerConfig
from xlserve.models.registry import build_model
from xlserve.models.training.presets import preset_config
from xlserve.models.training.train import STANDARD_RECIPE, train
from tests.models.helpers import (
    assert_rows_batch_like_single_rows, assert_same_as_one_pass, assert_state_round_trips,
    run_in_chunks, state_bytes_after_4_kb_and_64_kb, tokens,
)

M = 6  # mem_len: a query sees itself and the 5 positions before it
KERNELS = [3, 5, 2]  # a convolution width per layer
H = 2  # attention heads over the 16 attention channels (D = 8)


def small_model(conv_type: str = "dynamic", **overrides) -> LiteTransformer:
    torch.manual_seed(0)
    settings = dict(n_layer=3, d_model=32, n_head=H, mem_len=M, conv_type=conv_type, n_conv_head=2,
                    conv_kernel=KERNELS, d_inner=32)
    model = LiteTransformer(LiteTransformerConfig(**{**settings, **overrides})).eval()
    with torch.no_grad():  # biases and kernels far enough from uniform to matter in the log-probs
        for layer in model.layers:
            layer.attention.attention.distance_bias.normal_(std=1.0)
            convolution = layer.attention.convolution
            if convolution.kernel_net is not None:
                convolution.kernel_net.weight.normal_(std=0.5)
            else:
                convolution.kernel_logits.normal_(std=1.0)
    return model


def reference_bias(attention, n: int) -> torch.Tensor:
    """(H, n, n) from the definition, position by position: query i sees key j when
    0 <= i − j < M, with bias r_h[i − j]; −inf elsewhere (the future, and the rest of the past)."""
    out = torch.full((H, n, n), float("-inf"))
    for h in range(H):
        for i in range(n):
            for j in range(max(0, i - M + 1), i + 1):
                out[h, i, j] = attention.distance_bias[h, i - j]
    return out


def reference_convolution(u: torch.Tensor, weights: torch.Tensor, groups: int) -> torch.Tensor:
    """out[b, t, c] = Σ_k w[b, t, g(c), k] · u[b, t − K + 1 + k, c], u = 0 before position 0,
    g(c) = c // (C / groups), summed term by term; u (B, T, C), weights (B, T, groups, K)."""
    B, T, C = u.shape
    K = weights.shape[-1]
    out = torch.zeros(B, T, C)
    for t in range(T):
        for k in range(K):
            s = t - K + 1 + k
            if s >= 0:
                for c in range(C):
                    out[:, t, c] += weights[:, t, c // (C // groups), k] * u[:, s, c]
    return out


# -- (a) the attention window, the convolution's receptive field and kernels ---------------------


def test_attention_branch_is_dense_attention_under_the_window_mask():
    """Served token by token from the ring buffer, the first layer's attention branch equals
    softmax(q kᵀ/√D + bias) v computed densely over the whole text with the reference mask."""
    model = small_model()
    n = 30
    text = tokens(1, n, 2)
    attention = model.layers[0].attention.attention
    outputs = []
    hook = attention.register_forward_hook(lambda m, args, out: outputs.append(out[0]))
    run_in_chunks(model, text, 1)
    hook.remove()
    served = torch.cat(outputs, dim=1)  # (1, n, 16)
    with torch.no_grad():
        x = model.layers[0].attn_norm(model.embedding(text))[..., :16]  # the attention half
        q, k, v = attention.qkv_net(x).view(1, n, 3, H, 8).permute(2, 0, 3, 1, 4)  # (1, H, n, D)
        scores = q @ k.transpose(-1, -2) / 8 ** 0.5 + reference_bias(attention, n)[None]
        expected = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, n, -1)
    assert (served - expected).abs().max().item() < 1e-5


def test_attention_gradients_reach_exactly_the_window_across_calls():
    """Query i's output depends on the inputs at i − M + 1 .. i and no other, also where they
    come from the previous call through the ring (not detached here: one module, two calls)."""
    model = small_model()
    attention = model.layers[0].attention.attention
    first, second = torch.randn(1, 9, 16, requires_grad=True), torch.randn(1, 8, 16, requires_grad=True)
    state = model.init_state(1)
    _, keys, values = attention(first, state.position, state.keys[0], state.values[0])
    out, _, _ = attention(second, state.position + 9, keys, values)  # positions 9 .. 16
    for t in range(8):
        i = 9 + t
        grads = torch.autograd.grad(out[0, t].sum(), [first, second], retain_graph=True)
        reached = torch.cat(grads, dim=1)[0].abs().sum(-1) > 0  # (17,) over absolute positions
        assert reached.tolist() == [i - M < j <= i for j in range(17)], i


@pytest.mark.parametrize("conv_type", ["dynamic", "lightweight"])
def test_convolution_is_causal_over_exactly_k_positions(conv_type):
    model = small_model(conv_type)
    convolution = model.layers[1].attention.convolution  # K = 5
    K = convolution.kernel
    x = torch.randn(1, 12, 16, requires_grad=True)
    out, _ = convolution(x, model.init_state(1).conv_inputs[1])
    for t in range(12):
        (grad,) = torch.autograd.grad(out[0, t].sum(), x, retain_graph=True)
        assert (grad[0].abs().sum(-1) > 0).tolist() == [t - K < s <= t for s in range(12)], t


@pytest.mark.parametrize("conv_type", ["dynamic", "lightweight"])
def test_convolution_matches_the_definition_and_its_kernels_sum_to_one(conv_type):
    """Softmax-normalised kernels (positive, 1 per group over the K taps), shared by the channels
    of a group; the output is the term-by-term sum, in one call or a token at a time."""
    model = small_model(conv_type)
    convolution = model.layers[1].attention.convolution
    x = torch.randn(2, 10, 16)
    with torch.no_grad():
        u = torch.nn.functional.glu(convolution.glu_net(x), dim=-1)  # (2, 10, 16)
        weights = convolution.kernels(u)
        if conv_type == "dynamic":
            assert weights.shape == (2, 10, 2, 5)  # one kernel per position, from its own input
            assert not torch.allclose(weights[:, 0], weights[:, 1])
        else:
            assert weights.shape == (2, 5)  # one kernel per group, for every position
            weights = weights.expand(2, 10, 2, 5)
        assert bool((weights > 0).all())
        assert (weights.sum(-1) - 1).abs().max().item() < 1e-6
        expected = reference_convolution(u, weights, groups=2)
        whole, recent = convolution(x, model.init_state(2).conv_inputs[1])
        assert (whole - expected).abs().max().item() < 1e-6
        assert torch.equal(recent, u[:, -4:])  # the last K − 1 inputs, oldest first
        recent, steps = model.init_state(2).conv_inputs[1], []
        for t in range(10):
            step, recent = convolution(x[:, t : t + 1], recent)
            steps.append(step)
        assert (torch.cat(steps, dim=1) - expected).abs().max().item() < 1e-6


def test_nothing_beyond_the_receptive_field_is_seen():
    model = small_model()
    assert model.receptive_field == 1 + 5 + 5 + 5  # max(M − 1, K − 1) per layer
    assert model.max_context is None  # served from its state, any history
    text = tokens(1, 60, 3)
    changed = text.clone()
    changed[0, 0] = (changed[0, 0] + 1) % 256
    a, _ = run_in_chunks(model, text, 60)
    b, _ = run_in_chunks(model, changed, 60)
    reach = model.receptive_field
    assert (a[:, reach:] - b[:, reach:]).abs().max().item() < 1e-6
    assert not torch.equal(a[:, reach - 1], b[:, reach - 1])
    wide = small_model(mem_len=3, conv_kernel=[6, 2, 2])  # the convolution reaches farther than the window
    assert wide.receptive_field == 1 + 5 + 2 + 2


# -- (b) the chunking invariant -------------------------------------------------------------------


@pytest.mark.parametrize("conv_type", ["dynamic", "lightweight"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_any_chunking_gives_the_one_pass_log_probs(chunk, conv_type):
    model = small_model(conv_type)
    text = tokens(2, 150, 5)  # 25 times mem_len
    assert_same_as_one_pass(model, text, chunk)


def test_long_calls_run_in_pieces_with_the_same_result():
    model = small_model()
    text = tokens(1, 100, 6)
    whole, _ = run_in_chunks(model, text, 100)
    model.max_piece_positions = 16
    pieces, _ = run_in_chunks(model, text, 100)
    assert (pieces - whole).abs().max().item() < 1e-5


def test_a_decode_step_reads_only_the_window():
    model = small_model()
    with torch.no_grad():
        _, state = model(tokens(1, 200, 7), model.init_state(1))
        attention = model.layers[2].attention.attention
        keys, original = [], attention.attend
        attention.attend = lambda q, k, v, bias: keys.append(k.shape[2]) or original(q, k, v, bias)
        model(tokens(1, 1, 8), state)
    assert keys == [M]


# -- (c) batching ---------------------------------------------------------------------------------


def test_rows_of_different_histories_batch_like_single_rows():
    model = small_model()
    histories = [tokens(1, 0, 9), tokens(1, 2, 10), tokens(1, 9, 11), tokens(1, 150, 12)]
    step = tokens(4, 5, 13)
    batch_state, parts, _ = assert_rows_batch_like_single_rows(model, histories, step, step[:, :1])
    with torch.no_grad():
        taken = batch_state.take([3, 1])
        assert taken.position.tolist() == [batch_state.position[3].item(), batch_state.position[1].item()]
        assert torch.equal(taken.conv_inputs[1][0], batch_state.conv_inputs[1][3])
        assert batch_state.put_row(0, parts[2])


# -- (d) the state round-trips -------------------------------------------------------------------


def test_state_round_trips_through_safetensors_bit_identically(tmp_path):
    model = small_model()
    with torch.no_grad():
        _, state = model(tokens(1, 77, 14), model.init_state(1))
    assert isinstance(state, ConvWindowMemory)
    assert_state_round_trips(model, state, 77, tokens(1, 9, 15), tmp_path)


# -- (e) bounded state ----------------------------------------------------------------------------


def test_state_bytes_are_equal_after_4_kb_and_64_kb_of_history():
    torch.manual_seed(0)
    model = build_model("lite-transformer", preset_config("lite-transformer", "tiny")).eval()
    c = model.config
    at_4k, at_64k, _ = state_bytes_after_4_kb_and_64_kb(model, seed=16)
    formula = 8 + sum(4 * (c.d_model // 2) * (2 * (c.mem_len - 1) + K - 1) for K in model.kernels)
    assert at_4k == at_64k == formula == model.init_state(1).nbytes()


# -- (f) checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("conv_type", ["dynamic", "lightweight"])
def test_save_and_load_give_identical_log_probs(tmp_path, conv_type):
    model = small_model(conv_type)
    save_checkpoint(model, tmp_path / "lite")
    loaded = load_checkpoint(tmp_path / "lite")
    text = tokens(1, 60, 17)
    with torch.no_grad():
        a, _ = model(text, model.init_state(1))
        b, _ = loaded(text, loaded.init_state(1))
    assert torch.equal(a, b)
    assert loaded.state_kind == "window" and not loaded.state_grows_with_context and loaded.chunking_invariant
    assert loaded.kernels == KERNELS and loaded.config.conv_type == conv_type


# -- (g) checking states from outside -------------------------------------------------------------


def test_check_state_accepts_real_states_and_refuses_poisoned_ones():
    model = small_model()
    model.check_state(model.init_state(1), 0)
    with torch.no_grad():
        for n in (1, 2, 5, 100):
            model.check_state(model(tokens(1, n, 18), model.init_state(1))[1], n)
        _, state = model(tokens(1, 3, 19), model.init_state(1))  # ring slots 3, 4 and conv_inputs.1 row 0 empty

    def poisoned(change, source=state):
        tensors = {name: t.clone() for name, t in source.to_tensors().items()}  # to_tensors may share storage
        change(tensors)
        return ConvWindowMemory.from_tensors(tensors)

    cases = [
        (lambda t: t["keys.0"].view(-1).__setitem__(0, float("nan")), "'keys.0' holds NaN"),
        (lambda t: t["conv_inputs.1"].view(-1).__setitem__(-1, float("inf")), "'conv_inputs.1' holds NaN or infinite"),
        (lambda t: t.__setitem__("values.1", torch.zeros(1, H, M, 8)), "'values.1' has shape"),
        (lambda t: t.__setitem__("keys.2", t["keys.2"][:, :, :4]), "'keys.2' has shape"),
        (lambda t: t.__setitem__("conv_inputs.0", torch.zeros(1, 3, 16)), "'conv_inputs.0' has shape"),
        (lambda t: t.__setitem__("position", torch.tensor([-1])), "'position' holds a negative"),
        (lambda t: t.__setitem__("position", torch.tensor([3.0])), "'position' is torch.float32"),
        (lambda t: t["keys.0"][0, 1, 4].fill_(1.0), "'keys.0' holds values in slots that no position has reached"),
        (lambda t: t["conv_inputs.1"][0, 0].fill_(0.5), "'conv_inputs.1' holds values in slots that no position has reached"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            model.check_state(poisoned(change), 3)
    with pytest.raises(ValueError, match="do not match"):
        model.check_state(poisoned(lambda t: t.pop("values.2")), 3)
    model.check_state(poisoned(lambda t: t["values.1"][0, 1, 2].fill_(0.5)), 3)  # a written slot: plausible
    model.check_state(poisoned(lambda t: t["conv_inputs.1"][0, 1].fill_(0.5)), 3)  # position 0's input
    with pytest.raises(ValueError, match="'position' says 3 tokens"):
        model.check_state(state, 4)  # the session says 4 tokens, the state 3
    with pytest.raises(ValueError, match=r"'conv_inputs.\d' holds \d batch rows"):
        model.check_state(poisoned(lambda t: t.__setitem__("conv_inputs.0", t["conv_inputs.0"].repeat(2, 1, 1))))


# -- training -------------------------------------------------------------------------------------


def test_three_training_steps_with_the_standard_loop(tmp_path):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 3, batch_size=4, segment_len=32, eval_every=1000,
                     save_every=3, quick_eval_bytes=2000, warmup_steps=2)
    model = train("lite-transformer", "tiny", tmp_path / "lite", recipe, log=lambda s: None)
    loaded = load_checkpoint(tmp_path / "lite")
    text = tokens(1, 50, 20)
    with torch.no_grad():
        assert torch.equal(model(text, model.init_state(1))[0], loaded(text, loaded.init_state(1))[0])


@pytest.mark.parametrize("conv_type", ["dynamic", "lightweight"])
def test_gradients_reach_both_branches(conv_type):
    model = small_model(conv_type, dropout=0.1, dropatt=0.1, weight_dropout=0.1).train()
    inputs, targets = tokens(2, 20, 21), tokens(2, 20, 22)
    _, state = model(tokens(2, 30, 23), model.init_state(2))  # a carried state, as in training
    log_probs, _ = model(inputs, state)
    (-log_probs.gather(-1, targets[..., None]).mean()).backward()
    for layer in model.layers:
        convolution = layer.attention.convolution
        kernel = convolution.kernel_net.weight if convolution.kernel_net is not None else convolution.kernel_logits
        assert layer.attention.attention.distance_bias.grad.abs().sum() > 0
        assert layer.attention.attention.qkv_net.weight.grad.abs().sum() > 0
        assert kernel.grad.abs().sum() > 0 and convolution.glu_net.weight.grad.abs().sum() > 0
