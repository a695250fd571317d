"""Session affinity through a real proxy: Debian's nginx with deploy/nginx/xlserve.conf in front
of two xlserve replicas sharing one real redis-server. Every request about a session lands on
one replica (counted by each replica's own prompt-token metric); after that replica is killed
with SIGKILL, the session goes on on the other one from its last committed state, with the
log-probabilities a session that never moved gets. A header naming another session than the
path or body is refused with 400."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_process import ServerProcess, free_port
from tests.e2e.session_tools import MODEL, document
from tests.redis_server import redis_url  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: apt-get install nginx-light; "
                                                      "`make test` does it)")


def nginx_config(directory: Path, listen: int, replicas: list[int]) -> Path:
    """The shipped config with this test's replicas and port, inside a main config of its own."""
    shipped = (REPO / "deploy/nginx/xlserve.conf").read_text()
    servers = "".join(f"    server 127.0.0.1:{port} max_fails=1 fail_timeout=5s;\n" for port in replicas)
    lines = [line for line in shipped.splitlines(keepends=True) if "# REPLICAS" not in line]
    site = "".join(lines)
    site = re.sub(r"(upstream xlserve_\w+ \{\n(?:    \w+[^\n]*\n))", lambda m: m.group(1) + servers, site)
    site = site.replace("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{listen};")
    (directory / "xlserve.conf").write_text(site)
    main = directory / "nginx.conf"
    main.write_text(f"""user root root;
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log info;
events {{ worker_connections 256; }}
http {{
    include {directory}/xlserve.conf;
    access_log {directory}/access.log xlserve_request;
    client_body_temp_path {directory}/body;
    proxy_temp_path {directory}/proxy;
    fastcgi_temp_path {directory}/fastcgi;
    uwsgi_temp_path {directory}/uwsgi;
    scgi_temp_path {directory}/scgi;
}}
""")
    return main


