"""A real websocket client (`websockets`) against the real server: /v1/stream."""

from __future__ import annotations

import base64
import json
import os
import socket
import time

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import metric

MODEL = "txl-tiny"


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/stream"


def send(ws, **frame) -> None:
    ws.send(json.dumps(frame))


def answer(ws, timeout: float = 60) -> tuple[list[dict], dict]:
    """Frames of one request: the token frames and the final done or error frame."""
    tokens = []
    while True:
        frame = json.loads(ws.recv(timeout=timeout))
        if frame["type"] == "token":
            tokens.append(frame)
        else:
            return tokens, frame


def text_of(tokens, done) -> str:
    return "".join(t["text"] for t in tokens) + done.get("text", "")


def complete(client, **fields) -> dict:
    response = client.post("/v1/completions", json={"model": MODEL, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_matches_http_and_two_requests_share_a_connection(server, client):
    expected = complete(client, prompt="def main():\n", max_tokens=12, temperature=0)["choices"][0]["text"]
    with connect(ws_url(server)) as ws:
        send(ws, type="generate", id="first", model=MODEL, prompt="def main():\n", max_tokens=12, temperature=0)
        tokens, done = answer(ws)
        assert done["type"] == "done" and done["id"] == "first"
        assert len(tokens) == 12 and all(t["id"] == "first" and t["logprob"] <= 0 for t in tokens)
        assert text_of(tokens, done) == expected
        assert done["finish_reason"] == "length"
        assert done["usage"]["prompt_tokens"] == 12 and done["usage"]["completion_tokens"] == 12

        send(ws, type="generate", id="second", model=MODEL, prompt="x = ", max_tokens=5, temperature=1.0, seed=3,
             logprobs=2, stop=["\n\n\n\n\n\n\n\n"])
        tokens, done = answer(ws)
        assert done["type"] == "done" and done["id"] == "second"
        assert all(len(t["top_logprobs"]) == 2 for t in tokens)
        seeded = complete(client, prompt="x = ", max_tokens=5, temperature=1.0, seed=3)["choices"][0]["text"]
        assert text_of(tokens, done) == seeded


@pytest.mark.parametrize("raw, param", [
    ("not json", None),
    ("[1, 2]", None),
    ('{"type": "dance"}', "type"),
    ('{"type": "generate", "prompt": "x"}', "model"),
    ('{"type": "generate", "model": "txl-tiny", "prompt": "x", "max_tokens": "many"}', "max_tokens"),
    ('{"type": "generate", "model": "txl-tiny", "prompt": "x", "temprature": 0}', "temprature"),
])
def test_malformed_frame_gets_an_error_and_the_connection_stays_usable(server, raw, param):
    with connect(ws_url(server)) as ws:
        ws.send(raw)
        frame = json.loads(ws.recv(timeout=30))
        assert frame["type"] == "error"
        assert set(frame["error"]) == {"message", "type", "param", "code"}
        assert frame["error"]["type"] == "invalid_request_error" and frame["error"]["param"] == param
        ws.send(b"\x00binary")
        assert json.loads(ws.recv(timeout=30))["type"] == "error"
        send(ws, type="generate", id="after", model=MODEL, prompt="ok", max_tokens=3, temperature=0)
        tokens, done = answer(ws)
        assert done["type"] == "done" and len(tokens) == 3


DEPTH = 100_000


@pytest.mark.parametrize("raw, too_deep", [
    # brackets inside a string, behind an escaped quote: text, not nesting (refused for the missing model)
    ('{"type": "generate", "prompt": "\\"' + "[[" * DEPTH + '"}', False),
    # an escaped quote that ends nothing, then real nesting
    ('{"type": "generate", "x": "\\"", "y": ' + "[" * DEPTH + "]" * DEPTH + "}", True),
    # a string that never ends, made of escaped quotes: every quote looks like a string's start
    ('{"type": "generate", "x": "' + '\\"' * DEPTH + "[" * DEPTH, False),
    # a run of backslashes: an even run escapes itself, the quote after it ends the string
    ('{"type": "generate", "x": "' + "\\\\" * DEPTH + '", "y": ' + "[" * DEPTH, True),
    # an odd run: the last backslash escapes the quote, the string never ends
    ('{"type": "generate", "x": "' + "\\" * (2 * DEPTH + 1) + '"' + "[" * DEPTH, False),
    ("[" * DEPTH + "]" * DEPTH, True),
    ('{"a": ' * DEPTH + "1" + "}" * DEPTH, True),
    ('\\"' + "[" * DEPTH, True),  # an escape outside any string: not JSON
], ids=["brackets-in-string", "escaped-quote-then-deep", "unterminated-escaped-quotes", "even-backslash-run",
        "odd-backslash-run", "deep-arrays", "deep-objects", "escape-outside-string"])
def test_deep_or_tricky_frames_get_an_error_and_the_connection_stays_usable(server, raw, too_deep):
    with connect(ws_url(server)) as ws:
        ws.send(raw)
        frame = json.loads(ws.recv(timeout=30))
        assert frame["type"] == "error" and frame["error"]["code"] == "malformed_frame", frame
        assert ("levels deep" in frame["error"]["message"]) == too_deep, frame
        send(ws, type="generate", id="after", model=MODEL, prompt="ok", max_tokens=3, temperature=0)
        tokens, done = answer(ws, timeout=30)
        assert done["type"] == "done" and done["id"] == "after" and len(tokens) == 3


def test_errors_are_frames_with_the_one_schema(server):
    with connect(ws_url(server)) as ws:
        send(ws, type="generate", id="big", model=MODEL, prompt="x", max_tokens=10**6)
        _, frame = answer(ws)
        assert frame["type"] == "error" and frame["id"] == "big"
        assert "limit is" in frame["error"]["message"] and frame["error"]["param"] == "max_tokens"
        send(ws, type="generate", id="nomodel", model="nope", prompt="x")
        assert answer(ws)[1]["error"]["type"] == "not_found_error"
        send(ws, type="cancel", id="nothing")
        assert answer(ws)[1]["error"]["code"] == "nothing_to_cancel"
        send(ws, type="append", id="a", session_id="sess_missing", text="x")
        assert answer(ws)[1]["error"]["code"] == "session_not_found"


def test_cancel_mid_stream_leaves_the_session_unchanged(server, client):
    session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
    client.post(f"/v1/sessions/{session}/append", json={"text": "import os\n"})
    before = client.get(f"/v1/sessions/{session}").json()
    with connect(ws_url(server)) as ws:
        send(ws, type="generate", id="long", model=MODEL, prompt="def f():\n", max_tokens=4000, session_id=session)
        for _ in range(3):
            assert json.loads(ws.recv(timeout=30))["type"] == "token"
        send(ws, type="generate", id="meanwhile", model=MODEL, prompt="x")
        send(ws, type="cancel", id="long")
        frames = []
        while not frames or frames[-1]["type"] not in ("done",):
            frame = json.loads(ws.recv(timeout=30))
            if frame["type"] != "token":
                frames.append(frame)
        busy, done = frames[0], frames[-1]
        assert busy["type"] == "error" and busy["id"] == "meanwhile" and busy["error"]["code"] == "request_in_progress"
        assert done["id"] == "long" and done["finish_reason"] == "cancelled"
        assert 3 <= done["usage"]["completion_tokens"] < 4000
        after = client.get(f"/v1/sessions/{session}").json()
        assert (after["tokens"], after["version"]) == (before["tokens"], before["version"])
        # the connection and the session are free for the next request
        send(ws, type="generate", id="next", model=MODEL, prompt="", max_tokens=2, session_id=session, temperature=0)
        assert answer(ws)[1]["finish_reason"] == "length"


def test_cancelling_an_append_leaves_the_session_unchanged(server, client):
    """A cancel right behind an append commits nothing (where it lands, while the session is
    fetched, queued or fed, is up to timing; each of those checks it)."""
    session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
    client.post(f"/v1/sessions/{session}/append", json={"text": "import os\n"})
    before = client.get(f"/v1/sessions/{session}").json()
    document = "def f(x):\n    return x * 2\n\n" * 600  # about 40 prefill chunks: many engine steps
    with connect(ws_url(server)) as ws:
        for attempt in range(3):
            send(ws, type="append", id=f"doc{attempt}", session_id=session, text=document)
            send(ws, type="cancel", id=f"doc{attempt}")
            _, done = answer(ws)
            assert done["type"] == "done" and done["id"] == f"doc{attempt}"
            assert done["finish_reason"] == "cancelled"
        after = client.get(f"/v1/sessions/{session}").json()
        assert (after["tokens"], after["version"]) == (before["tokens"], before["version"])
        send(ws, type="append", id="small", session_id=session, text="x = 1\n")
        assert answer(ws)[1]["session_tokens"] == before["tokens"] + 6


def test_session_continuation_equals_one_request_over_the_whole_text(server, client):
    session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
    document = "import sys\n\ndef main(argv):\n    return len(argv)\n\n"
    with connect(ws_url(server)) as ws:
        send(ws, type="append", id="doc", session_id=session, text=document[:20], score=True)
        _, done = answer(ws)
        assert done["type"] == "done" and done["session_tokens"] == 20 and done["scored_tokens"] == 19
        send(ws, type="generate", id="more", model=MODEL, prompt=document[20:], max_tokens=0, session_id=session)
        _, done = answer(ws)
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 20
        assert done["session_tokens"] == len(document)
        send(ws, type="generate", id="go", model=MODEL, prompt="if __name__", max_tokens=8, temperature=0,
             session_id=session)
        tokens, done = answer(ws)
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == len(document)
        assert done["session_tokens"] == len(document) + len("if __name__") + 8 and done["version"] == 3
    full = complete(client, prompt=document + "if __name__", max_tokens=8, temperature=0)
    assert text_of(tokens, done) == full["choices"][0]["text"]


def running_requests(client) -> float:
    return metric(client.get("/metrics").text, "xlserve_requests_running", model=MODEL)


def test_disconnect_cancels_and_frees_the_batch_slot(server, client):
    session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
    with connect(ws_url(server)) as ws:
        send(ws, type="generate", id="gone", model=MODEL, prompt="while True:\n", max_tokens=4000,
             session_id=session)
        for _ in range(3):
            assert json.loads(ws.recv(timeout=30))["type"] == "token"
    # the connection is closed mid-stream
    deadline = time.monotonic() + 30
    while running_requests(client) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_requests(client) == 0
    info = client.get(f"/v1/sessions/{session}").json()
    assert info["tokens"] == 0 and info["version"] == 0  # nothing committed
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                    "session_id": session})
    assert response.status_code == 200  # the session's lease was released


