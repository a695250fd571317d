"""Weight-only int8 at load time (XLSERVE_QUANTIZE=int8): every linear layer of a loaded model,
and Transformer-XL's adaptive softmax, multiply with int8 weights through torch's own kernels.

A weight is stored as int8 with one float32 scale per output channel (symmetric, -127..127).
Each row of activations is rounded to int8 with a scale of its own (its largest magnitude over
127), the two are multiplied in int32, which is exact, and the product is scaled back:

    out[r, j] = float(sum_k xq[r, k] * wq[j, k]) * w_scale[j] * x_scale[r] + bias[j]

Why this form:

- **a row is computed on its own.** The int32 sums are exact and every scale is a row's or a
  channel's, so a row's numbers are the same bit for bit alone or in a batch of 64, on one thread
  or two, whichever kernel summed them. The engine decodes many sessions in one batch and relies
  on that. (torch's dynamic quantization rounds the whole input with one scale, so the largest
  activation of any row would set everyone's; that is why its own front end is not used.)
- **the kernel reads one byte a weight and multiplies bytes.** fbgemm's int8 product (VNNI on
  x86) ran 3.3x faster than float32 at one row and 5x at eight for 64 (4096, 1024) weights out
  of cache, two threads, and stays faster at prompt sizes (2.7x at 512 rows).
  `torch._weight_int8pack_mm` (int8 weights, bfloat16 activations, what the first version used)
  is bound by its arithmetic: 1.7x float32 at one row in the same measurement, slower than
  float32 from 32 rows on; it kept int8 decoding at 1.3-1.7x float32 at wt103's shape.

The kernel is reached through `quantized.linear_with_input_q_dq_qweight_dq_output_fp32`: given
activations that are already whole numbers, with input scale 1 and zero point 128, it returns
exactly float(int32 sum) * w_scale. That is checked once a process on the extremes, rows of
+-127 against weights of one sign, which overflow a 16-bit pair sum (x86 CPUs without VNNI add
pairs of products in 16 bits, saturating: `packed_kernel_is_exact`), and at load on each layer's
own weight with a random row. A layer whose packed kernel is missing (another CPU, a later torch
without quantized tensors) or fails a check multiplies through `torch._int_mm` instead, which
gives the same numbers more slowly at one row. Either way nothing is hand-written.

The rest of the model (embeddings, norms, attention over the state, the state itself) stays in
float32: only weight matrices are quantized. Nothing is saved quantized: a checkpoint stays
float safetensors, and quantization happens every time it is loaded. CPU only.
"""

from __future__ import annotations

import functools
import weakref
import warnings

import torch
from torch import Tensor, nn

from xlserve.models.interface import LanguageModel

QUANTIZE_MODES = ("none", "int8")
INT8_LIMIT = 127  # symmetric: -127..127, so that negating a weight or an activation never overflows
PACKED_ZERO_POINT = 128  # whole-number activations -127..127 enter the packed kernel as uint8 1..255
TINY = torch.finfo(torch.float32).tiny  # the smallest scale: a row or channel of zeros stays zeros

# Linear layers (by their attribute name) that stay float in an architecture. Transformer-XL's
# r_net (W_kR) only builds the per-layer tables of relative keys W_kR R_d that every step reads
# (models/layers/relative.py RelativeKeys, rebuilt when a context outgrows them): no decoding step
# reads it, so int8 would save memory only (1/13 of the layers' weight bytes), and float keeps
# the tables as float32 computes them. (Until 2026-12-05 one decoding row read r_net.weight as a
# matrix, which an int8 layer rebuilt at each read: 9.6 tokens/s against 14.2 with r_net float.)
# Other readers of an int8 layer's `weight` (the ∞-former's ltm_k, once per memory update) are
# rare enough to read the rebuilt matrix.
KEPT_FLOAT: dict[str, frozenset[str]] = {"transformer-xl": frozenset({"r_net"})}

