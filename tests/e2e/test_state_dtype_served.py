"""A real server with XLSERVE_STATE_DTYPE=bfloat16 beside the default (float32) one, both serving
the tiny Transformer-XL: its sessions count half the bytes of float32 memories, its exports say
bfloat16, a float32 export imported into it is converted (and continues within a stated
tolerance), and a state in a dtype no state is kept in is refused naming it."""

import json

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import CONTINUATION, MODEL, append, create, document, info, ok, safetensors_metadata, score

# largest difference (nats) between a continuation's log-probs from a bfloat16-stored session and
# from the same history kept in float32 (tests/server/test_state_dtype.py says why it is ample)
LOG_PROB_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def half(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess([tiny_checkpoint], env={"XLSERVE_STATE_DTYPE": "bfloat16"},
                            log_path=tmp_path_factory.mktemp("logs") / "bfloat16.log").start()
    yield process
    process.stop()


def memory_bytes(checkpoint, element_size: int) -> int:
    """Keys and values of a full Transformer-XL memory, at `element_size` bytes a value."""
    config = json.loads((checkpoint / "config.json").read_text())["config"]
    return 2 * config["n_layer"] * config["mem_len"] * config["n_head"] * config["d_head"] * element_size


def test_bfloat16_sessions_hold_half_the_bytes_and_export_and_import_say_so(server, half, tiny_checkpoint):
    text = document(1)  # longer than mem_len: the memory is full
    with server.client() as single, half.client() as halved:
        full_session, half_session = create(single), create(halved)
        append(single, full_session, text)
        append(halved, half_session, text)
        full_bytes, half_bytes = info(single, full_session)["state_bytes"], info(halved, half_session)["state_bytes"]
        # the bool `valid` row and the float32 next-token row are as they were; the memory is halved
        assert full_bytes - half_bytes == memory_bytes(tiny_checkpoint, 4) - memory_bytes(tiny_checkpoint, 2)

        exported = halved.get(f"/v1/sessions/{half_session}/state")
        assert exported.status_code == 200, exported.text
        assert safetensors_metadata(exported.content)["state_dtype"] == "bfloat16"
        kept = load_safetensors(exported.content)
        assert {str(t.dtype) for name, t in kept.items() if t.is_floating_point() and name.startswith("state.")} \
            == {"torch.bfloat16"}
        assert kept["next_log_probs"].dtype == torch.float32

        full_export = single.get(f"/v1/sessions/{full_session}/state").content
        assert safetensors_metadata(full_export)["state_dtype"] == "float32"
        imported = ok(halved.post("/v1/sessions/import", content=full_export))
        assert imported["state_bytes"] == half_bytes  # converted to the server's state dtype
        again = halved.get(f"/v1/sessions/{imported['id']}/state").content
        assert safetensors_metadata(again)["state_dtype"] == "bfloat16"

        expected = score(single, full_session)
        for session in (imported["id"], half_session):
            continued = score(halved, session)
            assert len(continued) == len(expected) == len(CONTINUATION)
            assert max(abs(a - b) for a, b in zip(continued, expected)) <= LOG_PROB_TOLERANCE


def test_an_import_in_an_unknown_dtype_is_refused_naming_it(server, half):
    with server.client() as single, half.client() as halved:
        session = create(single)
        append(single, session, document(2))
        blob = single.get(f"/v1/sessions/{session}/state").content
        meta = safetensors_metadata(blob)
        tensors = load_safetensors(blob)
        name = next(k for k, t in tensors.items() if k.startswith("state.") and t.is_floating_point())
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
        meta.pop("checksum")  # an import written by another tool: no checksum to match
        refused = halved.post("/v1/sessions/import", content=save_safetensors(tensors, metadata=meta))
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_state"
        assert "float8_e4m3fn" in error["message"] and name.removeprefix("state.") in error["message"]
        meta["state_dtype"] = "int4"
        del tensors[name]
        unknown = halved.post("/v1/sessions/import", content=save_safetensors(
            {**tensors, name: load_safetensors(blob)[name]}, metadata=meta))
        assert unknown.status_code == 400 and "int4" in unknown.json()["error"]["message"], unknown.text
