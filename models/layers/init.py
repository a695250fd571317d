"""The weight initialisation every architecture starts from."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

STD = 0.02  # standard deviation of every initial weight, as in Transformer-XL's reference code


def init_weights(model: nn.Module, extra: Iterable[Tensor] = ()) -> None:
    """Draw every linear and embedding weight of `model` from N(0, STD²) and zero their biases,
    then draw each tensor of `extra` (parameters outside those layers: attention biases, learned
    positions) from the same distribution, in the order given. The order of the draws is fixed,
    so a seed gives the same model every time."""
    model.apply(_init_module)
    for parameter in extra:
        nn.init.normal_(parameter, std=STD)


def _init_module(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=STD)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
