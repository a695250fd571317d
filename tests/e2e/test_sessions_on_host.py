"""A session larger than the device's whole budget lives on host RAM without an error (issue 36):
against a real server whose device budget is half a full session (host RAM at its default), a
session grows past the device budget, is kept on host RAM between requests, and continues exactly
as the same session does on a server where it fits the device; a restart brings it back."""

from __future__ import annotations

import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import MODEL, append, create, document, full_state_bytes, greedy, info, metric_total, ok


@pytest.fixture(scope="module")
def small_device(tiny_checkpoint, tmp_path_factory):
    environment = {"XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp("state")),
                   "XLSERVE_DEVICE_STATE_BYTES": str(full_state_bytes(tiny_checkpoint) // 2)}
    server = ServerProcess([tiny_checkpoint], env=environment,
                           log_path=tmp_path_factory.mktemp("logs") / "small-device.log").start()
    yield server
    server.stop()


def test_a_session_larger_than_the_device_budget_is_served_from_host_ram(small_device, server, tiny_checkpoint):
    with small_device.client() as small, server.client() as roomy:
        sessions = {}
        for name, client in (("small", small), ("roomy", roomy)):
            sessions[name] = create(client)
            append(client, sessions[name], document(1))  # longer than mem_len: a full memory
        held = info(small, sessions["small"])
        assert held["state_bytes"] == full_state_bytes(tiny_checkpoint) and held["tier"] == "host"
        assert info(roomy, sessions["roomy"])["tier"] == "device"
        # the same greedy continuation, turn after turn, from host RAM as from the device
        for turn in range(2):
            prompt = f"\nturn {turn}: "
            assert greedy(small, MODEL, sessions["small"], prompt) == greedy(roomy, MODEL, sessions["roomy"], prompt)
            assert info(small, sessions["small"])["tier"] == "host"
        assert info(small, sessions["small"])["version"] == 3
        metrics = small.get("/metrics").text
        assert metric_total(metrics, "xlserve_session_state_bytes", tier="device") == 0  # never booked on the device
        assert metric_total(metrics, "xlserve_session_state_bytes", tier="host") == full_state_bytes(tiny_checkpoint)


def test_it_comes_back_from_disk_after_a_restart(small_device):
    with small_device.client() as client:
        session = create(client)
        append(client, session, document(2))
        before = info(client, session)
    small_device.stop()
    small_device.start()
    with small_device.client() as client:
        assert info(client, session)["version"] == before["version"]
        ok(client.post(f"/v1/sessions/{session}/append", json={"text": "more"}))
        after = info(client, session)
        assert after["tier"] == "host" and after["version"] == before["version"] + 1
