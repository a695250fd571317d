"""Causal depthwise convolution over a stream, with the last K − 1 inputs carried between calls.

A causal convolution of width K gives position t a weighted sum of inputs t − K + 1 .. t: it
looks only left, so the inputs before the first position are zeros (left padding only), and
between calls it needs nothing of the past but the last K − 1 inputs. A caller keeps them as a
(B, K − 1, C) buffer, oldest first and zeros before the first position, and passes it back with
the next chunk: the chunk is read after the buffer, as if the whole history had been fed at
once, so the result is the same in any chunking. The buffer's shape never depends on the
history's length.

`causal_dynamic_conv` applies a kernel that changes from position to position (a dynamic
convolution), one per group of channels; `causal_depthwise_conv` applies one kernel per channel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def with_history(x: Tensor, recent: Tensor) -> tuple[Tensor, Tensor]:
    """x (B, T, C) after the buffer `recent` (B, K − 1, C) -> the inputs read, (B, K − 1 + T, C),
    and the buffer after x: the last K − 1 of them (part of the old buffer when T < K − 1)."""
    padded = torch.cat([recent.to(x.dtype), x], dim=1)  # (B, K − 1 + T, C)
    return padded, padded[:, padded.shape[1] - recent.shape[1] :]


def causal_dynamic_conv(x: Tensor, recent: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """out[b, t, c] = Σ_k weights[b, t, g(c), k] · input[b, t − K + 1 + k, c] for x (B, T, C)
    after `recent` (B, K − 1, C), weights (B, T, G, K) with channel c in group g(c) = c div (C / G)
    -> out (B, T, C) and the buffer after x."""
    padded, recent = with_history(x, recent)
    B, T, C = x.shape
    G, K = weights.shape[2:]
    if K != recent.shape[1] + 1:
        raise ValueError(f"a kernel of width {K} needs {K - 1} buffered inputs, got {recent.shape[1]}")
    weights = weights.to(x.dtype)[..., None]  # (B, T, G, K, 1)
    # K shifted products rather than one batched product over (B, T, C, K) windows: that product
    # is B·T·G matrix-vector products of K taps each, and it copies the windows (and again in its
    # backward); these read shifted views of the inputs and copy nothing
    out = x.new_zeros(B, T, G, C // G)
    for k in range(K):
        out = out + padded[:, k : k + T].view(B, T, G, C // G) * weights[:, :, :, k]
    return out.flatten(2), recent  # (B, T, C)


def causal_depthwise_conv(x: Tensor, recent: Tensor, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """out[b, t, c] = Σ_k weight[c, k] · input[b, t − K + 1 + k, c] (+ bias[c]) for x (B, T, C)
    after `recent` (B, K − 1, C), weight (C, K) -> out (B, T, C) and the buffer after x."""
    padded, recent = with_history(x, recent)
    C, K = weight.shape
    if K != recent.shape[1] + 1:
        raise ValueError(f"a kernel of width {K} needs {K - 1} buffered inputs, got {recent.shape[1]}")
    bias = None if bias is None else bias.to(x.dtype)
    out = F.conv1d(padded.transpose(1, 2), weight[:, None, :].to(x.dtype), bias, groups=C)  # (B, C, T)
    return out.transpose(1, 2), recent
