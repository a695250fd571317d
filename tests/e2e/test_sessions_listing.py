"""GET /v1/sessions (the caller's own sessions, paginated, newest first), the non-retryable
413 `session_too_large` for a session that can never fit (larger than the device budget and the
host budget both: tests/e2e/test_sessions_on_host.py has one larger than the device's alone), and
Idempotency-Keys that outlive a restart; against a real server with two API keys and device and
host budgets of half a full session."""

from __future__ import annotations

import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import MODEL, document, full_state_bytes

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def environment(tiny_checkpoint, tmp_path_factory) -> dict:
    return {"XLSERVE_API_KEYS": ",".join(KEYS), "XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp("state")),
            "XLSERVE_DEVICE_STATE_BYTES": str(full_state_bytes(tiny_checkpoint) // 2),
            "XLSERVE_HOST_STATE_BYTES": str(full_state_bytes(tiny_checkpoint) // 2)}


@pytest.fixture(scope="module")
def small(tiny_checkpoint, tmp_path_factory, environment):
    server = ServerProcess([tiny_checkpoint], env=environment,
                           log_path=tmp_path_factory.mktemp("logs") / "small.log").start()
    yield server
    server.stop()


def as_key(server, key: str):
    return server.client(headers={"Authorization": f"Bearer {key}"})


def created(client) -> str:
    response = client.post("/v1/sessions", json={"model": MODEL})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def test_listing_pages_through_your_own_sessions_newest_first(small):
    with as_key(small, KEYS[0]) as one, as_key(small, KEYS[1]) as two:
        mine = [created(one) for _ in range(5)]
        theirs = [created(two) for _ in range(2)]
        newest_first = list(reversed(mine))

        seen, after = [], None
        for expected_more in (True, True, False):
            page = one.get("/v1/sessions", params={"limit": 2, **({"after": after} if after else {})})
            assert page.status_code == 200, page.text
            body = page.json()
            assert body["object"] == "list" and body["has_more"] is expected_more
            ids = [session["id"] for session in body["data"]]
            assert (body["first_id"], body["last_id"]) == (ids[0], ids[-1])
            assert all(session["object"] == "session" and session["model"] == MODEL for session in body["data"])
            seen += ids
            after = body["last_id"]
        assert seen == newest_first
        whole = one.get("/v1/sessions").json()  # default limit 20
        assert [s["id"] for s in whole["data"]] == newest_first and not whole["has_more"]
        assert whole["data"][0] == one.get(f"/v1/sessions/{newest_first[0]}").json()  # as GET /v1/sessions/{id}

        assert [s["id"] for s in two.get("/v1/sessions").json()["data"]] == list(reversed(theirs))
        refused = two.get("/v1/sessions", params={"after": mine[0]})  # another key's session is no cursor
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "after"
        for limit in (0, 101):
            assert one.get("/v1/sessions", params={"limit": limit}).status_code == 400
    with small.client() as anonymous:
        assert anonymous.get("/v1/sessions").status_code == 401


def test_a_session_that_can_never_fit_gets_413_without_retry_after(small, server):
    with as_key(small, KEYS[0]) as client:
        session = created(client)
        grown = client.post(f"/v1/sessions/{session}/append", json={"text": document(6)})
        assert grown.status_code == 413, grown.text
        assert "retry-after" not in grown.headers
        error = grown.json()["error"]
        assert (error["code"], error["type"], error["param"]) == ("session_too_large", "request_too_large",
                                                                  "session_id")
        assert "XLSERVE_HOST_STATE_BYTES" in error["message"]
        assert client.get(f"/v1/sessions/{session}").json()["version"] == 0  # nothing changed

        with server.client() as roomy:  # a full state, made where it fits, imported where it cannot
            full = roomy.post("/v1/sessions", json={"model": MODEL}).json()["id"]
            assert roomy.post(f"/v1/sessions/{full}/append", json={"text": document(6)}).status_code == 200
            blob = roomy.get(f"/v1/sessions/{full}/state").content
        imported = client.put(f"/v1/sessions/{session}/state", content=blob)
        assert imported.status_code == 413 and imported.json()["error"]["code"] == "session_too_large"
        assert "retry-after" not in imported.headers

        fits = client.post(f"/v1/sessions/{session}/append", json={"text": "ok"})  # a small one still fits
        assert fits.status_code == 200 and fits.json()["version"] == 1


def test_keys_outlive_a_restart(small, tiny_checkpoint, environment, tmp_path):
    with as_key(small, KEYS[1]) as client:
        session = created(client)
        first = client.post(f"/v1/sessions/{session}/append", json={"text": "abc"},
                            headers={"Idempotency-Key": "before-restart"})
        assert first.status_code == 200, first.text
    small.stop()
    restarted = ServerProcess([tiny_checkpoint], env=environment, log_path=tmp_path / "restarted.log").start()
    try:
        with as_key(restarted, KEYS[1]) as client:
            again = client.post(f"/v1/sessions/{session}/append", json={"text": "abc"},
                                headers={"Idempotency-Key": "before-restart"})
            assert again.status_code == 200 and again.headers.get("idempotent-replayed") == "true"
            assert again.json() == first.json()
            assert client.get(f"/v1/sessions/{session}").json()["version"] == 1
    finally:
        restarted.stop()
