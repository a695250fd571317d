"""The metrics, judged by a real Prometheus: Debian's `prometheus` with
deploy/prometheus/prometheus-file-sd.yml (the shipped job, discovered from a file, since Debian's
build lacks Kubernetes discovery) and the shipped alerts.yml scrapes a real server every second
while a scripted workload runs: plain, streamed and websocket completions, sessions that spill
to the host tier and come back, and one each of 400, 401, 404, 409, 429 and 503. Then, through
Prometheus' HTTP API:

- every expression of deploy/grafana/xlserve-dashboard.json (Grafana's variables substituted:
  $model as All, $__rate_interval as a window over the whole run) and of every alert rule
  (without its threshold) returns data, every rule evaluates without error, and the
  session-refusal alert's whole condition holds after the one 503;
- the error panels show every error type and every code the workload caused, the HTTP panel
  every status, and the counters hold exactly the errors (by type and by code) and error
  statuses the client saw;
- decode batch size p50 and p99 read 1: every step had one row (XLSERVE_MAX_BATCH_SIZE=1);
- the process metrics of each process are its own (their start times are those of the API
  process and of the engine process in /proc).

The test process runs no model and imports no torch: the server is a subprocess."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml
from websockets.sync.client import connect

from xlserve.server.metrics import NO_CODE

from tests.e2e.process_tools import engine_pid
from tests.e2e.server_process import ServerProcess, free_port
from tests.e2e.session_tools import MODEL, document, full_state_bytes, metric

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "xlserve-dashboard.json"
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (Debian: apt-get install "
                                                           "prometheus; `make test` does it)")

KEY = "prometheus-test-key"
WINDOW = "5m"  # for $__rate_interval: longer than the whole run, so every rate sees all of it
GRAFANA_VARIABLES = {"$__rate_interval": WINDOW, "$__interval": WINDOW, "$__range": WINDOW, "$model": ".*"}


# -- Prometheus ----------------------------------------------------------------------------------


class Prometheus:
    def __init__(self, url: str, process: subprocess.Popen, log: Path):
        self.url, self.process, self.log = url, process, log

    def _get(self, path: str, **params) -> dict:
        response = httpx.get(self.url + path, params=params, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self._get("/api/v1/query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def values(self, expr: str, label: str) -> dict[str, float]:
        return {sample["metric"].get(label, ""): float(sample["value"][1]) for sample in self.query(expr)}

    def label_values(self, metric: str, label: str) -> list[str]:
        return self._get(f"/api/v1/label/{label}/values", **{"match[]": metric})

    def rules(self) -> list[dict]:
        return [rule for group in self._get("/api/v1/rules")["groups"] for rule in group["rules"]]

    def wait(self, what: str, condition, timeout: float = 20, explain=lambda: "") -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.process.poll() is None, f"prometheus exited: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"{what}: not within {timeout}s. {explain()}"
            time.sleep(0.25)


def prometheus_config(directory: Path, target: str) -> Path:
    """The shipped file-discovery config as it is, but for a 1 s scrape and evaluation interval,
    this test's target file and the shipped alerts.yml by its absolute path."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus-file-sd.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
    (job,) = config["scrape_configs"]
    (discovery,) = job["file_sd_configs"]
    discovery["files"] = [str(directory / "targets" / "*.json")]
    (directory / "targets").mkdir()
    (directory / "targets" / "xlserve.json").write_text(json.dumps([{"targets": [target]}]))
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def watched(tiny_checkpoint, tmp_path):
    """(server, prometheus): a server whose one device-tier session fits, one batch row and one
    queued request, and a Prometheus scraping it every second."""
    unit = full_state_bytes(tiny_checkpoint)
    server = ServerProcess([tiny_checkpoint], env={
        "XLSERVE_API_KEYS": KEY, "XLSERVE_MAX_BATCH_SIZE": "1", "XLSERVE_MAX_QUEUED_REQUESTS": "1",
        "XLSERVE_DEVICE_STATE_BYTES": str(unit * 3 // 2), "XLSERVE_STATE_DIR": str(tmp_path / "state"),
    }, log_path=tmp_path / "server.log")
    port = free_port()
    config = prometheus_config(tmp_path, f"127.0.0.1:{server.port}")
    log = tmp_path / "prometheus.log"
    process = None
    try:
        server.start()
        with open(log, "wb") as sink:
            process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=sink, stderr=subprocess.STDOUT)
        prometheus = Prometheus(f"http://127.0.0.1:{port}", process, log)

        def ready() -> bool:
            try:
                return httpx.get(prometheus.url + "/-/ready", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        prometheus.wait("prometheus ready", ready)
        yield server, prometheus
    finally:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
        server.stop()


# -- the workload --------------------------------------------------------------------------------


class Client:
    """An API client that tallies every status it gets (and each error's type, and type and code)."""

    def __init__(self, server: ServerProcess):
        self.http = server.client(headers={"Authorization": f"Bearer {KEY}"})
        self.statuses: Counter = Counter()
        self.errors: Counter = Counter()
        self.error_codes: Counter = Counter()
        self.lock = threading.Lock()

    def tally(self, response: httpx.Response) -> httpx.Response:
        with self.lock:
            self.statuses[response.status_code] += 1
            if response.status_code >= 400:
                error = response.json()["error"]
                self.errors[error["type"]] += 1
                self.error_codes[(error["type"], error["code"] or NO_CODE)] += 1
        return response

    def request(self, method: str, path: str, expect: int, **kwargs) -> httpx.Response:
        response = self.tally(self.http.request(method, path, **kwargs))
        assert response.status_code == expect, response.text
        return response

    def open_stream(self, body: dict):
        """A streamed completion, open until closed (its status tallied now, while its headers are in)."""
        context = self.http.stream("POST", "/v1/completions", json={**body, "stream": True})
        response = context.__enter__()
        with self.lock:
            self.statuses[response.status_code] += 1
        assert response.status_code == 200
        return context, response


def run_workload(server: ServerProcess, client: Client) -> None:
    completion = {"model": MODEL, "prompt": "def main():\n", "max_tokens": 8, "temperature": 0}
    for _ in range(3):  # the same prompt again: the prefix cache
        client.request("POST", "/v1/completions", 200, json=completion)
    context, response = client.open_stream({**completion, "stream_options": {"include_usage": True}})
    assert "[DONE]" in "".join(response.iter_text())
    context.__exit__(None, None, None)
    with connect(server.url.replace("http", "ws", 1) + "/v1/stream",
                 additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps({"type": "generate", "model": MODEL, "prompt": "x", "max_tokens": 4}))
        while json.loads(ws.recv(timeout=30))["type"] != "done":
            pass

    # two full sessions where the device tier has room for one: the first spills to the host
    sessions = [client.request("POST", "/v1/sessions", 200, json={"model": MODEL}).json()["id"] for _ in range(2)]
    for i, session in enumerate(sessions):
        client.request("POST", f"/v1/sessions/{session}/append", 200, json={"text": document(i)})
    held, spilled = sessions
    assert client.request("GET", f"/v1/sessions/{held}", 200).json()["tier"] == "host"

    client.request("POST", "/v1/completions", 400, json={**completion, "max_tokens": -1})
    client.request("GET", "/v1/sessions/no-such-session", 404)
    client.tally(httpx.post(server.url + "/v1/completions", json=completion, timeout=30))  # no key: 401
    assert client.statuses[401] == 1

    # a long generation on `held` (back from the host tier) takes the one batch row and the
    # device tier; a second request waits in the queue; a third is refused
    running = client.open_stream({**completion, "max_tokens": 4000, "session_id": held})
    lines = running[1].iter_lines()  # kept referenced: collecting it would close the connection
    assert next(line for line in lines if line.startswith("data: "))
    waiting = client.open_stream({**completion, "max_tokens": 4000})
    client.request("POST", "/v1/completions", 429, json=completion)
    client.request("POST", "/v1/completions", 409, json={**completion, "session_id": held})
    client.request("POST", f"/v1/sessions/{spilled}/append", 503, json={"text": "y"})
    for context, _ in (waiting, running):  # hanging up cancels them
        context.__exit__(None, None, None)
    # both hung up: the running one frees its session, and the engine drops the waiting one from its
    # queue on its next step (a loaded machine may take a while; until then the queue is full)
    deadline = time.monotonic() + 30
    while client.request("GET", f"/v1/sessions/{held}", 200).json()["in_use"] or \
            metric(client.http.get("/metrics").text, "xlserve_requests_waiting", model=MODEL) > 0:
        assert time.monotonic() < deadline, "a cancelled stream still holds its session or its place in the queue"
        time.sleep(0.05)
    client.request("POST", f"/v1/sessions/{spilled}/append", 200, json={"text": "y"})  # room again
    client.request("POST", "/v1/completions", 200, json={**completion, "session_id": held})


# -- the checks ----------------------------------------------------------------------------------


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, expression) of every target, and the variables' queries."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [(panel["title"], target["refId"], target["expr"])
               for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append((f"variable {variable['name']}", "", variable["query"]["query"]))
    return queries


