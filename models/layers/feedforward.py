"""The position-wise feed-forward block of a transformer layer, and the activations XLNet's may use.

Vaswani et al., "Attention Is All You Need", NeurIPS 2017, section 3.3: every position goes
through the same two-layer network, FFN(x) = W_2 act(W_1 x + b_1) + b_2, widening the residual
stream from d_model to d_inner and back. Dropout follows the activation and the output, as in
Transformer-XL.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


# activation name (Hugging Face's `ff_activation`) -> function
ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


class FeedForward(nn.Sequential):
    """(..., d_model) -> (..., d_model): Linear, ReLU, dropout, Linear, dropout.

    A Sequential, so its parameters are named `0.weight`, `0.bias` (W_1, b_1) and `3.weight`,
    `3.bias` (W_2, b_2), the names checkpoints store them under."""

    def __init__(self, d_model: int, d_inner: int, dropout: float):
        super().__init__(
            nn.Linear(d_model, d_inner),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(d_inner, d_model),
            nn.Dropout(dropout),
        )

    def inference(self, x: Tensor) -> Tensor:
        """forward in eval mode, without the module calls: each product through its own module's
        `forward` (whatever the module is now: F.linear, oneDNN's product for a batch, an int8
        copy), the activation, and no dropout (the identity in eval mode). For a decoding step,
        where every call costs many times what it does alone (models/transformer_xl.py
        `RelativeAttentionLayer._decode`)."""
        first, activation, _, second, _ = self
        return second.forward(activation.forward(first.forward(x)))
