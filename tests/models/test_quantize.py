"""XLSERVE_QUANTIZE=int8 (models/quantize.py): weight-only int8 linear layers at load time.

- every shipped checkpoint keeps its held-out bits per byte within 0.02 of float32 (the issue's
  bound) on the first QUALITY_BYTES held-out bytes (about 30 s for all twelve on one thread);
- the invariants the engine relies on hold for an int8 model: a row's tokens do not depend on
  its batch companions, and chunked feeding gives what one pass gives;
- Transformer-XL's adaptive softmax multiplies through int8 copies of its own weight matrices;
- int8 is refused on any device but the CPU.

tests/server/test_quantize_setting.py has the setting and the card.
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from xlserve.models import quantize
from xlserve.models.checkpoint import load_checkpoint
from xlserve.models.quantize import (
    KEPT_FLOAT,
    Int8Linear,
    QuantizationError,
    int8_weight,
    parameter_count,
    quantize_model,
    weight_bytes,
)
from xlserve.models.training.data import stdlib_corpus
from xlserve.models.training.evaluate import bits_per_byte, scored_part
from xlserve.models.training.train import held_out_documents
from xlserve.models.layers.xl_memory import XLMemory
from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig

from tests.models.helpers import one_thread, run_in_chunks, tokens  # noqa: F401 (one_thread: a fixture)

WEIGHTS = Path(__file__).resolve().parents[2] / "weights"
SHIPPED = sorted(p for p in WEIGHTS.glob("*-stdlib") if (p / "model.safetensors").is_file())
QUALITY_BYTES = 4000  # held-out bytes scored per checkpoint, float32 and int8
QUALITY_BOUND = 0.02  # bits per byte, issue 36 item 4


@pytest.fixture(scope="module")
def held_out() -> list[bytes]:
    return held_out_documents(stdlib_corpus(), QUALITY_BYTES)


def small_transformer_xl(**changes) -> TransformerXL:
    torch.manual_seed(0)
    config = dict(vocab_size=256, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=8, tgt_len=8)
    return TransformerXL(TransformerXLConfig(**{**config, **changes})).eval()


def test_int8_weights_are_the_weight_to_half_a_step_per_output_channel():
    weight = torch.randn(24, 32) * torch.logspace(-3, 1, 24)[:, None]  # channels of very different sizes
    values, scales = int8_weight(weight)
    assert values.dtype == torch.int8 and scales.dtype == torch.float32 and values.abs().max() <= 127
    rebuilt = values.float() * scales.float()[:, None]
    assert ((rebuilt - weight).abs() <= scales.float()[:, None] / 2 + 1e-12).all()


def test_a_row_is_the_same_alone_and_in_a_batch_and_close_to_float():
    layer = nn.Linear(64, 48)
    int8 = Int8Linear.from_linear(layer)
    rows = torch.randn(9, 64)
    batched = int8(rows)
    for i in range(rows.shape[0]):
        assert torch.equal(int8(rows[i : i + 1]), batched[i : i + 1])  # bit for bit: the engine batches sessions
    with torch.no_grad():
        expected = layer(rows)
    assert ((batched - expected).norm() / expected.norm()).item() < 0.02
    assert int8(torch.randn(2, 0, 64)).shape == (2, 0, 48)


def test_the_packed_kernel_and_int_mm_give_the_same_numbers_at_any_width():
    # the int32 sums are exact, so the fallback (torch._int_mm) is the packed kernel bit for bit;
    # widths that are no multiple of 16 (mamba-stdlib's dt_proj reads 12 values) included
    for width in (12, 24, 72, 1024):
        layer = nn.Linear(width, 40)
        packed = Int8Linear.from_linear(layer)
        if packed.kernel != "packed":
            pytest.skip("no packed int8 kernel on this CPU")
        fallback = Int8Linear.from_linear(layer)
        fallback.weight_int8, fallback.packed = packed.int8_values().clone(), None
        assert fallback.kernel == "int_mm"
        rows = torch.randn(5, width) * torch.logspace(-2, 2, 5)[:, None]  # rows of very different sizes
        assert torch.equal(packed(rows), fallback(rows))
        assert torch.equal(packed.weight, fallback.weight)


def sums_in_16_bit_pairs(whole_rows, packed):
    """What a packed kernel without VNNI computes: each row enters as uint8 (x + 128), products
    are added in pairs in 16 bits, saturating (vpmaddubsw), then summed in 32 bits and the zero
    point taken off."""
    quantized = torch.ops.quantized.linear_unpack(packed)[0]
    values, scales = quantized.int_repr().int(), quantized.q_per_channel_scales().float()
    unsigned = (whole_rows + 128).int()  # (M, in), 1..255
    products = unsigned[:, None, :] * values[None, :, :]  # (M, out, in)
    pairs = products.view(*products.shape[:2], -1, 2).sum(-1).clamp(-32768, 32767)
    return (pairs.sum(-1) - 128 * values.sum(1)).float() * scales


def test_a_packed_kernel_that_saturates_is_not_used(monkeypatch):
    # the check runs once a process, on the extremes: rows of +-127 against weights of one sign
    # make pairs of 64,770, which a 16-bit pair sum cannot hold; a layer then sums by _int_mm
    monkeypatch.setattr(quantize, "packed_sums", sums_in_16_bit_pairs)
    quantize.packed_kernel_is_exact.cache_clear()
    try:
        layer = Int8Linear.from_linear(nn.Linear(64, 16))
        assert layer.kernel == "int_mm" and layer.weight_int8.dtype == torch.int8
        rows = torch.randn(3, 64)
        assert (layer(rows) - nn.functional.linear(rows, layer.weight, layer.bias)).abs().max() < 0.05
    finally:
        monkeypatch.undo()
        quantize.packed_kernel_is_exact.cache_clear()
    assert Int8Linear.from_linear(nn.Linear(64, 16)).kernel == "packed" or not quantize.packed_kernel_is_exact()


def test_the_simulated_saturating_kernel_is_exact_where_pairs_fit():
    # the simulation above is the packed kernel's own arithmetic while no pair passes 16 bits
    if not quantize.packed_kernel_is_exact():
        pytest.skip("no packed int8 kernel on this CPU")
    layer = Int8Linear.from_linear(nn.Linear(64, 16))
    small = torch.randint(-127, 1, (4, 64)).float()  # enter as 1..128: a pair is at most 128 * 127 * 2 = 32,512
    assert torch.equal(sums_in_16_bit_pairs(small, layer.packed), quantize.packed_sums(small, layer.packed))


def test_every_linear_layer_but_the_kept_ones_is_int8_and_counted_in_weight_bytes():
    model = small_transformer_xl(d_inner=72)  # the feed-forward's second product takes 72 inputs
    float_bytes = weight_bytes(model)
    quantize_model(model, "int8")
    widths = {type(m).__name__: set() for m in model.modules()}
    for module in model.modules():
        if isinstance(module, (nn.Linear, Int8Linear)):
            widths[type(module).__name__].add(module.in_features)
    assert widths["Int8Linear"] == {32, 72}
    assert all(isinstance(layer.r_net, nn.Linear) for layer in model.layers)  # KEPT_FLOAT: it builds the tables
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    # a packed layer's int8 values are no buffer: weight_bytes counts them, one byte a weight
    assert all(layer.packed_bytes() == layer.in_features * layer.out_features for layer in layers)
    # the head's float matrix is the input embedding's (tied), which stays: it is not quantized away
    quantized_away = sum(4 * layer.in_features * layer.out_features for layer in layers if layer is not model.head)
    scales_and_values = sum(4 * layer.out_features + layer.in_features * layer.out_features for layer in layers)
    assert weight_bytes(model) == float_bytes - quantized_away + scales_and_values


@pytest.mark.parametrize("directory", SHIPPED, ids=lambda d: d.name)
def test_int8_bits_per_byte_are_within_the_bound_of_float32(directory, held_out, one_thread):
    trained = json.loads((directory / "evaluation.json").read_text())[0]
    model = load_checkpoint(directory)
    documents = [scored_part(model, d) for d in held_out]
    options = dict(chunk_len=trained["chunk_len"], window_stride=trained.get("window_stride"))
    float_bits = bits_per_byte(model, documents, **options)
    float_bytes, parameters = weight_bytes(model), parameter_count(model)
    quantize_model(model, "int8")  # every linear layer becomes int8 but those the architecture keeps float
    float_layers = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert float_layers == set(KEPT_FLOAT.get(model.architecture, ()))
    assert abs(bits_per_byte(model, documents, **options) - float_bits) <= QUALITY_BOUND
    assert weight_bytes(model) < float_bytes / 2 and parameter_count(model) == parameters


def test_an_int8_transformer_xl_keeps_the_engine_invariants():
    model = quantize_model(small_transformer_xl(), "int8")
    ids = tokens(2, 24)
    # chunked feeding is one pass, to the int8 rounding of the activations (a chunk's rows
    # go through the kernel in other groups, summed in another order)
    whole, whole_state = run_in_chunks(model, ids, ids.shape[1])
    chunked, chunked_state = run_in_chunks(model, ids, 5)
    assert (chunked - whole).abs().max().item() < 2e-2
    for (name, a), (_, b) in zip(chunked_state._named_tensors(), whole_state._named_tensors()):
        assert (a.float() - b.float()).abs().max().item() < 2e-2, name
    # rows of different histories decoded in one batch are what they are alone: the int8 products
    # are per row, bit for bit; what differs is float rounding elsewhere (the attention's batched
    # products over memories of different lengths)
    histories = [tokens(1, 3, seed=2), tokens(1, 30, seed=3), tokens(1, 7, seed=4)]
    steps = tokens(3, 4, seed=5)
    with torch.no_grad():
        alone_states = [model(history, model.init_state(1))[1] for history in histories]
        batched, _ = run_in_chunks(model, steps, 1, XLMemory.concat(alone_states))
        for row, state in enumerate(alone_states):
            alone, _ = run_in_chunks(model, steps[row : row + 1], 1, state)
            assert (batched[row] - alone[0]).abs().max().item() < 2e-2
    state = model.init_state(1)
    greedy = {}
    for batch in (1, 4):  # greedy decoding of one prompt alone and as one row of four
        with torch.no_grad():
            log_probs, state = model(tokens(1, 6, seed=7).expand(batch, 6), model.init_state(batch))
            picked = []
            for _ in range(8):
                token = log_probs[:, -1].argmax(-1, keepdim=True)
                picked.append(token[0].item())
                log_probs, state = model(token, state)
        greedy[batch] = picked
    assert greedy[1] == greedy[4]


def test_the_adaptive_softmax_multiplies_with_int8_copies():
    model = small_transformer_xl(adaptive=True, d_embed=32, cutoffs=[64, 160], div_val=2, tie_projs=[False, True, True])
    ids = tokens(1, 12)
    with torch.no_grad():
        expected, _ = model(ids, model.init_state(1))
    quantize_model(model, "int8")
    # every product, the last cluster's 8-wide vectors too
    assert set(model.head.int8_products) == {"project0", "project1", "project2", "output0", "output1", "output2",
                                             "clusters"}
    with torch.no_grad():
        log_probs, _ = model(ids, model.init_state(1))
    assert (log_probs.exp().sum(-1) - 1).abs().max().item() < 1e-4  # still a distribution over the vocabulary
    assert (log_probs - expected).abs().max().item() < 5e-2


def test_int8_is_cpu_only():
    model = small_transformer_xl().to("meta")  # any device but the CPU: CUDA is refused the same way
    with pytest.raises(QuantizationError, match="CPU only"):
        quantize_model(model, "int8")
    with pytest.raises(QuantizationError, match="not one of"):
        quantize_model(small_transformer_xl(), "int4")


@pytest.mark.parametrize("architecture", ["xlnet", "conformer", "adaptive-span", "infinity-former"])
def test_a_model_quantized_after_it_ran_reads_tables_of_its_int8_projections(architecture):
    """The relative-key tables a model keeps between calls are built from its r_net: quantized
    after a forward (as the real-size bench quantizes a copy of a model that ran), the tables
    built from the float r_net go, and it answers as the same model quantized before any call."""
    from xlserve.models.registry import build_model
    from xlserve.models.training.presets import preset_config

    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    answers = []
    for run_first in (False, True):
        torch.manual_seed(0)
        model = build_model(architecture, preset_config(architecture, "tiny")).eval()
        with torch.inference_mode():
            if run_first:
                model(ids, model.init_state(1))
            quantize_model(model, "int8")
            answers.append(model(ids, model.init_state(1))[0])
    assert torch.equal(answers[0], answers[1])


def test_each_float_layer_is_let_go_once_replaced_and_a_shared_one_becomes_one_int8_layer(monkeypatch):
    """Quantizing walked a list of every module, which kept each float layer alive until the last
    was quantized: the int8 copies piled up on the whole float model (+36% of the weights at
    wt103's size). Each float layer now goes once its int8 layer holds its place."""
    import gc
    import weakref

    model = small_transformer_xl()
    shared = nn.Linear(64, 64)
    model.first_of_two, model.second_of_two = nn.Sequential(shared), nn.Sequential(shared)  # one layer, two parents
    del shared
    linears = [weakref.ref(m) for m in model.modules() if type(m) is nn.Linear]
    alive_when_quantized = []
    from_linear = quantize.Int8Linear.from_linear

    def counting(layer):
        gc.collect()
        alive_when_quantized.append(sum(ref() is not None for ref in linears))
        return from_linear(layer)

    monkeypatch.setattr(quantize.Int8Linear, "from_linear", staticmethod(counting))
    quantize_model(model, "int8")
    # one fewer float layer alive at each (those kept in float, Transformer-XL's r_net, never go)
    assert len(alive_when_quantized) >= 3
    assert alive_when_quantized == list(range(len(linears), len(linears) - len(alive_when_quantized), -1))
    assert model.first_of_two[0] is model.second_of_two[0] and isinstance(model.first_of_two[0], quantize.Int8Linear)
