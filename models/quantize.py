"""Weight-only int8 at load time (XLSERVE_QUANTIZE=int8): every linear layer of a loaded model,
and Transformer-XL's adaptive softmax, multiply with int8 weights through torch's own kernel.

The kernel is `torch._weight_int8pack_mm` (the CPU weight-only int8 product torchao's int8
weight-only layout runs on): an int8 weight with one scale per output channel, multiplied by
bfloat16 activations. Why this one and not `torch.ao.quantization.quantize_dynamic`:

- dynamic quantization also rounds the activations to int8 with one scale for the whole input,
  so a row's output depends on the other rows of its batch (the largest activation of any of
  them sets everyone's scale). The engine decodes many sessions in one batch and relies on a
  row's tokens not depending on its companions; `_weight_int8pack_mm` computes every row on its
  own (bit for bit the same alone or in a batch of 64, on one thread or two);
- `torch.ao.quantization` is deprecated in torch 2.13 and warns on every use.

Its float32-activation path is several times slower than float32 itself on this x86 build,
while the bfloat16-activation path runs 2.3-2.5x faster than float32 for a (4096, 1024) weight
at one to eight rows (decoding); so the activations are rounded to bfloat16 (8 bits of mantissa)
on the way in and the output is widened back to float32. From about 32 rows on the kernel is
slower than float32's matrix product (2.4x at 512 rows, one thread): int8 decodes faster and
prefills prompts slower. One path for every row count keeps a row's numbers the same whatever
the batch. The rest of the model (embeddings, norms, attention over the
state, the state itself) stays in float32: only weight matrices are quantized.

Nothing is saved quantized: a checkpoint stays float safetensors, and quantization happens
every time it is loaded (a few milliseconds for the shipped checkpoints). CPU only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from xlserve.models.interface import LanguageModel

QUANTIZE_MODES = ("none", "int8")
INT8_LIMIT = 127  # symmetric: -127..127, so that negating a weight never overflows
# The kernel's x86 paths read a row's inputs 16 (AVX512) or 8 (AVX2) at a time and check
# nothing: with in_features not a multiple of that they sum wrong values or crash the process
# (torch 2.13). A layer with another width stays float; every shipped checkpoint's widths
# (96 ... 768) are multiples of 16.
INPUT_MULTIPLE = 16

# Linear layers (by their attribute name) that stay float in an architecture because the model
# reads their matrix itself at every decoding step, not only through the layer: Transformer-XL's
# one decoding row scores distances as ((q + v) W_kR) . R_d, reading W_kR = r_net.weight, and an
# int8 layer would rebuild that float matrix at each read (an 18-layer d_model 1024 model decoded
# 9.6 tokens/s so, 14.2 with r_net float, which costs 1/13 of its layers' weight bytes). Other
# readers of an int8 layer's `weight` (the ∞-former's ltm_k, once per memory update) are rare
# enough to read the rebuilt matrix.
KEPT_FLOAT: dict[str, frozenset[str]] = {"transformer-xl": frozenset({"r_net"})}

# Architectures whose int8 quality is not within the 0.02 bits per byte of float32 on the
# held-out slice (tests/models/test_quantize.py measures every shipped checkpoint); quantizing one
# is refused with this reason rather than served worse than promised.
EXCLUDED_ARCHITECTURES: dict[str, str] = {}


class QuantizationError(ValueError):
    """A model that cannot be quantized as asked; the message says why in one line."""


def int8_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(out, in) float weight -> its int8 values (out, in) and bfloat16 scales (out,), symmetric
    per output channel. The scales are rounded to bfloat16 (what the kernel takes) before the
    weight is divided by them, so int8 * scale is the kernel's own reconstruction."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / INT8_LIMIT).clamp(min=torch.finfo(torch.float32).tiny)
    scales = scales.to(torch.bfloat16)
    values = torch.round(weight / scales.float()[:, None]).clamp(-INT8_LIMIT, INT8_LIMIT).to(torch.int8).contiguous()
    return values, scales


class Int8Linear(nn.Module):
    """`nn.Linear`'s product (x (..., in) -> (..., out), plus the float bias) with an int8
    weight. `weight` is still readable, dequantized, for the few callers that use the matrix
    itself rather than the layer (Transformer-XL's one-row relative scores, the ∞-former's
    long-term keys)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        values, scales = int8_weight(weight)
        self.register_buffer("weight_int8", values)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> "Int8Linear | None":
        return cls.for_weight(layer.weight, layer.bias)

    @classmethod
    def for_weight(cls, weight: Tensor, bias: Tensor | None) -> "Int8Linear | None":
        """The int8 layer of `weight` (out, in) and `bias`, or None when the kernel cannot
        multiply a weight this wide (INPUT_MULTIPLE): that product stays float."""
        if weight.shape[1] % INPUT_MULTIPLE:
            return None
        layer = cls(weight, bias)
        layer.check_against(weight, bias)
        return layer

    def check_against(self, weight: Tensor, bias: Tensor | None) -> None:
        """Raise QuantizationError unless this layer's product of a random row is the float
        layer's within int8 and bfloat16 rounding: a CPU whose kernel path sums wrong is refused
        at load, not served."""
        row = torch.randn(1, self.in_features, generator=torch.Generator().manual_seed(0))
        expected = torch.nn.functional.linear(row, weight.detach().float(), None if bias is None else bias.detach().float())
        error = (self(row) - expected).abs().max().item()
        bound = 0.05 * expected.abs().max().item() + 1e-6
        if not error <= bound:
            raise QuantizationError(f"torch._weight_int8pack_mm is off by {error:.3g} (bound {bound:.3g}) for a "
                                    f"({self.out_features}, {self.in_features}) weight on this CPU; use XLSERVE_QUANTIZE=none")

    @property
    def weight(self) -> Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if rows.shape[0] == 0:
            out = x.new_zeros(0, self.out_features)
        else:
            # .to(bfloat16): a model moved with .to(float32) after quantizing has widened its scales
            out = torch._weight_int8pack_mm(rows, self.weight_int8, self.scales.to(torch.bfloat16)).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_model(model: LanguageModel, mode: str) -> LanguageModel:
    """`model` with its linear layers (and adaptive softmax) in `mode` ("none": unchanged), in
    place; records the mode as `model.quantization`. Raises QuantizationError for a model on
    another device than the CPU or of an excluded architecture."""
    if mode not in QUANTIZE_MODES:
        raise QuantizationError(f"quantize mode {mode!r} is not one of {', '.join(QUANTIZE_MODES)}")
    if mode == "none":
        model.quantization = "none"
        return model
    if model.device.type != "cpu":
        raise QuantizationError(f"int8 quantization runs on the CPU only; the model is on {model.device.type} "
                                "(set XLSERVE_QUANTIZE=none or XLSERVE_DEVICE=cpu)")
    if model.architecture in EXCLUDED_ARCHITECTURES:
        raise QuantizationError(f"{model.architecture} is not quantized to int8: "
                                f"{EXCLUDED_ARCHITECTURES[model.architecture]}")
    model.checkpoint_parameters = sum(p.numel() for p in model.parameters())  # the card's count stays the checkpoint's
    replaced: dict[int, Int8Linear] = {}  # a layer shared by two parents becomes one int8 layer
    kept_float = KEPT_FLOAT.get(model.architecture, frozenset())
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name not in kept_float:
                if id(child) not in replaced:
                    replaced[id(child)] = Int8Linear.from_linear(child)
                if replaced[id(child)] is not None:
                    setattr(parent, name, replaced[id(child)])
    for module in list(model.modules()):
        if hasattr(module, "quantize_int8"):  # Transformer-XL's adaptive softmax: raw weight matrices
            module.quantize_int8(Int8Linear.for_weight)
    model.quantization = mode
    return model