def test_a_connection_routed_by_x_session_id_serves_that_session_only(server, client):
    """A proxy routed the connection by its X-Session-Id header: frames about another session,
    or about none, get an error frame (session_id_mismatch) and the connection stays usable."""
    session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
    with connect(ws_url(server), additional_headers={"X-Session-Id": session}) as ws:
        send(ws, type="generate", id="other", model=MODEL, prompt="x", max_tokens=2)
        _, frame = answer(ws)
        assert frame["type"] == "error" and frame["error"]["code"] == "session_id_mismatch", frame
        assert frame["error"]["param"] == "X-Session-Id"
        send(ws, type="append", id="mine", session_id=session, text="import os\n")
        _, done = answer(ws)
        assert done["type"] == "done" and done["session_id"] == session


# -- the key as a subprotocol: base64url without padding, anything else refused by name -----------

# standard base64 of this key is "az8+fmtl", unpadded and with '+', a token character: a client
# sends it, and a lenient decoder would read it as the base64url "az8-fmtl", the right key
SUBPROTOCOL_KEY = "k?>~ke"


def key_subprotocol(encoded: str) -> list[str]:
    return ["xlserve", "xlserve.key." + encoded]


@pytest.fixture(scope="module")
def keyed_server(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess([tiny_checkpoint], env={"XLSERVE_API_KEYS": SUBPROTOCOL_KEY},
                            log_path=tmp_path_factory.mktemp("logs") / "keyed.log").start()
    yield process
    process.stop()


def refusal(url: str, subprotocols: list[str]) -> tuple[str | None, dict, int]:
    """(the accepted subprotocol, the one frame, the close code) of a connection the server refuses."""
    with connect(url, subprotocols=subprotocols, open_timeout=30) as ws:
        frame = json.loads(ws.recv(timeout=30))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        return ws.subprotocol, frame, ws.close_code


def test_a_key_subprotocol_in_base64url_without_padding_authenticates(keyed_server):
    encoded = base64.urlsafe_b64encode(SUBPROTOCOL_KEY.encode()).decode().rstrip("=")
    with connect(ws_url(keyed_server), subprotocols=key_subprotocol(encoded)) as ws:
        assert ws.subprotocol == "xlserve"
        send(ws, type="generate", id="g", model=MODEL, prompt="x", max_tokens=2)
        tokens, done = answer(ws)
        assert done["type"] == "done" and len(tokens) == 2, done


@pytest.mark.parametrize("encoded", [
    base64.b64encode(SUBPROTOCOL_KEY.encode()).decode(),  # standard base64: '+'
    "az8-fmtl.",  # a token character outside the alphabet
    "az8-f",  # 1 modulo 4 characters: no whole byte
    "",
])
def test_a_key_subprotocol_outside_base64url_gets_an_authentication_error_frame(keyed_server, encoded):
    subprotocol, frame, close_code = refusal(ws_url(keyed_server), key_subprotocol(encoded))
    assert subprotocol == "xlserve" and close_code == 1008
    assert frame["type"] == "error" and frame["error"]["type"] == "authentication_error", frame
    assert frame["error"]["code"] == "invalid_api_key"
    if encoded:
        assert "base64url without padding" in frame["error"]["message"]
        assert encoded not in frame["error"]["message"]  # the key is never echoed
    # offered without "xlserve", it is refused the same way, on a connection with no subprotocol
    assert refusal(ws_url(keyed_server), key_subprotocol(encoded)[1:])[:2] == (None, frame)


def test_base64url_of_bytes_that_are_not_utf8_is_a_clear_authentication_error(keyed_server):
    encoded = base64.urlsafe_b64encode(b"\xff\xfe").decode().rstrip("=")
    _, frame, _ = refusal(ws_url(keyed_server), key_subprotocol(encoded))
    assert frame["error"]["type"] == "authentication_error" and "UTF-8" in frame["error"]["message"]


@pytest.mark.parametrize("encoded", ["az8+fmtl=", "YT4/Yj4/"])  # '=' padding, '/': not token characters
def test_a_subprotocol_that_is_no_http_token_never_reaches_the_server(keyed_server, encoded):
    """What docs/websocket.md says of standard base64 with '/' or '=': the websockets client
    refuses to send it, and a client that sends it anyway gets the HTTP server's 400."""
    with pytest.raises(ValueError, match="invalid subprotocol"):
        connect(ws_url(keyed_server), subprotocols=key_subprotocol(encoded), open_timeout=30)
    handshake = ("GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\nSec-WebSocket-Version: 13\r\n"
                 f"Sec-WebSocket-Protocol: xlserve, xlserve.key.{encoded}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", keyed_server.port), timeout=30) as raw:
        raw.sendall(handshake.encode())
        status_line = raw.recv(4096).split(b"\r\n", 1)[0]
    assert status_line == b"HTTP/1.1 400 Bad Request", status_line
    assert encoded not in keyed_server.log_path.read_text()  # nor is the key logged