def grafana_to_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


THRESHOLD = re.compile(r"\s*(?:>|<|>=|<=|==|!=)\s*[0-9.]+\s*$")


def measured(expr: str) -> str:
    """An alert's expression without its threshold (what the alert compares), or the inner
    expression of an absent(): what must return data while nothing is wrong."""
    expr = " ".join(expr.split())
    absent = re.fullmatch(r"absent\((.*)\)", expr)
    if absent:
        return absent.group(1)
    return THRESHOLD.sub("", expr)


def start_time(pid: int) -> float:
    """A process's start, in seconds since the epoch, as prometheus_client reads it from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return boot + float(fields[19]) / ticks


def test_every_dashboard_and_alert_expression_returns_data_under_a_workload_with_errors(watched):
    server, prometheus = watched
    # the counters' zeros are in before the first event, so the first error reads as a rate above 0
    prometheus.wait("two scrapes of the server",
                    lambda: prometheus.values('count_over_time(up{job="xlserve"}[1m])', "job").get("xlserve", 0) >= 2)
    client = Client(server)
    try:
        run_workload(server, client)
    finally:
        client.http.close()
    expected_errors = {"invalid_request_error": 1, "not_found_error": 1, "authentication_error": 1,
                       "rate_limit_error": 1, "session_busy": 1, "service_unavailable": 1}
    assert client.errors == expected_errors
    # the codes tell apart what one type lumps together (a 404 for a session, not a model)
    expected_codes = {("invalid_request_error", NO_CODE): 1, ("not_found_error", "session_not_found"): 1,
                      ("authentication_error", "invalid_api_key"): 1, ("rate_limit_error", "queue_full"): 1,
                      ("session_busy", "session_busy"): 1, ("service_unavailable", "session_cache_full"): 1}
    assert client.error_codes == expected_codes
    expected_statuses = {status: count for status, count in client.statuses.items() if status >= 400}
    assert set(expected_statuses) == {400, 401, 404, 409, 429, 503}

    # a scrape after the workload: the counters hold what the client saw, exactly (the polls of
    # /ready while the server loaded were 503s, and no errors)
    def counted() -> tuple[dict, dict, dict]:
        errors = prometheus.values("sum by (type) (xlserve_request_errors_total)", "type")
        codes = {(sample["metric"]["type"], sample["metric"]["code"]): float(sample["value"][1])
                 for sample in prometheus.query("sum by (type, code) (xlserve_request_errors_total)")}
        statuses = prometheus.values('sum by (status) (xlserve_http_requests_total{route!="/ready"})', "status")
        return ({t: v for t, v in errors.items() if v}, {pair: v for pair, v in codes.items() if v},
                {int(s): v for s, v in statuses.items() if int(s) >= 400 and v})

    prometheus.wait("the workload's errors and statuses scraped",
                    lambda: counted() == (expected_errors, expected_codes, expected_statuses), timeout=15,
                    explain=lambda: f"Prometheus has {counted()}, "
                                    f"the client saw {expected_errors, expected_codes, expected_statuses}")
    statuses = prometheus.values("sum by (status) (xlserve_http_requests_total)", "status")
    assert statuses["101"] == 1  # the websocket's handshake
    routes = prometheus.values("sum by (route) (xlserve_http_requests_total)", "route")
    assert {"/v1/completions", "/v1/sessions/{session_id}", "/v1/sessions/{session_id}/append", "/v1/stream",
            "/metrics"} <= set(routes)
    assert not [route for route in routes if "no-such-session" in route]  # templates, never raw paths
    time.sleep(1.5)  # and one more evaluation of the rules with those samples in

    # every panel's expression returns data
    empty = [(title, ref, grafana_to_promql(expr)) for title, ref, expr in dashboard_queries()
             if not expr.startswith("label_values(") and not prometheus.query(grafana_to_promql(expr))]
    assert not empty, f"dashboard queries without data: {empty}"
    for title, _, expr in dashboard_queries():
        match = re.fullmatch(r"label_values\((\w+), (\w+)\)", expr)
        if match:
            assert MODEL in prometheus.label_values(*match.groups()), title

    # ... and shows what happened: each error type, each status, one row per decode step
    panels = {(title, ref): grafana_to_promql(expr) for title, ref, expr in dashboard_queries()}
    by_type = prometheus.values(panels[("Errors per second by type", "A")], "type")
    assert {t for t, rate in by_type.items() if rate > 0} == set(expected_errors), by_type
    by_code = {(sample["metric"]["type"], sample["metric"]["code"]): float(sample["value"][1])
               for sample in prometheus.query(panels[("Errors per second by code", "A")])}
    assert {pair for pair, rate in by_code.items() if rate > 0} == set(expected_codes), by_code
    by_status = prometheus.values(panels[("HTTP responses/s by status", "A")], "status")
    assert {"400", "401", "404", "409", "429", "503", "200", "101"} <= {s for s, rate in by_status.items() if rate > 0}
    assert prometheus.values(panels[("Requests refused for lack of room (503)", "A")], "tier")["device"] > 0
    for ref in ("A", "B", "C"):  # p50, p99 and the mean
        (batch,) = prometheus.values(panels[("Decode batch size", ref)], "model").values()
        assert batch == pytest.approx(1, abs=1e-3), (ref, batch)
    usage = prometheus.values('xlserve_session_cache_usage_ratio{tier="device"}', "tier")["device"]
    assert 0 < usage <= 1

    # every alert rule: loaded, evaluated without error, its measured expression returns data
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    shipped = {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}
    loaded = {rule["name"]: rule for rule in prometheus.rules()}
    assert set(loaded) == set(shipped)
    assert {name: rule.get("lastError") for name, rule in loaded.items() if rule["health"] != "ok"} == {}
    empty = [(name, measured(expr)) for name, expr in shipped.items() if not prometheus.query(measured(expr))]
    assert not empty, f"alert expressions without data: {empty}"
    assert prometheus.query(shipped["XlserveSessionRefusals"]), "the first refusal makes the refusal alert's condition true"

    # each process reports its own process metrics
    api = prometheus.values('process_start_time_seconds{job="xlserve"}', "job")["xlserve"]
    engine = prometheus.values("xlserve_engine_process_start_time_seconds", "job")["xlserve"]
    assert api == pytest.approx(start_time(server.process.pid), abs=0.05)
    assert engine == pytest.approx(start_time(engine_pid(server)), abs=0.05)
    assert prometheus.values("xlserve_engine_process_resident_memory_bytes", "job")["xlserve"] > 50 << 20  # torch
    assert prometheus.values('process_open_fds{job="xlserve"}', "job")["xlserve"] >= 3
