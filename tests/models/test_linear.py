"""models/linear.py: decode products through oneDNN for a few rows of a large weight,
the same numbers as F.linear up to summation order, and a loaded model whose layers use it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from xlserve.models.checkpoint import load_checkpoint, save_checkpoint
from xlserve.models import linear as linear_module
from xlserve.models.linear import FEW_ROWS, LARGE_WEIGHT, Linear, linear, onednn_available, use_batched_products
from xlserve.models.registry import build_model

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear product")


def large_weight(out_features: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    in_features = LARGE_WEIGHT // out_features
    return (torch.randn(out_features, in_features, generator=generator) / in_features**0.5,
            torch.randn(out_features, generator=generator))


def calls_to_onednn(monkeypatch) -> list[int]:
    """Rows of each product that went through oneDNN while the test runs."""
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, x, *rest):
            calls.append(x.shape[0])
            return real(x, *rest)

    monkeypatch.setattr(linear_module.torch.ops.mkldnn, "_linear_pointwise", Spy(), raising=False)
    return calls


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 16, 64])
def test_equals_f_linear_up_to_summation_order(rows, monkeypatch):
    weight, bias = large_weight()
    x = torch.randn(rows, 3, weight.shape[1]).transpose(0, 1)  # (3, rows, in), not contiguous
    calls = calls_to_onednn(monkeypatch)
    with torch.inference_mode():
        ours, plain = linear(x, weight, bias), F.linear(x, weight, bias)
    assert ours.shape == plain.shape == (3, rows, weight.shape[0])
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5)
    assert calls == ([3 * rows] if 3 * rows >= FEW_ROWS else [])


def test_small_weights_autograd_and_other_dtypes_keep_f_linear(monkeypatch):
    weight, bias = large_weight()
    calls = calls_to_onednn(monkeypatch)
    small = torch.randn(64, 64)
    with torch.inference_mode():
        linear(torch.randn(8, 64), small)  # stays in the cache: MKL
        linear(torch.randn(8, weight.shape[1], dtype=torch.float64), weight.double(), bias.double())
    trained = weight.clone().requires_grad_()
    linear(torch.randn(8, weight.shape[1]), trained, bias).sum().backward()  # autograd: F.linear
    assert trained.grad is not None and calls == []


def test_a_loaded_model_uses_it_with_the_same_parameters_and_outputs(tmp_path, monkeypatch):
    """A checkpoint with one feed-forward of LARGE_WEIGHT elements: loading turns its nn.Linear
    layers into Linear (same parameters, same state dict), a batch of 8 decodes through
    oneDNN, and the log-probs are the plain model's within float32 summation order."""
    model = build_model("transformer-xl", dict(vocab_size=256, n_layer=1, d_model=256, n_head=4, d_head=64,
                                               d_inner=LARGE_WEIGHT // 256, mem_len=16)).eval()
    save_checkpoint(model, tmp_path / "c")
    loaded = load_checkpoint(tmp_path / "c")
    linears = [m for m in loaded.modules() if isinstance(m, nn.Linear)]
    assert all((type(m) is Linear) == (m.weight.numel() >= LARGE_WEIGHT) for m in linears)
    assert any(type(m) is Linear for m in linears) and any(type(m) is nn.Linear for m in linears)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    copy.deepcopy(loaded)  # the engine's and the benches' copies still work
    tokens = torch.randint(0, 256, (8, 5), generator=torch.Generator().manual_seed(1))
    calls = calls_to_onednn(monkeypatch)
    with torch.inference_mode():
        ours, _ = loaded(tokens, loaded.init_state(8))
        plain, _ = model(tokens, model.init_state(8))
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5)
    assert calls and all(rows >= FEW_ROWS for rows in calls)


def test_use_batched_products_leaves_subclasses_and_small_layers_alone():
    class Special(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(1024, 1024), Special(1024, 1024), nn.Linear(4, 4))
    use_batched_products(model)
    assert type(model[0]) is Linear and type(model[1]) is Special and type(model[2]) is nn.Linear


def test_a_parametrized_weight_is_read_through_its_parametrization():
    """Linear reads its parameters from their dict (a decoding step's call costs less), and a
    weight that is no plain parameter any more (torch.nn.utils.parametrize) by its name."""
    from torch.nn.utils import parametrize

    weight, bias = large_weight()
    layer = use_batched_products(nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0])))[0]
    assert type(layer) is Linear
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    parametrize.register_parametrization(layer, "weight", Doubled())
    x = torch.randn(8, weight.shape[1])
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, 2 * weight, bias), rtol=1e-5, atol=1e-5)


def test_one_row_goes_through_onednn_where_mkl_is_the_slow_one():
    """Which kernel takes a product of few rows depends on the CPU: on AMD, MKL's product of one
    row read a large weight at half oneDNN's rate (14-18 against 30-32 GB/s, an EPYC), so there
    every row count goes through oneDNN; on Intel (and elsewhere) MKL keeps one to three rows."""
    from xlserve.models.linear import cpu_vendor, few_rows_for

    assert few_rows_for("AuthenticAMD") == 1 and few_rows_for("GenuineIntel") == 4 and few_rows_for("") == 4
    assert FEW_ROWS == few_rows_for(cpu_vendor())