def test_a_query_parameter_on_the_websocket_is_refused_by_name(server):
    subprotocol, frame, close_code = refusal(ws_url(server) + "?model=txl-tiny", ["xlserve"])
    assert subprotocol == "xlserve" and close_code == 1008
    assert frame["type"] == "error" and frame["error"]["code"] == "unknown_parameter", frame
    assert frame["error"]["type"] == "invalid_request_error" and frame["error"]["param"] == "model"
    assert "/v1/stream takes no query parameters" in frame["error"]["message"]


# -- a malformed Sec-WebSocket-Protocol header, sent by hand (the client library refuses to) ------

class RawConnection:
    """A socket that has sent a handshake by hand, and the bytes received but not read yet."""

    def __init__(self, port: int):
        self.socket = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.pending = b""

    def __enter__(self) -> "RawConnection":
        return self

    def __exit__(self, *exc_info) -> None:
        self.socket.close()

    def receive(self) -> None:
        chunk = self.socket.recv(65536)
        assert chunk, f"the server closed the connection; unread: {self.pending!r}"
        self.pending += chunk

    def read_exactly(self, count: int) -> bytes:
        while len(self.pending) < count:
            self.receive()
        data, self.pending = self.pending[:count], self.pending[count:]
        return data

    def read_frame(self) -> tuple[int, bytes]:
        """(opcode, payload) of the next frame the server sends (server frames are not masked)."""
        first, second = self.read_exactly(2)
        length = second & 0x7F
        if length == 126:
            length = int.from_bytes(self.read_exactly(2), "big")
        elif length == 127:
            length = int.from_bytes(self.read_exactly(8), "big")
        return first & 0x0F, self.read_exactly(length)

    def send_text(self, text: str) -> None:
        """A client's text frame (RFC 6455: a client masks what it sends); short frames only."""
        payload, mask = text.encode(), os.urandom(4)
        assert len(payload) < 126
        masked = bytes(byte ^ mask[index % 4] for index, byte in enumerate(payload))
        self.socket.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + masked)


