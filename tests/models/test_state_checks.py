"""`LanguageModel.check_session` / `check_state` / `check_next_log_probs` refuse what a model could
not have produced, naming the tensor at fault, and accept every state the model and the engine's
batching do produce: for every registered architecture, a real state after a real history."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from xlserve.models.infinity_former import ContinuousMemory
from xlserve.models.layers.xl_memory import XLMemory
from xlserve.models.registry import ARCHITECTURES, build_model
from xlserve.models.training.presets import preset_config
from xlserve.models.vanilla import ByteWindow

HISTORY = list(b"import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n" * 5)  # past every window


def tiny_model(architecture: str):
    torch.manual_seed(0)
    return build_model(architecture, preset_config(architecture, "tiny")).eval()


def session(model, tokens: list[int]):
    """(state, tokens seen, next_log_probs) after feeding `tokens` in one call."""
    with torch.inference_mode():
        log_probs, state = model(torch.tensor([tokens]), model.init_state(1))
    return state, len(tokens), log_probs[0, -1]


def with_tensor(state, name: str, change):
    """A copy of `state` whose tensor `name` ("keys.0", "valid") is change(copy of it)."""
    tensors = {key: value.clone() for key, value in state.to_tensors().items()}
    tensors[name] = change(tensors[name])
    return type(state).from_tensors(tensors)


def set_first(value):
    def change(tensor):
        tensor.view(-1)[0] = value
        return tensor
    return change


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def model(request):
    return tiny_model(request.param)


@pytest.mark.parametrize("length", [1, 7, len(HISTORY)])
def test_states_the_model_produces_pass(model, length):
    state, tokens, next_log_probs = session(model, HISTORY[:length])
    model.check_session(state, tokens, next_log_probs)
    model.check_session(model.init_state(1), 0, None)  # a fresh session


def test_states_from_a_batch_pass(model):
    """Rows of different histories batched (padded where the class pads), run a step, split: each
    row is a state its session could have, and passes with its own token count."""
    short, long = session(model, HISTORY[:5]), session(model, HISTORY[:40])
    try:
        batch = type(short[0]).concat([short[0], long[0]])
    except (RuntimeError, ValueError):
        pytest.skip("this class batches equal shapes only")
    with torch.inference_mode():
        log_probs, stepped = model(torch.tensor([[65], [66]]), batch)
    for (_, tokens, _), row, next_log_probs in zip([short, long], stepped.split(), log_probs[:, -1]):
        model.check_session(row, tokens + 1, next_log_probs)


def test_every_floating_state_tensor_must_be_finite(model):
    state, tokens, next_log_probs = session(model, HISTORY[:10])  # short: the vanilla window still has its cache
    floating = [name for name, tensor in state.to_tensors().items() if tensor.is_floating_point() and tensor.numel()]
    assert floating
    for name in floating:
        for bad in (float("nan"), float("inf"), float("-inf")):
            with pytest.raises(ValueError, match=f"'{name}' holds NaN or infinite"):
                model.check_session(with_tensor(state, name, set_first(bad)), tokens, next_log_probs)


def test_state_dtypes_must_be_the_models(model):
    state, tokens, next_log_probs = session(model, HISTORY[:10])
    name = next(name for name, tensor in state.to_tensors().items() if tensor.is_floating_point())
    with pytest.raises(ValueError, match=f"'{name}' is torch.float64"):
        model.check_session(with_tensor(state, name, lambda t: t.double()), tokens, next_log_probs)


def test_the_token_count_must_fit_the_state(model):
    state, tokens, next_log_probs = session(model, HISTORY[:3])
    with pytest.raises(ValueError, match="'(valid|position)'"):
        model.check_session(state, tokens + 1, next_log_probs)
    with pytest.raises(ValueError, match="needs next_log_probs"):
        model.check_session(state, tokens, None)
    with pytest.raises(ValueError, match="has seen no tokens"):
        model.check_session(model.init_state(1), 0, next_log_probs)


def test_every_state_tensor_has_the_same_batch_rows(model):
    state, tokens, next_log_probs = session(model, HISTORY[:9])
    name = list(state.to_tensors())[-1]  # the first tensor's rows are the state's batch size
    with pytest.raises(ValueError, match=f"'{name}' holds 2 batch rows"):
        model.check_state(with_tensor(state, name, lambda t: torch.cat([t, t])))


# -- the next-token row -------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    (set_first(float("nan")), "NaN or infinite"),
    (set_first(float("inf")), "NaN or infinite"),
    (set_first(float("-inf")), "NaN or infinite"),
    (lambda row: row + 1.0, "not a log-distribution"),  # probabilities summing to e
    (lambda row: row.double(), "float32 vector"),
    (lambda row: row[:-1], "float32 vector"),
    (lambda row: row[None], "float32 vector"),
])
def test_next_log_probs_must_be_a_finite_log_distribution(model, change, message):
    state, tokens, next_log_probs = session(model, HISTORY[:20])
    with pytest.raises(ValueError, match=message):
        model.check_session(state, tokens, change(next_log_probs.clone()))


# -- lengths that disagree between tensors ------------------------------------------------------


def xl_model():
    return tiny_model("transformer-xl")


def test_xl_keys_and_values_must_cover_the_same_positions():
    model = xl_model()
    state, tokens, next_log_probs = session(model, HISTORY[:10])
    for name in ("keys.1", "values.0"):
        shorter = with_tensor(state, name, lambda t: t[:, 1:])
        with pytest.raises(ValueError, match=f"'{name}' has shape .* positions of 'valid'"):
            model.check_session(shorter, tokens, next_log_probs)
    one_layer_less = XLMemory(keys=state.keys, values=state.values[:-1], valid=state.valid)
    with pytest.raises(ValueError):
        model.check_state(one_layer_less)


def test_xl_padding_comes_first():
    model = xl_model()
    state, tokens, next_log_probs = session(model, HISTORY[:10])
    padded_late = with_tensor(state, "valid", set_first(True))
    padded_late.valid[0, -1] = False
    with pytest.raises(ValueError, match="'valid' has padding after a valid position"):
        model.check_state(padded_late)


def test_xlnet_memory_must_fit_the_token_count():
    model = tiny_model("xlnet")
    state, tokens, next_log_probs = session(model, HISTORY[:5])
    model.check_session(state, tokens, next_log_probs)
    with pytest.raises(ValueError, match="'valid' marks 5 positions"):
        model.check_session(state, 4, next_log_probs)


def test_vanilla_window_tensors_must_agree():
    model = tiny_model("vanilla")
    state, tokens, next_log_probs = session(model, HISTORY[:10])
    assert isinstance(state, ByteWindow) and state.cache_length == state.length  # a window with its cache
    with pytest.raises(ValueError, match="'valid' has shape"):
        model.check_state(with_tensor(state, "valid", lambda t: t[:, 1:]))
    with pytest.raises(ValueError, match="'keys.0'"):
        model.check_state(with_tensor(state, "keys.0", lambda t: t[:, 1:]))
    slid, slid_tokens, slid_next = session(model, HISTORY)
    assert slid.cache_length == 0  # a window that slid keeps no cache
    L = model.config.context_len
    cache = [torch.zeros(1, L, *k.shape[2:]) for k in state.keys]
    claimed = dataclasses.replace(slid, cached=torch.ones(1, dtype=torch.bool), keys=cache,
                                  values=[c.clone() for c in cache])
    with pytest.raises(ValueError, match="'cached' claims a key/value cache"):
        model.check_session(claimed, slid_tokens, slid_next)


def test_infinity_former_position_must_be_the_token_count():
    model = tiny_model("infinity-former")
    state, tokens, next_log_probs = session(model, HISTORY[:30])
    assert isinstance(state, ContinuousMemory)
    with pytest.raises(ValueError, match="'position' says 30 tokens, the session has seen 31"):
        model.check_session(state, 31, next_log_probs)


def test_all_finite_checks_every_block_of_any_tensor():
    """`all_finite` (the checks of states, checkpoints and conversions) checks a block at a time,
    so that a check of a 98 MB embedding does not make 172 MB of temporaries: a non-finite value
    in any block, the last one's last element included, is found, in any layout and dtype."""
    from xlserve.models.interface import FINITE_CHECK_ELEMENTS, all_finite

    size = 2 * FINITE_CHECK_ELEMENTS + 3  # two whole blocks and a partial one
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensor = torch.zeros(size, dtype=dtype)
        assert all_finite(tensor) and all_finite(tensor[:0]) and all_finite(tensor.view(-1, 1)[::2])
        for where in (0, FINITE_CHECK_ELEMENTS - 1, FINITE_CHECK_ELEMENTS, size - 1):
            for bad in (float("nan"), float("inf"), float("-inf")):
                spoiled = tensor.clone()
                spoiled[where] = bad
                assert not all_finite(spoiled), (dtype, where, bad)
                assert not all_finite(spoiled.view(-1, 1).t())  # not contiguous the same way
