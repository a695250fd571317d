"""Sessions against the real server with small budgets: spill and restore across tiers,
bit-identical continuations, 409 for concurrent use, 503 when nothing can move, disconnects
that change nothing, fork, export and import."""

import threading

import httpx
import numpy as np
import pytest
from safetensors.numpy import load as load_numpy
from safetensors.numpy import save as save_numpy

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import (
    MODEL,
    append,
    create,
    document,
    full_state_bytes,
    info,
    metric,
    ok,
    safetensors_metadata,
    score,
    wait_idle,
)


@pytest.fixture(scope="module")
def unit(tiny_checkpoint) -> int:
    return full_state_bytes(tiny_checkpoint)


@pytest.fixture(scope="module")
def tiered(tiny_checkpoint, tmp_path_factory, unit):
    budget = str(unit * 5 // 2)  # two full sessions per tier, not three
    server = ServerProcess([tiny_checkpoint], env={
        "XLSERVE_DEVICE_STATE_BYTES": budget, "XLSERVE_HOST_STATE_BYTES": budget,
        "XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp("state")),
    }, log_path=tmp_path_factory.mktemp("logs") / "tiered.log").start()
    yield server
    server.stop()


@pytest.fixture
def client(tiered):
    with tiered.client() as c:
        yield c


def test_sessions_spill_to_host_and_disk_and_continue_bit_identically(client, unit):
    references, tested = [], []
    for i in range(3):
        reference = create(client)
        append(client, reference, document(i))
        references.append(score(client, reference))  # straight from the device, never evicted
        session = create(client)
        append(client, session, document(i))
        assert info(client, session)["state_bytes"] == unit
        tested.append(session)
    # least recently used first: ref0, s0, ref1, s1, ref2, s2; two per tier
    assert [info(client, s)["tier"] for s in tested] == ["disk", "host", "device"]
    for i, tier in [(2, "device"), (1, "host"), (0, "disk")]:
        assert info(client, tested[i])["tier"] == tier
        assert score(client, tested[i]) == references[i]  # exactly equal floats
        assert info(client, tested[i])["tier"] == "device"

    metrics = client.get("/metrics").text
    for tier in ("device", "host", "disk"):
        assert metric(metrics, "xlserve_session_cache_hits_total", model=MODEL, tier=tier) >= 1
    assert metric(metrics, "xlserve_session_promotions_total", model=MODEL, tier="disk") >= 1
    assert metric(metrics, "xlserve_session_evictions_total", model=MODEL, tier="device") >= 4
    assert metric(metrics, "xlserve_session_restore_latency_seconds_count", model=MODEL, tier="host") >= 1
    assert metric(metrics, "xlserve_sessions", model=MODEL, tier="device") == 2
    assert metric(metrics, "xlserve_session_state_bytes", model=MODEL, tier="device") == 2 * unit


def _stream(client, session_id: str, max_tokens: int = 4000):
    """Open a long generation on the session and wait for its first chunk: the lease is held."""
    context = client.stream("POST", "/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "session_id": session_id})
    response = context.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()  # keep it referenced: collecting it would close the connection
    assert next(line for line in lines if line.startswith("data: "))
    return context, lines


def test_disconnect_changes_nothing_and_503_when_every_device_session_is_in_use(client, tiered, unit):
    busy = [create(client) for _ in range(2)]
    for i, session in enumerate(busy):
        append(client, session, document(10 + i))
    before = [info(client, s) for s in busy]
    twins = [ok(client.post(f"/v1/sessions/{s}/fork"))["id"] for s in busy]
    waiting = create(client)
    append(client, waiting, document(12))  # a full state that is not on the device

    with tiered.client() as c1, tiered.client() as c2:
        streams = [_stream(c1, busy[0]), _stream(c2, busy[1])]
        assert all(info(client, s)["in_use"] for s in busy)
        refused = client.post(f"/v1/sessions/{waiting}/append", json={"text": "y"})
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "session_cache_full"
        assert "in use" in error["message"] and refused.headers["retry-after"]
        for context, _ in streams:  # the client goes away mid-stream
            context.__exit__(None, None, None)
    for session, old in zip(busy, before):
        now = wait_idle(client, session)
        assert (now["version"], now["tokens"]) == (old["version"], old["tokens"])
    assert append(client, waiting, "y")["version"] == 2  # room again
    for session, twin in zip(busy, twins):
        assert score(client, session) == score(client, twin)


def test_two_concurrent_requests_on_one_session_give_exactly_one_409(client, tiered):
    """Two completions on one session sent at once: one runs, the other is a 409 session_busy.

    Sent at once is up to the machine: on a loaded one a thread can stall past the other's 400
    tokens, and then both run, one after the other. So the race is run again on a fresh session,
    at most 4 times, while both ran; every run must be one of those two outcomes, the session's
    version counting exactly the completions that ran."""
    attempts = 4
    for attempt in range(1, attempts + 1):
        session = create(client)
        append(client, session, document(20))
        barrier = threading.Barrier(2)
        results = []

        def request():
            with tiered.client() as c:
                barrier.wait(timeout=30)
                results.append(c.post("/v1/completions", json={
                    "model": MODEL, "prompt": "y", "max_tokens": 400, "temperature": 0, "session_id": session}))

        threads = [threading.Thread(target=request) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        statuses = sorted(r.status_code for r in results)
        assert statuses in ([200, 409], [200, 200]), (attempt, [r.text for r in results])
        # one append, and each completion that ran
        assert wait_idle(client, session)["version"] == 1 + statuses.count(200), attempt
        if statuses == [200, 409]:
            break
    else:
        raise AssertionError(f"the two requests never overlapped in {attempts} attempts")
    busy = next(r for r in results if r.status_code == 409).json()["error"]
    assert busy["type"] == "session_busy" and busy["param"] == "session_id"


def test_fork_export_import(client):
    source = create(client)
    append(client, source, document(30))
    fork = ok(client.post(f"/v1/sessions/{source}/fork"))
    assert fork["id"] != source and fork["forked_from"] == source
    assert (fork["tokens"], fork["version"]) == (len(document(30)), 0)

    exported = client.get(f"/v1/sessions/{source}/state")
    assert exported.status_code == 200 and exported.headers["content-type"] == "application/octet-stream"
    blob = exported.content
    meta = safetensors_metadata(blob)
    assert meta["model"] == MODEL and meta["tokens"] == str(len(document(30))) and meta["owner"] == ""
    assert meta["architecture"] == "transformer-xl" and meta["checksum"].startswith("sha256:")

    imported = ok(client.post("/v1/sessions/import", content=blob))
    assert imported["tokens"] == len(document(30)) and imported["version"] == 0
    replaced = create(client)
    after = ok(client.put(f"/v1/sessions/{replaced}/state", content=blob))
    assert (after["version"], after["tokens"]) == (1, len(document(30)))
    expected = score(client, fork["id"])
    assert score(client, imported["id"]) == expected
    assert score(client, replaced) == expected
    assert score(client, source) == expected  # the fork diverged without touching its source
    assert score(client, fork["id"]) != expected  # ... and moved on itself


def test_import_refuses_states_that_do_not_fit(client):
    session = create(client)
    append(client, session, document(40))
    blob = client.get(f"/v1/sessions/{session}/state").content
    meta = safetensors_metadata(blob)
    tensors = load_numpy(blob)
    unchecked = {k: v for k, v in meta.items() if k != "checksum"}

    def refused(blob, match):
        response = client.put(f"/v1/sessions/{session}/state", content=blob)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and match in error["message"], error
        return error

    refused(save_numpy(tensors, metadata={**unchecked, "model": "txl-other"}), "belongs to model 'txl-other'")
    refused(save_numpy(tensors, metadata={**unchecked, "architecture": "xlnet"}), "architecture 'xlnet'")
    refused(b"not a safetensors file", "not an xlserve session state")
    tampered = dict(tensors)
    tampered["state.values.0"] = np.ascontiguousarray(tensors["state.values.0"][..., :16])  # wrong head width
    refused(save_numpy(tampered, metadata=meta), "checksum mismatch")
    refused(save_numpy(tampered, metadata=unchecked), "does not fit")
    missing = {k: v for k, v in tensors.items() if k != "state.keys.1"}
    refused(save_numpy(missing, metadata=unchecked), "does not fit")
    assert info(client, session)["version"] == 1  # nothing was committed
    with pytest.raises(httpx.HTTPStatusError):
        client.post("/v1/sessions/import?model=no-such-model", content=blob).raise_for_status()