def quantization_of(model: nn.Module) -> str:
    """"int8" for a model `quantize_model` quantized, "none" otherwise."""
    return getattr(model, "quantization", "none")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and int8 weights and scales (what the weights take in
    memory; tied parameters counted once)."""
    tensors = {id(t): t for t in model.parameters()}
    tensors.update({id(t): t for t in model.buffers() if t.dtype in (torch.int8, torch.bfloat16)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads (the benches' bandwidth measure, and what makes a
    model large to the engine's threads, server/engine/threads.py): every parameter and buffer of
    the module tree but the input embedding tables, of which a step reads one row. An embedding
    table is read whole when it is an output too: its weight is another module's parameter (a
    tied head), or the table lies under an adaptive softmax, which scores every word with it
    (tied: the module is shared with the adaptive input; untied: its own tables). A table counts
    once."""
    from xlserve.models.transformer_xl import AdaptiveLogSoftmax

    read_whole: set[int] = set()
    for module in model.modules():  # a table shared with the adaptive input is among the softmax's modules too
        if isinstance(module, AdaptiveLogSoftmax):
            read_whole.update(id(table) for table in module.modules() if isinstance(table, torch.nn.Embedding))
    total = weight_bytes(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and id(module) not in read_whole:
            tied = any(p is module.weight for m in model.modules() if m is not module for p in m.parameters(recurse=False))
            if not tied:
                total -= module.weight.numel() * module.weight.element_size()
    return total


def parameter_count(model: nn.Module) -> int:
    """The parameters of the model's checkpoint (a quantized model's int8 weights are buffers,
    which `parameters()` no longer lists)."""
    return getattr(model, "checkpoint_parameters", None) or sum(p.numel() for p in model.parameters())