# Architectures whose int8 quality is not within the 0.02 bits per byte of float32 on the
# held-out slice (tests/models/test_quantize.py measures every shipped checkpoint); quantizing one
# is refused with this reason rather than served worse than promised.
EXCLUDED_ARCHITECTURES: dict[str, str] = {}


class QuantizationError(ValueError):
    """A model that cannot be quantized as asked; the message says why in one line."""


def int8_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(out, in) float weight -> its int8 values (out, in) and float32 scales (out,), symmetric
    per output channel: int8 * scale is within half a step of the weight."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / INT8_LIMIT).clamp(min=TINY)
    values = torch.round(weight / scales[:, None]).clamp(-INT8_LIMIT, INT8_LIMIT).to(torch.int8).contiguous()
    return values, scales


def int8_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """(M, in) float rows -> their whole-number values -127..127 (still float, (M, in)) and each
    row's scale (M, 1): the rows are values * scale to half a step. Every operation is per row
    and elementwise, so a row rounds the same whatever its companions."""
    largest = rows.abs().amax(dim=1, keepdim=True)  # (M, 1) max |x| (cheaper than vector_norm's inf norm)
    scales = largest.div_(INT8_LIMIT).clamp_(min=TINY)
    # |x| <= largest, so |x / scale| <= 127 and rounds into -127..127 with no clamp (a row with
    # an infinity or a NaN gives infinities or NaN, in its own outputs only)
    return torch.div(rows, scales).round_(), scales


KERNEL_FAILURES = (RuntimeError, AttributeError, NotImplementedError)  # a torch or CPU without the packed kernel


def _packed_weight(values: Tensor, scales: Tensor):
    """fbgemm's packed form of an int8 weight, or None where this torch or CPU has no packed
    int8 product. Quantized tensors are deprecated in torch 2.13 and warn once when made; the
    warning is about their future, which `Int8Linear` answers with its `torch._int_mm` path."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch._make_per_channel_quantized_tensor(
                values, scales.double(), torch.zeros(values.shape[0], dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(quantized, None)
    except KERNEL_FAILURES:
        return None


def packed_sums(whole_rows: Tensor, packed) -> Tensor:
    """float(int32 sums) * w_scale for whole-number rows (M, in) -127..127, by the packed kernel."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(whole_rows, 1.0, PACKED_ZERO_POINT, packed)


def int_mm_sums(whole_rows: Tensor, values: Tensor, scales: Tensor) -> Tensor:
    """The same numbers by torch._int_mm: exact int32 sums, widened, times w_scale."""
    return torch._int_mm(whole_rows.to(torch.int8), values.t()).float() * scales


def _packed_sums_match(rows: Tensor, packed, values: Tensor, scales: Tensor) -> bool:
    """Whether the packed kernel gives `int_mm_sums`' numbers for whole-number `rows` and this
    weight (False too when it has no packed kernel or fails)."""
    if packed is None:
        return False
    try:
        return torch.equal(packed_sums(rows, packed), int_mm_sums(rows, values, scales))
    except KERNEL_FAILURES:
        return False


@functools.cache
def packed_kernel_is_exact() -> bool:
    """Whether this process's packed int8 kernel sums exactly, checked once: random rows and
    weights, and the extremes. A row of +127 enters the kernel as 255 (zero point 128); against
    two weights of +127 a pair of products is 64,770, which a kernel that adds pairs of products
    in 16 bits (x86 without VNNI: vpmaddubsw) saturates at 32,767. Such a CPU multiplies through
    `torch._int_mm` instead, which sums in 32 bits."""
    generator = torch.Generator().manual_seed(0)
    width = 64
    values = torch.randint(-INT8_LIMIT, INT8_LIMIT + 1, (8, width), generator=generator, dtype=torch.int8)
    values[0], values[1] = INT8_LIMIT, -INT8_LIMIT  # channels of one sign: every pair is as large as it gets
    values[2, ::2], values[2, 1::2] = INT8_LIMIT, -INT8_LIMIT
    rows = torch.randint(-INT8_LIMIT, INT8_LIMIT + 1, (5, width), generator=generator).float()
    rows[0], rows[1] = INT8_LIMIT, -INT8_LIMIT
    rows[2, ::2], rows[2, 1::2] = INT8_LIMIT, -INT8_LIMIT
    scales = torch.rand(8, generator=generator) + 0.5
    return _packed_sums_match(rows, _packed_weight(values, scales), values, scales)


