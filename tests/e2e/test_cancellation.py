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

import base64
import json
import os
import socket
import struct
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


def silent_socket(port: int, request: bytes) -> socket.socket:
    """A client that sends `request` and never reads: its receive buffer as small as the kernel
    allows, so that the server's writes fill it and wait."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock


def websocket_frame(payload: bytes) -> bytes:
    """One masked text frame, as a client sends it (RFC 6455)."""
    mask = os.urandom(4)
    length = len(payload)
    head = bytes([0x81]) + (bytes([0x80 | length]) if length < 126 else bytes([0x80 | 126]) + struct.pack(">H", length))
    return head + mask + bytes(byte ^ mask[i % 4] for i, byte in enumerate(payload))


def session_freed_within(client, session: str, seconds: float) -> bool:
    """Whether `session`, once a stream holds it, is free again (an append to it gets 200, where it
    gets 409 while the stream runs) before `seconds` pass."""
    deadline = time.monotonic() + seconds
    while not client.get(f"/v1/sessions/{session}").json()["in_use"]:  # the stream has taken it
        assert time.monotonic() < deadline, "the stream never took the session"
        time.sleep(0.05)
    while time.monotonic() < deadline:
        answer = client.post(f"/v1/sessions/{session}/append", json={"text": "y"})
        if answer.status_code == 200:
            return True
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "session_busy", answer.text
        time.sleep(0.2)
    return False


def test_a_stream_whose_client_stops_reading_lets_its_session_go(tiny_checkpoint, tmp_path):
    """A client that sends a streamed completion on its session and then reads nothing keeps its
    connection open: the server's writes fill its socket and wait. After one write has waited
    XLSERVE_STREAM_SEND_TIMEOUT_SECONDS the client counts as gone: its generation is cancelled and
    its session is free again, over SSE and over the websocket. Before, the session stayed busy
    (409) for as long as the connection stayed open, and the request's events piled up."""
    log_path = tmp_path / "server.log"
    server = ServerProcess([tiny_checkpoint], env={"XLSERVE_STREAM_SEND_TIMEOUT_SECONDS": "2"},
                           log_path=log_path).start()
    sockets = []
    try:
        with server.client() as client:
            for transport in ("sse", "websocket"):
                session = create(client)
                assert client.post(f"/v1/sessions/{session}/append", json={"text": "def main():"}).status_code == 200
                generate = {"model": MODEL, "prompt": "\n", "max_tokens": 4000, "logprobs": 20, "temperature": 1,
                            "session_id": session}
                if transport == "sse":
                    body = json.dumps({**generate, "stream": True}).encode()
                    sockets.append(silent_socket(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                                 % len(body) + body))
                else:
                    key = base64.b64encode(os.urandom(16))
                    sock = silent_socket(server.port, b"GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                                         b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: "
                                         + key + b"\r\n\r\n")
                    sockets.append(sock)
                    handshake = b""
                    while b"\r\n\r\n" not in handshake:
                        handshake += sock.recv(1)
                    assert handshake.startswith(b"HTTP/1.1 101"), handshake
                    sock.sendall(websocket_frame(json.dumps({"type": "generate", **generate}).encode()))
                # busy while it runs, then let go once a write has waited 2 s: well before 4,000
                # tokens with their alternatives could have drained into a socket nobody reads
                assert session_freed_within(client, session, 60), transport
        warnings = [line for line in log_path.read_text().splitlines() if "XLSERVE_STREAM_SEND_TIMEOUT_SECONDS" in line]
        assert any("websocket" in line for line in warnings) and any("streamed answer" in line for line in warnings), \
            warnings
    finally:
        for sock in sockets:
            sock.close()
        server.stop()
