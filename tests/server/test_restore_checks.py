"""A session restored from a lower tier goes through the model's whole check
(`LanguageModel.check_session`), as an import does: a stored copy whose checksum is right but
whose contents the model could not have produced (a next-token row with +inf, a NaN in its
memory) makes the session unavailable instead of reaching a batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from xlserve.models.registry import build_model
from xlserve.models.training.presets import preset_config
from xlserve.server.cache.codec import SessionData, decode, encode, session_data
from xlserve.server.cache.errors import SessionUnavailable
from xlserve.server.cache.session_cache import SessionCache


def tiny_model():
    torch.manual_seed(0)
    return build_model("transformer-xl", preset_config("transformer-xl", "tiny")).eval()


def poison_row(data: SessionData) -> SessionData:
    row = data.next_log_probs.clone()
    row[7] = float("inf")
    return SessionData(data.state, data.tokens, row)


def poison_memory(data: SessionData) -> SessionData:
    keys = [k.clone() for k in data.state.keys]
    keys[0].view(-1)[0] = float("nan")
    return SessionData(dataclasses.replace(data.state, keys=keys), data.tokens, data.next_log_probs)


@pytest.mark.parametrize("poison, words", [(poison_row, "next_log_probs holds NaN or infinite"),
                                           (poison_memory, "'keys.0' holds NaN or infinite")])
def test_a_poisoned_copy_on_disk_is_refused_when_restored(tmp_path, poison, words):
    model = tiny_model()
    with torch.inference_mode():
        log_probs, state = model(torch.tensor([list(b"import os\nimport sys\n" * 4)]), model.init_state(1))
    data = SessionData(state=state, tokens=log_probs.shape[1], next_log_probs=log_probs[0, -1])
    nbytes = data.nbytes()
    cache = SessionCache(tmp_path / "state", nbytes, nbytes, None)
    cache.open({"m": model})
    session = cache.create("m", None, data).id
    cache.create("m", None, data.clone())  # pushes the first to host
    cache.create("m", None, data.clone())  # ... and on to disk
    assert cache.info(session, None).tier == "disk"

    # a copy with a valid checksum (written as the cache writes it) but poisoned contents
    meta, tensors, next_log_probs = decode(cache.disk.read(session))
    stored = session_data(model.state_class, meta, tensors, next_log_probs)
    cache.disk.write(session, encode(poison(stored), meta))

    with pytest.raises(SessionUnavailable, match=words):
        cache.acquire(session, None)
