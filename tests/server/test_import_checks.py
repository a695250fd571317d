"""An imported state (POST /v1/sessions/import, PUT /v1/sessions/{id}/state) that is finite but
extreme is refused at the door with invalid_state (server/engine/process.py `validated_import`):
a floating tensor beyond STATE_MAGNITUDE_BOUND, or a state from which one forward step gives a
log-probability that is not finite. Every state a model makes itself still passes, for every
architecture."""

from __future__ import annotations

import pytest
import torch

from xlserve.models.registry import build_model
from xlserve.models.training.presets import preset_config
from xlserve.server.cache.codec import SessionData, encode
from xlserve.server.engine import process
from xlserve.server.engine.errors import InvalidInput
from xlserve.server.engine.process import STATE_MAGNITUDE_BOUND, decode_import, validated_import

ARCHITECTURES = ["transformer-xl", "infinity-former", "vanilla", "xlnet", "longformer", "logsparse",
                 "adaptive-span", "performer", "linformer", "conformer", "lite-transformer", "reformer",
                 "mamba", "mamba2", "rwkv"]
# the vanilla transformer's state is its window of token ids: nothing floating to poison
FLOATING_STATE_ARCHITECTURES = [architecture for architecture in ARCHITECTURES if architecture != "vanilla"]
DOCUMENT = list(b"import os\nimport sys\n\ndef main(argv):\n    return len(argv) * 2\n" * 4)


def tiny_model(architecture: str):
    torch.manual_seed(0)
    return build_model(architecture, preset_config(architecture, "tiny")).eval()


def state_after_document(model) -> SessionData:
    with torch.no_grad():
        log_probs, state = model(torch.tensor([DOCUMENT]), model.init_state(1))
    return SessionData(state=state, tokens=len(DOCUMENT), next_log_probs=log_probs[0, -1])


def imported(model, data: SessionData) -> SessionData:
    """`data` through the import path, as an exported file of model "m" would go."""
    blob = encode(data, {"model": "m", "architecture": model.architecture})
    return validated_import("m", model, *decode_import(blob))


def every_float_set_to(data: SessionData, fill) -> SessionData:
    tensors = {name: fill(t) if t.is_floating_point() else t for name, t in data.state.to_tensors().items()}
    return SessionData(type(data.state).from_tensors(tensors), data.tokens, data.next_log_probs)


def extreme(tensor: torch.Tensor) -> torch.Tensor:
    return torch.full_like(tensor, 3e38)


def alternating_extreme(tensor: torch.Tensor) -> torch.Tensor:
    signs = (torch.arange(tensor.numel()) % 2 * 2 - 1).reshape(tensor.shape).to(tensor.dtype)
    return signs * 3e38


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_state_the_model_made_is_imported_unchanged(architecture):
    model = tiny_model(architecture)
    data = state_after_document(model)
    back = imported(model, data)
    assert back.tokens == data.tokens
    for name, tensor in data.state.to_tensors().items():
        assert torch.equal(back.state.to_tensors()[name], tensor), name


@pytest.mark.parametrize("architecture", FLOATING_STATE_ARCHITECTURES)
@pytest.mark.parametrize("fill", [extreme, alternating_extreme], ids=["3e38", "alternating"])
def test_an_extreme_state_is_refused_as_invalid_state(architecture, fill):
    model = tiny_model(architecture)
    poisoned = every_float_set_to(state_after_document(model), fill)
    # the bound names the tensor; an architecture's own check (the Performer's sums) may come first
    with pytest.raises(InvalidInput, match="state tensor '.*' holds") as refused:
        imported(model, poisoned)
    assert refused.value.code == "invalid_state" and refused.value.param == "body"


def test_values_just_within_the_bound_pass_the_bound_check():
    model = tiny_model("performer")  # its running sums are the largest values a real state holds
    data = state_after_document(model)
    process.check_state_magnitudes(every_float_set_to(data, lambda t: torch.full_like(t, STATE_MAGNITUDE_BOUND)))
    with pytest.raises(ValueError, match="magnitude 2e\\+12, beyond the 1e\\+12"):
        process.check_state_magnitudes(every_float_set_to(data, lambda t: torch.full_like(t, STATE_MAGNITUDE_BOUND * 2)))


def test_the_forward_probe_refuses_a_state_the_bound_lets_through(monkeypatch):
    # with no bound at all, the probe alone must catch the overflow: one step from 3e38 keys and
    # values gives log-probabilities that are not finite
    monkeypatch.setattr(process, "STATE_MAGNITUDE_BOUND", float("inf"))
    model = tiny_model("transformer-xl")
    with pytest.raises(InvalidInput, match="not finite") as refused:
        imported(model, every_float_set_to(state_after_document(model), alternating_extreme))
    assert refused.value.code == "invalid_state"


def test_a_state_at_the_history_limit_is_imported_without_a_probe():
    # the Reformer stops at max_context: a state that holds it all has no room for the probe's
    # token, and no request can feed it one either, so it is not probed (and not refused)
    model = tiny_model("reformer")
    limit = model.history_limit
    tokens = (DOCUMENT * (limit // len(DOCUMENT) + 1))[:limit]
    with torch.no_grad():
        log_probs, state = model(torch.tensor([tokens]), model.init_state(1))
    data = SessionData(state=state, tokens=limit, next_log_probs=log_probs[0, -1])
    assert imported(model, data).tokens == limit
