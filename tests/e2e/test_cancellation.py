"""A client that leaves during a long prefill stops it between two chunks, against a real server.

The server feeds prompts in chunks of CHUNK tokens (XLSERVE_PREFILL_CHUNK_TOKENS), so the long
document here takes thousands of engine steps to prefill. Each way a client can be running
such a request (a plain append, a plain completion, a streamed completion, a websocket append)
is abandoned a moment after it started: the engine drops the request at its next step, so the
running gauge goes back to 0 and the prompt tokens it prefilled (xlserve_prefill_tokens, which
counts a dropped request's too) are far fewer than the document's, and the session is as it
was. What is asserted is the order of events and the amount of work, never a time.

Where exactly a disconnect meets the commit (before, in the same instant, during) is placed by
hand in tests/server/test_cancellation.py.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from websockets.sync.client import connect

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import create, metric

MODEL = "txl-tiny"
CHUNK = 16
DOCUMENT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(2000))  # ~100 KB
PATIENCE = 1.0  # seconds the client waits before it leaves


@pytest.fixture(scope="module")
def slow_prefill(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess([tiny_checkpoint], env={"XLSERVE_PREFILL_CHUNK_TOKENS": str(CHUNK)},
                            log_path=tmp_path_factory.mktemp("logs") / "cancellation.log").start()
    yield process
    process.stop()


def engine_numbers(client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {"running": metric(text, "xlserve_requests_running", model=MODEL),
            "prefilled": metric(text, "xlserve_prefill_tokens_sum", model=MODEL),
            "prefills": metric(text, "xlserve_prefill_tokens_count", model=MODEL),
            "cancelled": metric(text, "xlserve_requests_total", model=MODEL, finish_reason="cancelled")}


def until_idle(client, seconds: float = 60) -> dict[str, float]:
    """The engine's numbers once nothing runs (bounded: at worst the whole prefill's time)."""
    deadline = time.monotonic() + seconds
    numbers = engine_numbers(client)
    while numbers["running"] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        numbers = engine_numbers(client)
    return numbers


def impatient(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=PATIENCE))


def plain_append(server, session_id: str) -> None:
    with impatient(server) as client, pytest.raises(httpx.ReadTimeout):
        client.post(f"/v1/sessions/{session_id}/append", json={"text": DOCUMENT})


def plain_completion(server, session_id: str) -> None:
    with impatient(server) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"model": MODEL, "prompt": DOCUMENT, "max_tokens": 1,
                                             "session_id": session_id})


def streamed_completion(server, session_id: str) -> None:
    body = {"model": MODEL, "prompt": DOCUMENT, "max_tokens": 1, "session_id": session_id, "stream": True}
    with server.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200  # queued: the stream's headers are out, its prefill runs
        time.sleep(PATIENCE)


def websocket_append(server, session_id: str) -> None:
    with connect(server.url.replace("http://", "ws://") + "/v1/stream") as websocket:
        websocket.send(json.dumps({"type": "append", "id": "a", "session_id": session_id, "text": DOCUMENT}))
        time.sleep(PATIENCE)


LEAVERS = {"plain append": plain_append, "plain completion": plain_completion,
           "streamed completion": streamed_completion, "websocket append": websocket_append}


@pytest.mark.parametrize("leave", LEAVERS.values(), ids=list(LEAVERS))
def test_a_client_that_leaves_mid_prefill_stops_it_between_chunks(slow_prefill, leave):
    with slow_prefill.client() as client:
        session_id = create(client)
        before = until_idle(client)
        leave(slow_prefill, session_id)
        after = until_idle(client)
        assert after["running"] == 0
        assert after["cancelled"] == before["cancelled"] + 1
        # the dropped request counted the prompt tokens it computed: some, far fewer than the document's
        assert after["prefills"] == before["prefills"] + 1
        prefilled = after["prefilled"] - before["prefilled"]
        assert CHUNK <= prefilled < len(DOCUMENT) / 2, prefilled
        info = client.get(f"/v1/sessions/{session_id}").json()
        assert info["tokens"] == 0 and info["version"] == 0, info  # nothing was committed
        again = client.post(f"/v1/sessions/{session_id}/append", json={"text": "short"})
        assert again.status_code == 200 and again.json()["version"] == 1  # its lease was let go
