"""A server that starts honestly and stops without surprises, against real `xlserve serve`
processes:

- the port opens before the models are loaded: /ready and every request say 503 `loading`;
- settings that cannot work are refused before the port opens, in one line, non-zero, no
  traceback; so is a checkpoint the engine process cannot load, after it;
- one block of INFO lines says what the server uses; secrets stay out of `ps` and the logs;
- SIGTERM with a short grace period ends a stream that is still running with an error event
  `server_shutting_down` (SSE) or an error frame (websocket), and commits nothing of it;
- `GET /version` and `xlserve --version`.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from tests.e2e.server_process import REPO, ServerProcess, free_port
from tests.e2e.session_tools import append, create, document, info, metric
from tests.e2e.process_tools import PlainCompletion, Stream, engine_pid, error_of_stream

LONG = 1_000_000  # tokens: a generation that outlasts any grace period here


def spawn(server: ServerProcess, log_path: Path, log_level: str = "info") -> ServerProcess:
    """`xlserve serve` for `server`, without waiting for anything."""
    server.process = subprocess.Popen(
        [sys.executable, "-m", "xlserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(server.port),
         "--models", ",".join(str(m) for m in server.models), "--log-level", log_level],
        cwd=REPO, env=server.env, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT,
    )
    return server


def first_answer(server: ServerProcess, timeout: float = 60) -> httpx.Response:
    """The first answer to a completion once the port is open."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.process.poll() is None, f"the server exited with {server.process.returncode}"
        try:
            return httpx.post(server.url + "/v1/completions", json={"model": "txl-tiny", "prompt": "a"}, timeout=10)
        except httpx.TransportError:
            time.sleep(0.02)
    raise AssertionError(f"the port did not open within {timeout}s")