class Int8Linear(nn.Module):
    """`nn.Linear`'s product (x (..., in) -> (..., out), plus the float bias) with an int8
    weight and int8 rows (the module docstring says how). `weight` is still readable,
    dequantized, for the few callers that use the matrix itself rather than the layer
    (the ∞-former's long-term keys)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        values, scales = int8_weight(weight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        # the packed kernel holds the int8 values in its own layout (and unpacks them from it);
        # `weight_int8` holds them only where the layer multiplies through _int_mm
        self.packed = _packed_weight(values, scales) if packed_kernel_is_exact() else None
        if self.packed is not None and not self._packed_matches_on_a_random_row(values):
            self.packed = None
        if self.packed is None:
            self.register_buffer("weight_int8", values)
        else:
            self.weight_int8 = None

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> "Int8Linear":
        return cls.for_weight(layer.weight, layer.bias)

    @classmethod
    def for_weight(cls, weight: Tensor, bias: Tensor | None) -> "Int8Linear":
        """The int8 layer of `weight` (out, in) and `bias`, checked against the float product."""
        layer = cls(weight, bias)
        layer.check_against(weight, bias)
        return layer

    @property
    def kernel(self) -> str:
        """"packed" (fbgemm's int8 product) or "int_mm" (torch._int_mm, the fallback)."""
        return "int_mm" if self.packed is None else "packed"

    def _packed_matches_on_a_random_row(self, values: Tensor) -> bool:
        """Whether the packed kernel gives this weight's exact sums for a random row (the
        extremes are `packed_kernel_is_exact`'s, once a process)."""
        row = torch.randint(-INT8_LIMIT, INT8_LIMIT + 1, (1, self.in_features), generator=torch.Generator().manual_seed(0))
        return _packed_sums_match(row.float(), self.packed, values, self.scales)

    def check_against(self, weight: Tensor, bias: Tensor | None) -> None:
        """Raise QuantizationError unless this layer's product of a random row is the float
        layer's within int8 rounding: a CPU whose kernel sums wrong is refused at load, not
        served."""
        row = torch.randn(1, self.in_features, generator=torch.Generator().manual_seed(0))
        expected = torch.nn.functional.linear(row, weight.detach().float(), None if bias is None else bias.detach().float())
        error = (self(row) - expected).abs().max().item()
        bound = 0.05 * expected.abs().max().item() + 1e-6
        if not error <= bound:
            raise QuantizationError(f"the int8 product ({self.kernel}) is off by {error:.3g} (bound {bound:.3g}) for a "
                                    f"({self.out_features}, {self.in_features}) weight on this CPU; use XLSERVE_QUANTIZE=none")

    def int8_values(self) -> Tensor:
        """The weight's int8 values (out, in)."""
        if self.packed is None:
            return self.weight_int8
        return torch.ops.quantized.linear_unpack(self.packed)[0].int_repr()

    @property
    def weight(self) -> Tensor:
        return self.int8_values().float() * self.scales[:, None]

    def packed_bytes(self) -> int:
        """Bytes of the packed kernel's int8 values, which are no buffer of the module (one a
        weight: the packed form keeps no other copy); 0 when `weight_int8` holds them."""
        return 0 if self.packed is None else self.out_features * self.in_features

    def forward(self, x: Tensor) -> Tensor:
        # a decode step calls this ~80 times at wt103's shape and the shipped models' weights stay
        # in the cache, so every operation here counts: no copy that is not needed
        rows = x.reshape(-1, self.in_features)  # (M, in)
        if rows.dtype != torch.float32:
            rows = rows.float()
        if rows.shape[0] == 0:
            out = rows.new_zeros(0, self.out_features)
        else:
            whole, row_scales = int8_rows(rows)  # (M, in) whole numbers, (M, 1)
            packed = self.packed
            sums = (packed_sums(whole, packed) if packed is not None
                    else int_mm_sums(whole, self.weight_int8, self.scales))
            out = sums.mul_(row_scales)  # (M, out)
        bias = self.bias
        if bias is not None:
            out.add_(bias)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, {self.kernel}"


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
    # a layer shared by two parents becomes one int8 layer (known by a weak reference: the float
    # layer must be free to go once its last parent holds the int8 one)
    replaced: dict[int, tuple[weakref.ref, Int8Linear]] = {}
    kept_float = KEPT_FLOAT.get(model.architecture, frozenset())
    # by name, not a list of the modules: such a list would keep every float layer alive until the
    # last was quantized, the int8 copies piling up on the whole float model (+36% of the weights
    # at wt103's size, against +11% with each float layer let go as it is replaced)
    places = [(parent_name, name) for parent_name, parent in model.named_modules(remove_duplicate=False)
              for name, child in parent.named_children() if isinstance(child, nn.Linear) and name not in kept_float]
    for parent_name, name in places:
        parent = model.get_submodule(parent_name)
        child = getattr(parent, name)
        if not isinstance(child, nn.Linear):  # replaced already, through another path to its parent
            continue
        known = replaced.get(id(child))
        if known is None or known[0]() is not child:
            known = replaced[id(child)] = (weakref.ref(child), Int8Linear.from_linear(child))
        del child
        setattr(parent, name, known[1])
    for module in list(model.modules()):
        if hasattr(module, "quantize_int8"):  # Transformer-XL's adaptive softmax: raw weight matrices
            module.quantize_int8(Int8Linear.for_weight)
        if hasattr(module, "forget_tables"):  # relative-key tables a forward kept, built by float products
            module.forget_tables()
    model.quantization = mode
    return model


def quantization_of(model: nn.Module) -> str:
    """"int8" for a model `quantize_model` quantized, "none" otherwise."""
    return getattr(model, "quantization", "none")


def _int8_layers(model: nn.Module) -> list[Int8Linear]:
    return [m for m in model.modules() if isinstance(m, Int8Linear)]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights in memory: its parameters and, for each int8 layer, its
    scales and int8 values (packed or a buffer); tied parameters counted once."""
    tensors = {id(t): t for t in model.parameters()}
    layers = _int8_layers(model)
    for layer in layers:
        tensors.update({id(t): t for t in layer.buffers()})
    return sum(t.numel() * t.element_size() for t in tensors.values()) + sum(layer.packed_bytes() for layer in layers)


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads (the benches' bandwidth measure, and what makes a
    model large to the engine's threads, server/engine/threads.py): every parameter and each int8
    layer's scales and values, but the input embedding tables, of which a step
    reads one row. An embedding table is read whole when it is an output too: its weight is
    another module's parameter (a tied head), or the table lies under a float adaptive softmax,
    which scores every word with it (tied: the module is shared with the adaptive input; untied:
    its own tables). An int8 adaptive softmax scores with its int8 copies instead; the float bias
    and projections it no longer reads still count (a few MB at wt103's shape). A table counts
    once."""
    from xlserve.models.transformer_xl import AdaptiveLogSoftmax

    read_whole: set[int] = set()
    for module in model.modules():  # a table shared with the adaptive input is among the softmax's modules too
        if isinstance(module, AdaptiveLogSoftmax) and module.int8_products is None:
            read_whole.update(id(table) for table in module.modules() if isinstance(table, torch.nn.Embedding))
    total = weight_bytes(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and id(module) not in read_whole:
            tied = any(p is module.weight for m in model.modules() if m is not module for p in m.parameters(recurse=False))
            if not tied:
                total -= module.weight.numel() * module.weight.element_size()
    return total


def parameter_count(model: nn.Module) -> int:
    """The parameters of the model's checkpoint (a quantized model's int8 weights are packed or
    buffers, which `parameters()` does not list)."""
    return getattr(model, "checkpoint_parameters", None) or sum(p.numel() for p in model.parameters())
