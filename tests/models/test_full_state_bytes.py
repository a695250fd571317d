"""`LanguageModel.full_state_bytes()`, computed from shapes, is exactly `State.nbytes()` of a real
state whose memory is full: for every registered architecture, a tiny model fed a history past
every window and memory it keeps (the Reformer's, which grows, exactly up to its history limit),
in float32 and with the floating tensors counted as bfloat16 (the cache's XLSERVE_STATE_DTYPE)."""

from __future__ import annotations

import pytest
import torch

from xlserve.models.registry import ARCHITECTURES, build_model
from xlserve.models.training.presets import preset_config
from xlserve.models.xlnet import XLNet, XLNetConfig

# longer than every tiny preset's memory: Transformer-XL's and XLNet's mem_len 32, the adaptive
# span's 48 + 8 - 1 positions per head, the vanilla window of 32, the windows of the others
HISTORY_TOKENS = 200
REFORMER_AXIAL_SHAPE = [8, 16]  # a history limit of 128 positions, which a test can fill


def tiny_model(architecture: str):
    torch.manual_seed(0)
    config = preset_config(architecture, "tiny")
    if architecture == "reformer":
        config = {**config, "axial_pos_shape": REFORMER_AXIAL_SHAPE}
    return build_model(architecture, config).eval()


def state_after(model, length: int):
    history = torch.tensor([[(7 * i + 3) % model.vocab_size for i in range(length)]])
    with torch.inference_mode():
        _, state = model(history, model.init_state(1))
    return state


def bytes_with_floating_as(state, dtype: torch.dtype) -> int:
    """The state's bytes with its floating tensors in `dtype`, those it keeps in float32 aside."""
    element = torch.empty(0, dtype=dtype).element_size()
    return sum(t.numel() * (element if t.is_floating_point() and name.split(".")[0] not in state.kept_in_float32
                            else t.element_size())
               for name, t in state._named_tensors())


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_full_state_bytes_is_a_full_memory_nbytes(architecture):
    model = tiny_model(architecture)
    length = model.history_limit or HISTORY_TOKENS
    if architecture == "vanilla":  # its largest state: a window one byte short of full, with its key/value cache
        length = model.config.context_len - 1
        assert state_after(model, length).nbytes() > state_after(model, HISTORY_TOKENS).nbytes()
    full = state_after(model, length)
    assert model.full_state_bytes() == full.nbytes()
    assert model.full_state_bytes(torch.bfloat16) == bytes_with_floating_as(full, torch.bfloat16)
    if not model.state_grows_with_context and architecture != "vanilla":  # bounded: one more token leaves it
        assert state_after(model, length + 1).nbytes() == full.nbytes()


def test_the_shipped_formulas_agree_where_a_model_has_one():
    """The Conformer's and the adaptive span's own byte formulas (their cards' figures) say the same."""
    assert tiny_model("conformer").full_state_bytes() == tiny_model("conformer").state_bytes()
    span = tiny_model("adaptive-span")
    assert span.full_state_bytes() == span.state_bytes_when_full()


def test_a_memory_that_keeps_everything_has_no_full_size():
    torch.manual_seed(0)
    model = XLNet(XLNetConfig(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=None,
                              same_length=False))
    assert model.state_grows_with_context and model.history_limit is None
    assert model.full_state_bytes() is None


def test_the_wt103_shape_is_236_mb_without_building_it():
    """transfo-xl-wt103's memory, 18 layers x 1,600 positions x keys and values x 1,024 x 4 bytes,
    from its config alone: the formula needs no forward (a tiny width stands in, scaled)."""
    from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig

    model = TransformerXL(TransformerXLConfig(vocab_size=16, n_layer=18, d_model=16, n_head=16, d_head=64,
                                              d_inner=16, mem_len=1600))
    # keys and values of 16 heads x 64 = 1,024 numbers per position, plus one bool per position
    assert model.full_state_bytes() == 18 * 1600 * 2 * 1024 * 4 + 1600
    assert model.full_state_bytes(torch.bfloat16) == 18 * 1600 * 2 * 1024 * 2 + 1600
