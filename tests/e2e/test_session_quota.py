"""XLSERVE_MAX_SESSIONS_PER_KEY against a real server: a key at its bound gets 403
session_quota_exceeded for a new session (create, import, fork), naming the setting; another key
is served as before, and a delete gives the place back."""

from __future__ import annotations

import pytest

from tests.e2e.server_process import ServerProcess

MODEL = "txl-tiny"
KEY, OTHER_KEY = "quota-key", "other-key"


@pytest.fixture(scope="module")
def bounded(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess([tiny_checkpoint], env={"XLSERVE_API_KEYS": f"{KEY},{OTHER_KEY}",
                                                    "XLSERVE_MAX_SESSIONS_PER_KEY": "2"},
                            log_path=tmp_path_factory.mktemp("logs") / "quota.log").start()
    yield process
    process.stop()


def test_a_key_at_its_bound_gets_403_and_another_key_does_not(bounded):
    with bounded.client(headers={"Authorization": f"Bearer {KEY}"}) as client, \
            bounded.client(headers={"Authorization": f"Bearer {OTHER_KEY}"}) as other:
        first = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
        assert client.post(f"/v1/sessions/{first}/append", json={"text": "def f(x):\n"}).status_code == 200
        second = client.post("/v1/sessions", json={"model": MODEL}, headers={"Idempotency-Key": "make-2"})
        assert second.status_code == 200
        exported = client.get(f"/v1/sessions/{first}/state").content
        refusals = [client.post("/v1/sessions", json={"model": MODEL}),
                    client.post("/v1/sessions/import", content=exported),
                    client.post(f"/v1/sessions/{first}/fork")]
        for response in refusals:
            assert response.status_code == 403, response.text
            error = response.json()["error"]
            assert error["code"] == "session_quota_exceeded" and error["type"] == "permission_error"
            assert "XLSERVE_MAX_SESSIONS_PER_KEY (2)" in error["message"]
            assert "retry-after" not in response.headers
        # a retry of a create already made is that session, not a refusal
        again = client.post("/v1/sessions", json={"model": MODEL}, headers={"Idempotency-Key": "make-2"})
        assert again.status_code == 200 and again.json()["id"] == second.json()["id"]
        listed = client.get("/v1/sessions").json()["data"]
        assert sorted(s["id"] for s in listed) == sorted([first, second.json()["id"]])
        # the key's sessions still serve, and another key is not held back
        assert client.post("/v1/completions", json={"model": MODEL, "session_id": first, "prompt": "  ",
                                                    "max_tokens": 2}).status_code == 200
        assert other.post("/v1/sessions", json={"model": MODEL}).status_code == 200
        # a delete gives the place back
        assert client.delete(f"/v1/sessions/{second.json()['id']}").status_code == 200
        assert client.post(f"/v1/sessions/{first}/fork").status_code == 200
