"""Imports that cannot poison (issue 35, item 4), over real HTTP against a real server: a state
whose tensors are finite but extreme (every float 3e38, or alternating ±3e38) is refused with
400 invalid_state on `POST /v1/sessions/import` (no session is created) and on
`PUT /v1/sessions/{id}/state` (the session keeps its version, tokens and state), while a victim's
greedy stream beside them finishes all its tokens; an ordinary exported state still round-trips
and continues. The test process runs no model: states are edited with numpy."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import load as load_numpy
from safetensors.numpy import save as save_numpy

from tests.e2e.session_tools import MODEL, append, create, document, info, ok, safetensors_metadata
from tests.e2e.test_isolation import VICTIM, assert_same_as_alone, stream_events, victim_alone


def every_float_replaced(blob: bytes, fill) -> bytes:
    """The exported state `blob` with every floating state tensor replaced by `fill(array)`; the
    next-token row is left as it is (it is checked on its own), the checksum dropped (an import
    without one is allowed)."""
    tensors = load_numpy(blob)
    metadata = {k: v for k, v in safetensors_metadata(blob).items() if k != "checksum"}
    changed = {name: np.ascontiguousarray(fill(array)) if name.startswith("state.") and array.dtype.kind == "f"
               else array for name, array in tensors.items()}
    return save_numpy(changed, metadata=metadata)


def extreme(array: np.ndarray) -> np.ndarray:
    return np.full_like(array, 3e38)


def alternating_extreme(array: np.ndarray) -> np.ndarray:
    signs = (np.arange(array.size) % 2 * 2 - 1).reshape(array.shape)
    return (signs * 3e38).astype(array.dtype)


def newest_session(client) -> str | None:
    page = ok(client.get("/v1/sessions", params={"limit": 1}))["data"]
    return page[0]["id"] if page else None


def assert_invalid_state(response) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_state", error
    assert "state tensor '" in error["message"] and "3e+38" in error["message"], error


def test_extreme_states_are_refused_on_import_and_put_while_a_stream_runs(client):
    expected = victim_alone(client)
    session = create(client)
    append(client, session, document(71))
    before = client.get(f"/v1/sessions/{session}/state").content
    described = info(client, session)
    poisons = {"3e38": every_float_replaced(before, extreme),
               "alternating ±3e38": every_float_replaced(before, alternating_extreme)}

    with client.stream("POST", "/v1/completions", json=VICTIM) as response:
        assert response.status_code == 200
        events = stream_events(response)
        seen = [next(events)]  # the victim is running
        for name, blob in poisons.items():
            assert_invalid_state(client.post("/v1/sessions/import", content=blob))
            assert newest_session(client) == session, f"the refused import of {name} created a session"
            assert_invalid_state(client.put(f"/v1/sessions/{session}/state", content=blob))
        seen += list(events)

    assert_same_as_alone(seen, expected)  # the victim finished all its tokens, as alone
    after = info(client, session)
    assert (after["version"], after["tokens"]) == (described["version"], described["tokens"])
    unchanged = load_numpy(client.get(f"/v1/sessions/{session}/state").content)
    for name, array in load_numpy(before).items():
        assert np.array_equal(unchanged[name], array), name


def test_an_ordinary_exported_state_round_trips_and_continues(client):
    session = create(client)
    append(client, session, document(72))
    exported = client.get(f"/v1/sessions/{session}/state").content
    copy = ok(client.post("/v1/sessions/import", content=exported))
    assert copy["tokens"] == info(client, session)["tokens"]
    reexported = load_numpy(client.get(f"/v1/sessions/{copy['id']}/state").content)
    for name, array in load_numpy(exported).items():
        assert np.array_equal(reexported[name], array), name
    ok(client.put(f"/v1/sessions/{session}/state", content=exported))  # a PUT of its own state
    body = {"model": MODEL, "prompt": "\n", "max_tokens": 8, "temperature": 0}
    continued = [ok(client.post("/v1/completions", json={**body, "session_id": sid}))["choices"][0]["text"]
                 for sid in (session, copy["id"])]
    assert continued[0] == continued[1]  # the import continues exactly as the original