def wait_ready(server: ServerProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert server.process.poll() is None, f"the server exited with {server.process.returncode}"
        try:
            if httpx.get(server.url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:  # the port is not open yet
            pass
        assert time.monotonic() < deadline, f"not ready within {timeout}s"
        time.sleep(0.05)


def refused(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "xlserve.server.cli", "serve", "--port", str(free_port()), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output
    return done


# -- start-up ------------------------------------------------------------------------------------


def test_the_port_opens_at_once_and_says_loading_until_the_models_are_loaded(tiny_checkpoint, tmp_path):
    """The engine process imports torch and loads the model after the port opens: the first
    answers are 503 `loading` (with Retry-After), /ready is 503 with the reason, a websocket
    gets an error frame and close code 1013; then the start-up block is logged and it serves. A
    misspelt XLSERVE_ variable is warned about once, by the API process (the engine process it
    starts inherits the environment, and said it again)."""
    log_path = tmp_path / "server.log"
    server = spawn(ServerProcess([tiny_checkpoint], env={"XLSERVE_DEVCE": "cpu"}), log_path)
    try:
        early = first_answer(server)
        assert early.status_code == 503, early.text
        assert early.json()["error"]["code"] == "loading" and early.headers["retry-after"]
        ready = httpx.get(server.url + "/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["status"] == "loading"
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        with connect(server.url.replace("http://", "ws://") + "/v1/stream") as ws:
            frame = json.loads(ws.recv(timeout=10))
            assert frame["type"] == "error" and frame["error"]["code"] == "loading" and frame["retry_after"] > 0
        wait_ready(server)
        response = httpx.post(server.url + "/v1/completions", json={"model": "txl-tiny", "prompt": "a",
                                                                     "max_tokens": 2}, timeout=30)
        assert response.status_code == 200, response.text
    finally:
        assert server.stop() == 0
    lines = log_path.read_text().splitlines()
    (first,) = [i for i, line in enumerate(lines) if " ready in " in line]
    block = "\n".join(lines[first:first + 7])  # the ready line, one model's two lines, four more
    assert lines[first].startswith("INFO:") and f"xlserve {metadata.version('xlserve')} ready in" in lines[first]
    assert "model txl-tiny: transformer-xl, " in block and " parameters, cpu float32, loaded in " in block
    assert "threads per model: 1 for forwards" in block
    assert "every forward on the prompt threads" not in block  # a tiny model decodes on one thread
    assert f"state directory: {Path(server.env['XLSERVE_STATE_DIR']).resolve()} (0 sessions found)" in block
    assert "session store: device 1 GiB -> host 4 GiB -> disk 64 GiB (no Redis" in block
    assert "API keys: none" in block
    assert sum("XLSERVE_DEVCE is not an xlserve setting" in line for line in lines) == 1


def test_a_large_state_sent_while_loading_is_told_loading_not_too_large(tiny_checkpoint, tmp_path):
    """A state's limit is sized to the served models, none while they load: a 237 MB import or
    PUT state sent then got 413 naming an 8 MB limit, as if it could never fit, where every
    other request gets 503 `loading` with Retry-After."""
    import socket

    server = spawn(ServerProcess([tiny_checkpoint]), tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the port did not open within 60 s"
            try:
                connection = socket.create_connection(("127.0.0.1", server.port), timeout=10)
                break
            except OSError:
                time.sleep(0.02)
        with connection:
            connection.sendall(b"POST /v1/sessions/import HTTP/1.1\r\nHost: localhost\r\n"
                               b"Content-Type: application/octet-stream\r\nContent-Length: 237000000\r\n\r\n"
                               + bytes(4096))
            answer = b""
            while b'"code": "loading"' not in answer and (chunk := connection.recv(4096)):
                answer += chunk
        head = answer.split(b"\r\n\r\n")[0].decode().lower()
        assert head.startswith("http/1.1 503") and "retry-after" in head, answer[:400]
        assert b'"code": "loading"' in answer, answer[:400]
    finally:
        assert server.stop() == 0


def test_no_checkpoint_to_serve_is_refused_in_one_line(tmp_path):
    empty = tmp_path / "weights"
    empty.mkdir()
    done = refused("--weights-dir", str(empty))
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert done.stderr.startswith("xlserve serve: no checkpoint to serve") and str(empty) in done.stderr


def test_an_unknown_model_name_is_refused_in_one_line(tiny_checkpoint):
    done = refused("--models", f"{tiny_checkpoint},txl-tnyi", "--weights-dir", str(tiny_checkpoint.parent))
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "no checkpoint 'txl-tnyi'" in done.stderr and "txl-tiny" in done.stderr  # what there is


@pytest.mark.parametrize("kind, file", [("words", "symbols.json"), ("tokenizers", "tokenizer.json"),
                                         ("sentencepiece", "spiece.model")])
def test_a_converted_checkpoint_without_its_tokenizer_file_is_refused_in_one_line(tiny_checkpoint, tmp_path, kind, file):
    """A converted model whose tokenizer file was never put beside its weights (convert's note
    says so): refused before the port opens, naming the file, not after the engine has loaded."""
    converted = tmp_path / "converted"
    shutil.copytree(tiny_checkpoint, converted)
    config = json.loads((converted / "config.json").read_text())
    (converted / "config.json").write_text(json.dumps({**config, "tokenizer": kind}))
    done = refused("--models", str(converted))
    assert done.stderr.strip().count("\n") == 0 and "Uvicorn running" not in done.stdout + done.stderr, done.stderr
    assert done.stderr.startswith(f"xlserve serve: checkpoint {converted}: {converted / file} does not exist")


def test_a_checkpoint_the_engine_cannot_load_stops_the_server_in_one_line(tiny_checkpoint, tmp_path):
    """Found, but broken: the port has opened (it is the engine process that finds out), and the
    server exits non-zero naming the file, once."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    done = refused("--models", str(broken), "--log-level", "warning",
                   env={**ServerProcess([broken]).env})
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("xlserve serve: the engine process failed to start: ") and "model.safetensors" in lines[0]


def test_a_second_server_on_a_state_directory_in_use_stops_in_one_line(tiny_checkpoint, tmp_path):
    """Two servers on one XLSERVE_STATE_DIR (two containers on one volume) would delete each
    other's writes in flight at start: the second is refused before its port opens, naming the
    directory and the first."""
    state = tmp_path / "state"
    first = ServerProcess([tiny_checkpoint], env={"XLSERVE_STATE_DIR": str(state)}).start()
    try:
        done = refused("--models", str(tiny_checkpoint), "--log-level", "warning",
                       env={**first.env, "XLSERVE_STATE_DIR": str(state)})
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith(f"xlserve serve: XLSERVE_STATE_DIR {state} is in use by another xlserve server "
                                   "(pid "), lines[0]
        with first.client() as client:
            assert client.get("/ready").status_code == 200  # the first goes on
    finally:
        first.stop()


# -- secrets ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory):
    """A real redis-server on a free loopback port that wants a password: (url, password)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; `make test` does it)")
    import redis

    password, port = "s3cret-h3-pass", free_port()
    process = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
                                "no", "--dir", str(tmp_path_factory.mktemp("redis")), "--requirepass", password,
                                "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=1, socket_connect_timeout=1)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        yield f"redis://:{password}@127.0.0.1:{port}/0", password
    finally:
        client.close()
        process.terminate()
        process.wait(10)


def test_the_redis_password_is_in_neither_the_engine_command_line_nor_the_log(tiny_checkpoint, tmp_path,
                                                                              redis_with_password):
    url, password = redis_with_password
    log_path = tmp_path / "server.log"
    server = spawn(ServerProcess([tiny_checkpoint], env={"XLSERVE_REDIS_URL": url}), log_path)
    try:
        wait_ready(server)
        engine = engine_pid(server)
        argv = Path(f"/proc/{engine}/cmdline").read_bytes().split(b"\0")
        assert argv[1:3] == [b"-m", b"xlserve.server.engine.process"]
        assert not any(b"redis" in arg or password.encode() in arg for arg in argv), argv
        with server.client() as client:  # the engine process has the URL all the same: sessions go to Redis
            session_id = create(client, "txl-tiny")
            append(client, session_id, document(0))
            assert info(client, session_id)["version"] == 1
    finally:
        assert server.stop() == 0
    output = log_path.read_text()
    assert password not in output
    port = url.rsplit(":", 1)[1]
    assert f"session store: device 1 GiB -> host 4 GiB -> disk 64 GiB -> Redis redis://:***@127.0.0.1:{port}" in output


def test_a_wrong_redis_password_stops_the_server_without_showing_it(tiny_checkpoint, redis_with_password):
    url, password = redis_with_password
    wrong = "not-" + password
    done = refused("--models", str(tiny_checkpoint), "--log-level", "warning",
                   env={**ServerProcess([tiny_checkpoint]).env, "XLSERVE_REDIS_URL": url.replace(password, wrong)})
    assert wrong not in done.stdout + done.stderr and password not in done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Redis at redis://" in lines[0] and "***" in lines[0], done.stderr


# -- shutdown -----------------------------------------------------------------------------------


def running_requests(client) -> float:
    """xlserve_requests_running of the served model, from /metrics."""
    return metric(client.get("/metrics").text, "xlserve_requests_running", model="txl-tiny")


def test_sigterm_after_the_grace_period_ends_running_streams_with_server_shutting_down(tiny_checkpoint):
    """Grace 0.5 s, generations far longer: the SSE stream gets an error event then [DONE], the
    websocket an error frame, a plain completion a 503, all `server_shutting_down`; the server
    exits 0, and the session the stream continued is as it was before it."""
    env = {"XLSERVE_SHUTDOWN_GRACE_SECONDS": "0.5", "XLSERVE_MAX_TOKENS_LIMIT": str(LONG)}
    server = ServerProcess([tiny_checkpoint], env=env).start()
    try:
        with server.client() as client:
            session_id = create(client, "txl-tiny")
            append(client, session_id, document(1))
            before = info(client, session_id)
            long = {"model": "txl-tiny", "prompt": "def main(", "max_tokens": LONG}
            plain = PlainCompletion(server, long)
            plain.start()
            streams = [Stream(server, {**long, "session_id": session_id}), Stream(server, long)]
            for stream in streams:
                stream.start()
            with connect(server.url.replace("http://", "ws://") + "/v1/stream") as ws:
                ws.send(json.dumps({"type": "generate", "id": "w", **long}))
                assert json.loads(ws.recv(timeout=60))["type"] == "token"
                for stream in streams:
                    assert stream.started.wait(60) and stream.events, "a stream did not start"
                # the plain completion shows no progress of its own: wait until the engine runs all four
                deadline = time.monotonic() + 60
                while running_requests(client) < 4:
                    assert time.monotonic() < deadline, "the plain completion never started"
                    time.sleep(0.05)
                server.process.send_signal(signal.SIGTERM)
                frame = json.loads(ws.recv(timeout=60))
                while frame["type"] == "token":
                    frame = json.loads(ws.recv(timeout=60))
                assert frame["type"] == "error" and frame["error"]["code"] == "server_shutting_down", frame
            for stream in streams:
                stream.join(60)
                error = error_of_stream(stream)
                assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable", error
            plain.join(60)
            assert plain.response is not None and plain.response.status_code == 503
            assert plain.response.json()["error"]["code"] == "server_shutting_down"
        assert server.process.wait(60) == 0
        # nothing of the cut stream was committed: a new server on the same state finds the session as it was
        again = ServerProcess([tiny_checkpoint], env={**env, "XLSERVE_STATE_DIR": server.env["XLSERVE_STATE_DIR"]})
        again.start()
        try:
            with again.client() as client:
                after = info(client, session_id)
            assert (after["tokens"], after["version"]) == (before["tokens"], before["version"])
        finally:
            assert again.stop() == 0
    finally:
        server.stop(signal.SIGKILL)


def test_a_second_sigterm_cuts_running_streams_at_once_with_server_shutting_down(tiny_checkpoint):
    """A grace period far longer than the test: the second signal does not wait for it."""
    env = {"XLSERVE_SHUTDOWN_GRACE_SECONDS": "600", "XLSERVE_MAX_TOKENS_LIMIT": str(LONG)}
    server = ServerProcess([tiny_checkpoint], env=env).start()
    try:
        stream = Stream(server, {"model": "txl-tiny", "prompt": "def main(", "max_tokens": LONG})
        stream.start()
        assert stream.started.wait(60) and stream.events, "the stream did not start"
        server.process.send_signal(signal.SIGTERM)
        with server.client() as client:  # draining: the first signal has been handled
            deadline = time.monotonic() + 30
            while client.get("/ready").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        server.process.send_signal(signal.SIGTERM)
        stream.join(60)
        assert error_of_stream(stream)["code"] == "server_shutting_down"
        assert server.process.wait(60) == 0
    finally:
        server.stop(signal.SIGKILL)


# -- version ------------------------------------------------------------------------------------


def test_version_over_http_and_on_the_command_line(server):
    expected = metadata.version("xlserve")
    with server.client() as client:
        assert client.get("/version").json() == {"version": expected}
    done = subprocess.run([sys.executable, "-m", "xlserve.server.cli", "--version"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"xlserve {expected}"