def raw_handshake(port: int, subprotocol_lines: list[bytes]) -> tuple[bytes, list[bytes], RawConnection]:
    """Open /v1/stream with these Sec-WebSocket-Protocol header lines; (the status line, the
    response's header lines, the connection, positioned after the response's head)."""
    handshake = (b"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: " + base64.b64encode(os.urandom(16)) + b"\r\nSec-WebSocket-Version: 13\r\n"
                 + b"".join(b"Sec-WebSocket-Protocol: " + line + b"\r\n" for line in subprotocol_lines) + b"\r\n")
    connection = RawConnection(port)
    connection.socket.sendall(handshake)
    while b"\r\n\r\n" not in connection.pending:
        connection.receive()
    head, _, connection.pending = connection.pending.partition(b"\r\n\r\n")
    status_line, *header_lines = head.split(b"\r\n")
    return status_line, header_lines, connection


def refused_after_accepting(raw: RawConnection) -> tuple[dict, int]:
    """(the error frame, the close code) of a connection the server accepted only to refuse it."""
    opcode, payload = raw.read_frame()
    assert opcode == 0x1, (opcode, payload)
    frame = json.loads(payload)
    opcode, payload = raw.read_frame()
    assert opcode == 0x8, (opcode, payload)
    return frame, int.from_bytes(payload[:2], "big")