def prompt_tokens(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    match = re.search(r'^xlserve_prompt_tokens_total\{model="%s"\} ([0-9.e+]+)$' % re.escape(MODEL), text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture
def fleet(tiny_checkpoint, tmp_path, redis_url):  # noqa: F811
    ports = [free_port(), free_port()]
    replicas = [ServerProcess([tiny_checkpoint], port=port, env={
        "XLSERVE_REDIS_URL": redis_url, "XLSERVE_STATE_DIR": str(tmp_path / f"state-{port}")}).start()
        for port in ports]
    listen = free_port()
    proxy_dir = tmp_path / "nginx"
    proxy_dir.mkdir()
    config = nginx_config(proxy_dir, listen, ports)
    proxy = None
    try:  # the replicas stop even when nginx does not come up
        proxy = subprocess.Popen([NGINX, "-c", str(config), "-p", str(proxy_dir), "-g", "daemon off;"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{listen}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proxy.poll() is None, proxy.stderr.read().decode()
            assert time.monotonic() < deadline, "nginx did not come up"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{listen}", replicas
    finally:
        if proxy is not None and proxy.poll() is None:
            proxy.send_signal(signal.SIGQUIT)
            try:
                proxy.wait(10)
            except subprocess.TimeoutExpired:
                proxy.kill()
        for replica in replicas:
            replica.stop(signal.SIGKILL)


def test_a_session_stays_on_one_replica_and_survives_losing_it(fleet):
    url, replicas = fleet
    with httpx.Client(base_url=url, timeout=60) as proxy:
        reference = proxy.post("/v1/sessions", json={"model": MODEL}).json()["id"]
        expected = [proxy.post(f"/v1/sessions/{reference}/append", headers={"X-Session-Id": reference},
                               json={"text": document(i), "score": True}).json()["logprob"] for i in range(3)]

        session = proxy.post("/v1/sessions", json={"model": MODEL}).json()["id"]
        header = {"X-Session-Id": session}
        before = [prompt_tokens(r.port) for r in replicas]
        got = [proxy.post(f"/v1/sessions/{session}/append", headers=header,
                          json={"text": document(i), "score": True}).json()["logprob"] for i in range(2)]
        for _ in range(3):  # completions name the session in the body and in the header
            answer = proxy.post("/v1/completions", headers=header, json={
                "model": MODEL, "prompt": "", "max_tokens": 0, "session_id": session})
            assert answer.status_code == 200, answer.text
            assert proxy.get(f"/v1/sessions/{session}").status_code == 200  # routed by the path alone
        after = [prompt_tokens(r.port) for r in replicas]
        grew = [b - a for a, b in zip(before, after)]
        assert got == expected[:2]
        assert sorted(grew)[0] == 0 and sorted(grew)[1] > 0, grew  # one replica did all of the session's work
        warm = replicas[grew.index(max(grew))]

        # a header that names another session than the path or the body: refused, nothing done
        wrong = {"X-Session-Id": reference}
        refused = proxy.post(f"/v1/sessions/{session}/append", headers=wrong, json={"text": "x"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "session_id_mismatch"
        refused = proxy.post("/v1/completions", headers=wrong, json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                                    "session_id": session})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-Session-Id"

        warm.process.send_signal(signal.SIGKILL)  # the replica holding the session warm is gone
        warm.process.wait(30)
        moved = proxy.post(f"/v1/sessions/{session}/append", headers=header,
                           json={"text": document(2), "score": True})
        assert moved.status_code == 200, moved.text
        assert moved.json()["logprob"] == expected[2]  # its last committed state, exactly
        assert proxy.get(f"/v1/sessions/{session}").json()["version"] == 6  # 3 appends, 3 completions


def test_session_states_pass_the_proxy_under_their_own_body_limit(fleet, tmp_path):
    """The shipped config takes a session state's body up to 512m (XLSERVE_MAX_STATE_BODY_BYTES'
    paths), streamed on, while JSON bodies keep 8m: a 9 MB import reaches xlserve, whose own
    limit answers (JSON naming its setting), where a 9 MB completion is refused by nginx itself.
    An exported state goes back in through the proxy as a new session. Each request carries one
    X-Request-Id from nginx (its own, or the client's) to the replica, back, and into its log."""
    url, _ = fleet
    nine_mb = b"\0" * 9_000_000
    with httpx.Client(base_url=url, timeout=60) as proxy:
        session = proxy.post("/v1/sessions", json={"model": MODEL}).json()["id"]
        header = {"X-Session-Id": session}
        assert proxy.post(f"/v1/sessions/{session}/append", headers=header,
                          json={"text": document(0)}).status_code == 200
        state = proxy.get(f"/v1/sessions/{session}/state", headers=header)
        assert state.status_code == 200
        imported = proxy.post("/v1/sessions/import", content=state.content)
        assert imported.status_code == 200, imported.text
        put = proxy.put(f"/v1/sessions/{session}/state", headers=header, content=iter([state.content]))
        assert put.status_code == 200, put.text

        for answer in (proxy.post("/v1/sessions/import", content=nine_mb),
                       proxy.put(f"/v1/sessions/{session}/state", headers=header, content=nine_mb)):
            assert answer.status_code == 413 and "XLSERVE_MAX_STATE_BODY_BYTES" in answer.json()["error"]["message"]
        refused = proxy.post("/v1/completions", content=nine_mb, headers={"content-type": "application/json"})
        assert refused.status_code == 413 and "nginx" in refused.text  # nginx's own page: never reached xlserve

        # one request id from nginx to the replica and back, in both locations, and in nginx's log
        given = proxy.get(f"/v1/sessions/{session}", headers=header).headers["x-request-id"]
        assert re.fullmatch("[0-9a-f]{32}", given)
        assert proxy.get(f"/v1/sessions/{session}/state", headers={**header, "X-Request-Id": "mine-1"}
                         ).headers["x-request-id"] == "mine-1"
        # one the replica would not keep (two words): nginx's own goes in its place, on both sides
        replaced = proxy.get(f"/v1/sessions/{session}", headers={**header, "X-Request-Id": "my id"}
                             ).headers["x-request-id"]
        assert re.fullmatch("[0-9a-f]{32}", replaced)
    log = (tmp_path / "nginx" / "access.log").read_text()  # the fleet's nginx, in this test's tmp_path
    assert f"request_id={given} " in log and "request_id=mine-1 " in log and f"request_id={replaced} " in log
