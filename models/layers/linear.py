"""A linear layer that decodes faster on CPU: the same product as `nn.Linear`, computed through
the matrix-product kernel that reads the weight fastest when only a few rows are multiplied.

Why: decoding one token multiplies one row (or a handful) by every weight matrix, so a step is
bound by how fast the weights stream from memory. On the x86 CPU build of torch we ship on,
`F.linear` with 1-3 rows reaches well under half of the memory bandwidth, and costs nearly one
full pass over the weight per row; `torch.mm(weight, x.t())` with 2-3 rows streams the weight
once at close to the bandwidth, and a single row padded to two runs at that same speed.
Matrices wider in than out (the feed-forward's second product) keep `F.linear` for one row
and for four, where it is as fast or faster.

That holds only while the weights stream from RAM. Weights that stay in the cache (our own
2M-parameter checkpoints, 8 MB) are multiplied faster by `F.linear` itself, and the extra calls
of this path cost more than they save. So the path is switched on per model, by
`choose_kernels`, only when the model's weights are larger than STREAMING_BYTES; `build_model`
calls it.

The result is the same product summed in another order: equal to `F.linear` to float32
rounding, not bit for bit. Training, autograd, other devices, other dtypes, more than four rows
and models that fit in the cache take `F.linear` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MAX_ROWS = 4  # beyond this F.linear's own kernel is as good as any
STREAMING_BYTES = 48 << 20  # weights beyond this cannot stay in the cache (32 MB last level here)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, streaming: bool = True) -> Tensor:
    """F.linear(x, weight, bias) for x (..., in_features), weight (out_features, in_features);
    `streaming` False: F.linear always."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features if in_features else 0
    if (
        not streaming
        or rows == 0
        or rows > MAX_ROWS
        or torch.is_grad_enabled()
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or (out_features < in_features and rows in (1, MAX_ROWS))
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, in_features).contiguous()  # the kernels are fast for row-major rows only
    if rows == 1:  # a lone row runs at half speed through either kernel; a second copy costs nothing
        flat = flat.expand(2, in_features).contiguous()
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()  # (rows, out_features), row-major as F.linear's
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict keys) whose forward goes through `linear`."""

    streaming = False  # set by choose_kernels

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.streaming)


def choose_kernels(model: nn.Module, threshold: int = STREAMING_BYTES) -> bool:
    """Switch the streaming path on in every layer of `model` that has one (`streaming`
    attribute) when the model's parameters take more than `threshold` bytes, off otherwise.
    Returns the choice."""
    streaming = sum(p.numel() * p.element_size() for p in model.parameters()) > threshold
    for module in model.modules():
        if hasattr(module, "streaming"):
            module.streaming = streaming
    return streaming