GOOD_KEY = base64.urlsafe_b64encode(SUBPROTOCOL_KEY.encode()).rstrip(b"=")


@pytest.mark.parametrize("lines", [
    [b"xlserve,,xlserve.key." + GOOD_KEY],  # empty list items: RFC 7230 has recipients ignore them
    [b" , xlserve , , xlserve.key." + GOOD_KEY + b" ,"],
    [b"xlserve", b"xlserve.key." + GOOD_KEY],  # the list split over two header lines (RFC 6455 allows it)
], ids=["double-comma", "empty-items-and-spaces", "two-header-lines"])
def test_a_key_in_an_unusual_but_valid_subprotocol_list_authenticates(keyed_server, lines):
    status_line, header_lines, raw = raw_handshake(keyed_server.port, lines)
    with raw:
        assert status_line == b"HTTP/1.1 101 Switching Protocols", status_line
        assert b"Sec-WebSocket-Protocol: xlserve" in header_lines
        raw.send_text('{"type": "cancel"}')  # authenticated: the frame itself is answered
        opcode, payload = raw.read_frame()
    assert opcode == 0x1 and json.loads(payload)["error"]["code"] == "nothing_to_cancel", payload


@pytest.mark.parametrize("lines, message", [
    ([b"xlserve, xlserve.key." + GOOD_KEY + b", xlserve.key." + GOOD_KEY], "more than one xlserve.key. subprotocol"),
    ([b"xlserve.key." + GOOD_KEY, b"xlserve.key.YQ"], "more than one xlserve.key. subprotocol"),
    ([b"xlserve,"], "missing API key"),  # a trailing comma: no key at all
    ([b"xlserve, xlserve.key." + b"A" * 9000], "invalid API key"),  # longer than the websockets parser's 8192-byte line
    ([b"xlserve, xlserve.key." + b"A" * 200_000], "invalid API key"),
], ids=["two-keys", "two-keys-two-lines", "trailing-comma", "9-KB-header", "200-KB-header"])
def test_a_malformed_subprotocol_list_that_reaches_the_server_gets_an_error_frame_and_1008(keyed_server, lines, message):
    status_line, header_lines, raw = raw_handshake(keyed_server.port, lines)
    with raw:
        assert status_line == b"HTTP/1.1 101 Switching Protocols", status_line
        frame, close_code = refused_after_accepting(raw)
    assert close_code == 1008
    assert frame["type"] == "error" and frame["error"]["type"] == "authentication_error", frame
    assert frame["error"]["code"] == "invalid_api_key" and message in frame["error"]["message"], frame


