"""Every registered architecture's state goes through the cache (host, disk) and comes back so
that the model continues bit-identically: the cache only uses the State interface."""

import pytest
import torch

from xlserve.models.registry import ARCHITECTURES, build_model
from xlserve.models.training.presets import preset_config
from xlserve.server.cache.codec import SessionData, decode, encode, session_data
from xlserve.server.cache.session_cache import SessionCache


def tiny_model(architecture: str):
    torch.manual_seed(0)
    return build_model(architecture, preset_config(architecture, "tiny")).eval()


def feed(model, data: SessionData, tokens: list[int]) -> tuple[torch.Tensor, SessionData]:
    with torch.inference_mode():
        log_probs, state = model(torch.tensor([tokens]), data.state)
    return log_probs, SessionData(state=state, tokens=data.tokens + len(tokens), next_log_probs=log_probs[0, -1])


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_state_round_trips_through_every_tier(architecture, tmp_path):
    model = tiny_model(architecture)
    history = list(b"import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n" * 2)  # > one segment
    _, data = feed(model, SessionData(model.init_state(1), 0, None), history)
    nbytes = data.nbytes()
    assert nbytes > 0

    cache = SessionCache(tmp_path / "state", nbytes, nbytes, None)
    cache.open({"m": model})
    sid = cache.create("m", None, data).id
    cache.create("m", None, data.clone())  # pushes the first to host
    cache.create("m", None, data.clone())  # ... and on to disk
    assert cache.info(sid, None).tier == "disk" and cache.info(sid, None).state_bytes == nbytes

    lease = cache.acquire(sid, None)  # restored from its safetensors file
    model.check_state(lease.data.state)
    continuation = list(b"    print('done')\n")
    expected, _ = feed(model, data, continuation)
    restored, _ = feed(model, lease.data, continuation)
    assert torch.equal(expected, restored)
    cache.release(lease)

    meta, tensors, next_log_probs = decode(encode(data, {"model": "m"}))
    again = session_data(model.state_class, meta, tensors, next_log_probs)
    model.check_state(again.state)
    assert torch.equal(feed(model, again, continuation)[0], expected)
