"""Linear products for decoding a batch on the CPU: the same weights, a faster kernel for a few rows.

A decode step multiplies each weight matrix by one row per sequence in the batch. That product
is bound by reading the weight, so a batch of 8 should cost little more than one row. With
`F.linear` on this x86 build (MKL), it does not: MKL reads a (4096, 1024) float32 weight at
about 31 GB/s for one or two rows but 11 GB/s for eight and 9.5 for sixteen. oneDNN's product,
which torch ships beside MKL and reaches through `torch.ops.mkldnn._linear_pointwise`, reads the
same plain weight at 16-19 GB/s for eight rows (measured alone, docs/benchmarks.md); for one or
two rows MKL is the faster one, and for small weights that stay in the cache oneDNN's fixed cost
per call (15-20 microseconds) is more than the whole product.

So `linear(x, weight, bias)` is `F.linear`, except for a float32 product on the CPU without
autograd of at least FEW_ROWS rows and a weight of at least LARGE_WEIGHT elements, which goes
through oneDNN. FEW_ROWS depends on the CPU: on AMD, MKL's product of one row is the slow one
too (`few_rows_for`), and oneDNN takes every row count. Nothing is packed or copied: the weight
stays the model's parameter, read in place, and the checkpoint, the state dict and int8
quantization (models/quantize.py) see the same module. Training (autograd) always takes
`F.linear`.

Numbers differ from `F.linear` by summation order only (a few parts in a million of the output's scale), as
MKL's own answer for one row differs from its answer for that row within a batch.
`use_batched_products(model)` turns every large `nn.Linear` of a loaded model into a `Linear` (the
same object, its class changed: parameters, hooks and names stay); models/checkpoint.py calls
it on every model it loads.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def cpu_vendor() -> str:
    """The CPU's vendor as Linux names it ("GenuineIntel", "AuthenticAMD"), or "" where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def few_rows_for(vendor: str) -> int:
    """Below this many rows a product goes through MKL's `F.linear`. On Intel, MKL reads a large
    weight as fast as oneDNN for one row and faster for two (30.8 against 30.6 GB/s for a (4,096
    x 1,024) one, 33.2 against 29.2 for (1,024 x 4,096)); on AMD (an EPYC, 2026-12-06) MKL's
    one-row product reads 14-18 GB/s where oneDNN's reads 30-32, so there every row count goes
    through oneDNN. Elsewhere (another vendor, no /proc) as on Intel."""
    return 1 if vendor == "AuthenticAMD" else 4


FEW_ROWS = few_rows_for(cpu_vendor())
LARGE_WEIGHT = 1 << 20  # elements (4 MB in float32): smaller weights stay in the cache, where MKL wins


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear product and it agrees with F.linear here
    (checked once, on a small product: a build or CPU where it fails or differs keeps MKL)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(FEW_ROWS, 64, generator=generator), torch.randn(32, 64, generator=generator),
                       torch.randn(32, generator=generator))
    try:
        with torch.no_grad():
            out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.allclose(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-5))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`: x (..., in), weight (out, in) -> (..., out), through oneDNN
    where it reads the weight faster (see the module docstring)."""
    rows = x.numel() // max(1, x.shape[-1])
    # a transposed weight (a tied projection) stays with MKL, which reads it in place
    if (weight.numel() < LARGE_WEIGHT or rows < FEW_ROWS or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32 or not weight.is_contiguous() or torch.is_grad_enabled()
            or not onednn_available()):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1]).contiguous()  # (N, in)
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")  # (N, out)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` whose product is `linear` above. Same parameters and state dict."""

    def forward(self, x: Tensor) -> Tensor:
        # the parameters from their dict: `self.weight` would go through nn.Module.__getattr__, a
        # Python call, which a decoding step pays for dearly (models/transformer_xl.py `_decode`);
        # a weight that is not a plain parameter (torch.nn.utils.parametrize, prune) by its name
        parameters = self._parameters
        if "weight" not in parameters or "bias" not in parameters:
            return linear(x, self.weight, self.bias)
        return linear(x, parameters["weight"], parameters["bias"])


def use_batched_products(model: nn.Module) -> nn.Module:
    """Every `nn.Linear` of `model` (exactly that class: subclasses keep their own product) with
    a weight of at least LARGE_WEIGHT elements becomes a `Linear`, in place; smaller layers would
    only ever take `F.linear`, so they stay as they are and pay nothing for the check."""
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.numel() >= LARGE_WEIGHT:
            module.__class__ = Linear
    return model