def test_a_very_long_key_subprotocol_from_the_client_library_is_refused_with_a_frame(keyed_server):
    """Before the server lifted the websockets parser's 8192-byte line limit, such a handshake
    was never answered: the client waited for its open timeout."""
    subprotocol, frame, close_code = refusal(ws_url(keyed_server), key_subprotocol("A" * 20_000))
    assert subprotocol == "xlserve" and close_code == 1008
    assert frame["error"]["code"] == "invalid_api_key", frame


@pytest.mark.parametrize("lines, problem", [
    ([b""], b"expected token at 0"),  # an empty header
    ([b",,,"], b"expected token at 3"),  # only commas
    ([b"xlserve, xlserve.key.Y Q"], b"expected comma"),  # a space inside a token
    ([b"xlserve, xlserv\xc3\xa9"], b"expected comma"),  # not ASCII (UTF-8)
    ([b"xlserve, xlserv\xe9"], b"expected comma"),  # not ASCII (Latin-1)
], ids=["empty", "only-commas", "space-in-token", "utf-8", "latin-1"])
def test_a_subprotocol_header_that_is_no_token_list_gets_a_400_naming_the_header(keyed_server, lines, problem):
    """The websockets library's handshake (inside uvicorn, before the app runs) refuses a header
    that is not a comma-separated list of tokens: a 400 whose text body names the header and
    where it went wrong. docs/websocket.md says so; the websockets client refuses to send these."""
    status_line, header_lines, raw = raw_handshake(keyed_server.port, lines)
    with raw:
        assert status_line == b"HTTP/1.1 400 Bad Request", status_line
        length = int(next(line for line in header_lines if line.lower().startswith(b"content-length:")).split(b":")[1])
        body = raw.read_exactly(length)
    assert b"invalid Sec-WebSocket-Protocol header" in body and problem in body, body


def test_control_characters_in_the_header_get_the_http_servers_400(keyed_server):
    """A control character is refused by the HTTP parser (httptools) before the handshake."""
    status_line, _, raw = raw_handshake(keyed_server.port, [b"xlserve, a\x01b"])
    with raw:
        assert status_line == b"HTTP/1.1 400 Bad Request", status_line


def test_a_frame_past_16_mib_under_a_raised_body_limit_gets_its_answer(tiny_checkpoint, tmp_path):
    """uvicorn closes a websocket (1009) on a frame past its own bound, 16 MiB by default: with
    XLSERVE_MAX_REQUEST_BODY_BYTES raised past that, a frame HTTP would take killed the socket, and
    the request running on it, with no error frame. The bound follows the setting now."""
    process = ServerProcess([tiny_checkpoint], env={"XLSERVE_MAX_REQUEST_BODY_BYTES": str(24 << 20)},
                            log_path=tmp_path / "large-frames.log").start()
    try:
        with connect(ws_url(process), max_size=None, open_timeout=30) as ws:
            send(ws, type="generate", id="large", model=MODEL, prompt="x" * (17 << 20), max_tokens=1)
            frame = json.loads(ws.recv(timeout=60))
            assert frame["type"] == "error" and frame["id"] == "large"
            assert frame["error"]["code"] == "prompt_too_long"  # XLSERVE_MAX_PROMPT_BYTES, answered in a frame
            send(ws, type="generate", id="after", model=MODEL, prompt="ok", max_tokens=2, temperature=0)
            tokens, done = answer(ws)
            assert done["type"] == "done" and len(tokens) == 2
    finally:
        process.stop()
