"""models/layers/linear.py: the decode-speed linear layer computes nn.Linear's product."""

import pytest
import torch
import torch.nn.functional as F

from xlserve.models.layers.linear import MAX_ROWS, Linear, choose_kernels, linear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", [(96, 32), (32, 96), (40, 40)])  # wider out, wider in, square
@pytest.mark.parametrize("with_bias", [True, False])
def test_equals_f_linear(rows, shape, with_bias):
    torch.manual_seed(rows)
    weight = torch.randn(*shape)
    bias = torch.randn(shape[0]) if with_bias else None
    x = torch.randn(1, rows, shape[1])
    with torch.inference_mode():
        ours = linear(x, weight, bias)
    expected = F.linear(x, weight, bias)
    assert ours.shape == expected.shape == (1, rows, shape[0])
    assert ours.is_contiguous()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_inputs_of_any_layout():
    """Rows handed over as a transposed view (what a previous product may return) give the same result."""
    weight = torch.randn(64, 24)
    x = torch.randn(24, 2).t()[None]  # (1, 2, 24), column-major
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_training_and_many_rows_take_f_linear_bit_for_bit():
    layer = Linear(24, 64)
    layer.streaming = True
    x = torch.randn(3, 24, requires_grad=True)
    out = layer(x)  # grad enabled: F.linear itself
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    many = torch.randn(MAX_ROWS + 1, 24)
    with torch.inference_mode():
        assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))


def test_same_parameters_as_nn_linear():
    plain = torch.nn.Linear(24, 64)
    ours = Linear(24, 64)
    ours.load_state_dict(plain.state_dict())
    assert list(ours.state_dict()) == list(plain.state_dict())
    with torch.inference_mode():
        x = torch.randn(1, 24)
        torch.testing.assert_close(ours(x), plain(x), rtol=1e-5, atol=1e-5)


def test_layers_stay_on_f_linear_unless_switched_on():
    layer = Linear(24, 64)
    x = torch.randn(1, 24)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # off by default


def test_choose_kernels_by_model_size():
    """Small models stay in the cache and keep F.linear; large ones stream and switch over, in
    every layer that has the switch (the adaptive softmax included)."""
    from xlserve.models.registry import build_model
    from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig

    small = build_model("transformer-xl", {"n_layer": 1, "d_model": 32, "n_head": 2, "d_head": 16, "d_inner": 64})
    assert not any(getattr(m, "streaming", False) for m in small.modules())

    config = TransformerXLConfig(n_layer=1, d_model=32, n_head=2, d_head=16, d_inner=64, vocab_size=1000,
                                 adaptive=True, cutoffs=[100, 500], div_val=2, mem_len=8)
    model = TransformerXL(config).eval()
    assert choose_kernels(model, threshold=1000)
    switched = [m for m in model.modules() if hasattr(m, "streaming")]
    assert len(switched) >= 5 and all(m.streaming for m in switched)

    # the same log-probabilities either way, decoding token by token
    tokens = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        runs = []
        for threshold in (1000, 1 << 40):
            choose_kernels(model, threshold)
            state, out = model.init_state(1), []
            for i in range(tokens.shape[1]):
                log_probs, state = model(tokens[:, i : i + 1], state)
                out.append(log_probs)
            runs.append(torch.cat(out, dim=1))
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=1e-5)
