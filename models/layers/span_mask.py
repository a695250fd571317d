"""The soft span mask of adaptive attention span, and how many positions a span reaches.

Paper: Sainbayar Sukhbaatar, Edouard Grave, Piotr Bojanowski, Armand Joulin, "Adaptive Attention
Span in Transformers", ACL 2019, section 3.1. A head with span z weights the key at distance x
back from its query by

    m_z(x) = clamp((R + z - x) / R, 0, 1)

1 up to distance z, then a linear ramp of width R down to 0 at distance z + R; the attention
weights are renormalised over what the mask leaves (`span_log_mask` gives log m_z, added to the
scores before the softmax: exp(s + log m) = m exp(s), so the softmax is that renormalisation).

(Not models/layers/adaptive.py, which is Transformer-XL's adaptive input and softmax.)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def soft_span_mask(distance: Tensor, spans: Tensor, ramp: int) -> Tensor:
    """m_z(x) for every head: distances x (T, K) (any integer or float tensor), spans z (H,) ->
    (H, T, K) float32 in [0, 1]. Computed in float32 whatever the model's dtype, so the
    positions a head reaches are those `reachable_positions` counts."""
    x = distance.to(torch.float32)[None]  # (1, T, K)
    z = spans.to(torch.float32)[:, None, None]  # (H, 1, 1)
    return ((ramp + z - x) / ramp).clamp(0.0, 1.0)


def span_log_mask(distance: Tensor, spans: Tensor, ramp: int) -> Tensor:
    """log m_z(x), (H, T, K): -inf where the mask is 0. Differentiable in z where m > 0; where
    m = 0 the gradient is 0, not the NaN of log(0)'s infinite slope times clamp's zero slope."""
    mask = soft_span_mask(distance, spans, ramp)
    inside = mask > 0
    return torch.where(inside, mask.clamp(min=torch.finfo(mask.dtype).tiny).log(), float("-inf"))


def reachable_positions(span: float, ramp: int) -> int:
    """How many positions a query with span z gives a weight above 0, itself included:
    distances x = 0 .. ceil(z) + R - 1, i.e. ceil(z) + R of them (x < R + z)."""
    return math.ceil(span) + ramp


def kept_positions(span: float, ramp: int) -> int:
    """Positions of a head's past that the next query can still reach: `reachable_positions`
    less the query itself, ceil(z) + R - 1. What a served state keeps per head."""
    return reachable_positions(span, ramp) - 1
