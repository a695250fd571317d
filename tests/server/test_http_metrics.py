"""HTTP responses and errors as the API process counts them: the app `build_app` makes, with a
stand-in for the engine process (no model, no torch work), driven through starlette's test
client. What each response counts in xlserve_http_requests_total{route, method, status} and
xlserve_request_errors_total{model, type, code}: once, under the route's template, and an
error under the model only when the server serves it and under its code only when the error
registry knows it.

The engine-side metrics (tier budgets and usage, request phases, the engine process's own
process metrics) are checked here too, on `Metrics` itself and on a real `Engine`."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

import xlserve.server
from xlserve.models.tokenizer import ByteTokenizer
from xlserve.server.api.deps import AppState, ServedModel
from xlserve.server.api.errors import ERROR_TYPES
from xlserve.server.app import build_app, expected_responses
from xlserve.server.cache.errors import SessionLocked
from xlserve.server.engine.errors import Cancelled, QueueFull, RequestFailed
from xlserve.server.engine.types import ChoiceFinished, Finished, TokenEvent
from xlserve.server.errors import error_codes
from xlserve.server.metrics import NO_CODE, UNMATCHED_ROUTE, UNREGISTERED_CODE, Metrics, error_code_label
from xlserve.server.settings import Settings

from tests.server.scripted_engine import ScriptedEngine

MODEL = "m"
SERVER_ROOT = Path(xlserve.server.__file__).parent


@pytest.fixture
def served():
    """(client, state): the app with one served model, its state filled in as the lifespan would."""
    settings = Settings(models="none-loaded", api_keys="key", max_request_body_bytes=1000)
    app = build_app(settings)
    metrics = Metrics()
    state = AppState(settings=settings, metrics=metrics, api_keys=["key"], ready=True)
    state.engine = ScriptedEngine(metrics, alive=False)
    card = {"id": MODEL, "object": "model", "created": 0, "owned_by": "xlserve", "architecture": "transformer-xl",
            "state_kind": "segment-recurrence", "state_grows_with_context": False, "max_context": None,
            "parameters": 0, "config": {},
            "quantize": "none", "weight_bytes": 0,
            "state_bytes_per_session": 9216}  # every field of a card: /v1/models answers with it (protocol.ModelCard)
    state.models = {MODEL: ServedModel(MODEL, ByteTokenizer(), 256, card)}
    metrics.declare_api_series(list(state.models), ERROR_TYPES)  # as the lifespan does
    metrics.declare_http_series(expected_responses(app))
    app.state.xlserve = state
    client = TestClient(app, headers={"Authorization": "Bearer key"})  # not entered: no lifespan, no engine process
    yield client, state
    client.close()


def samples(metrics: Metrics, name: str) -> dict[tuple, float]:
    """{label values sorted by label name: value} of one series name in the exposition."""
    found = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(value for _, value in sorted(sample.labels.items()))] = sample.value
    return found


def responses(state) -> dict[tuple, float]:
    """(method, route, status) -> responses counted, those above 0."""
    return {key: value for key, value in samples(state.metrics, "xlserve_http_requests_total").items() if value}


def errors(state) -> dict[tuple, float]:
    """(model, type, code) -> errors counted, those above 0."""
    counted = samples(state.metrics, "xlserve_request_errors_total").items()  # keyed (code, model, type)
    return {(model, type_, code): value for (code, model, type_), value in counted if value}


def test_responses_are_counted_by_route_template_method_and_status(served):
    client, state = served
    assert client.get("/v1/models").status_code == 200
    assert client.get(f"/v1/models/{MODEL}").status_code == 200
    assert client.get("/v1/models/nope").status_code == 404
    assert client.get("/v1/sessions/abc").status_code == 404
    assert client.get("/v1/sessions/def").status_code == 404
    assert client.delete("/v1/models").status_code == 405
    for path in ("/nope", "/wp-admin/x.php", "/v1/sessions/a/b/c"):
        assert client.get(path).status_code == 404
    assert responses(state) == {
        ("GET", "/v1/models", "200"): 1,
        ("GET", "/v1/models/{name}", "200"): 1,
        ("GET", "/v1/models/{name}", "404"): 1,
        ("GET", "/v1/sessions/{session_id}", "404"): 2,
        ("DELETE", "/v1/models", "405"): 1,
        ("GET", UNMATCHED_ROUTE, "404"): 3,  # raw paths never become label values
    }
    durations = samples(state.metrics, "xlserve_http_request_duration_seconds_count")
    assert durations[("GET", "/v1/sessions/{session_id}")] == 2


def test_every_error_is_counted_once_by_type_and_served_model(served):
    client, state = served
    engine = state.engine
    assert errors(state) == {}
    # validation (400), a model the server does not serve (404: not a label value), auth (401)
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}).status_code == 400
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "bogus": 1}).status_code == 400
    assert client.post("/v1/completions", json={"model": "someone-elses", "prompt": "x"}).status_code == 404
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                       headers={"Authorization": "Bearer wrong"}).status_code == 401
    # refused by the engine before it accepted the request (429), a busy session (409)
    engine.refuse = QueueFull("full", code="queue_full")
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 429
    engine.refuse = None
    engine.session_error = SessionLocked("s")
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "session_id": "s"}).status_code == 409
    assert client.post("/v1/sessions/s/append", json={"text": "x"}).status_code == 409  # names no model
    # the admission's own answers: a body past the limit (413)
    assert client.post("/v1/completions", content=b'{"model": "m", "prompt": "' + b"x" * 2000 + b'"}',
                       headers={"content-type": "application/json"}).status_code == 413
    assert errors(state) == {
        (MODEL, "invalid_request_error", NO_CODE): 2,  # pydantic's validation errors carry no code
        ("", "not_found_error", "model_not_found"): 1,
        # refused before its body is read (server/api/admission.py): the model it names is not known
        ("", "authentication_error", "invalid_api_key"): 1,
        (MODEL, "rate_limit_error", "queue_full"): 1,
        (MODEL, "session_busy", "session_busy"): 1,
        ("", "session_busy", "session_busy"): 1,
        ("", "request_too_large", NO_CODE): 1,
    }
    counted = responses(state)
    assert counted[("POST", "/v1/completions", "413")] == 1  # answered before routing, under its route
    assert counted[("POST", "/v1/sessions/{session_id}/append", "409")] == 1


def test_a_stream_counts_once_with_its_status_and_an_error_in_it_once(served):
    client, state = served
    engine = state.engine
    engine.events = [TokenEvent(65, "A", -0.1, []), ChoiceFinished(0, "length", "", 1),
                     Finished([ChoiceFinished(0, "length", "", 1)], 1, 1, 0, None)]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200 and "[DONE]" in response.read().decode()
    engine.events = [TokenEvent(65, "A", -0.1, []), RequestFailed("row failed", code="sampling_failed")]
    with client.stream("POST", "/v1/completions", json=body) as response:
        text = response.read().decode()
        assert response.status_code == 200 and '"internal_error"' in text
    # a plain request that fails after it was accepted: the handler answers and counts it
    assert client.post("/v1/completions", json={**body, "stream": False}).status_code == 500
    assert responses(state) == {("POST", "/v1/completions", "200"): 2, ("POST", "/v1/completions", "500"): 1}
    assert errors(state) == {(MODEL, "internal_error", "sampling_failed"): 2}


def test_a_client_that_left_is_no_server_error(served):
    client, state = served
    state.engine.events = [Cancelled()]
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    assert response.status_code == 499
    assert responses(state) == {("POST", "/v1/completions", "499"): 1}
    assert errors(state) == {}


def test_gate_answers_count_under_their_route(served):
    client, state = served
    models, state.models = state.models, {}  # still loading: everything but the open paths gets 503
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 503
    with client.websocket_connect("/v1/stream") as ws:
        assert ws.receive_json()["error"]["code"] == "loading"
    state.models = models
    state.draining = True
    assert client.get("/v1/sessions/abc").status_code == 503
    assert client.get("/metrics").status_code == 200  # open while draining
    counted = responses(state)
    assert counted[("POST", "/v1/completions", "503")] == 1
    assert counted[("GET", "/v1/stream", "101")] == 1
    assert counted[("GET", "/v1/sessions/{session_id}", "503")] == 1
    assert errors(state) == {("", "service_unavailable", "loading"): 2, ("", "service_unavailable", "shutting_down"): 1}


def test_websocket_handshakes_and_frames_are_counted(served):
    client, state = served
    with client.websocket_connect("/v1/stream") as ws:  # the key in the Authorization header
        ws.send_text("not json")
        assert ws.receive_json()["type"] == "error"
        ws.send_json({"type": "generate", "model": MODEL, "prompt": "x", "max_tokens": -1})  # invalid: no model yet
        assert ws.receive_json()["type"] == "error"
        state.engine.refuse = QueueFull("full", code="queue_full")
        ws.send_json({"type": "generate", "model": MODEL, "prompt": "x", "max_tokens": 1})
        assert ws.receive_json()["error"]["type"] == "rate_limit_error"
        state.engine.refuse = None
        state.engine.events = [TokenEvent(65, "A", -0.1, []), RequestFailed("row failed", code="sampling_failed")]
        ws.send_json({"type": "generate", "model": MODEL, "prompt": "x", "max_tokens": 2})
        assert ws.receive_json()["type"] == "token"
        assert ws.receive_json()["error"]["code"] == "sampling_failed"
    with TestClient(client.app).websocket_connect("/v1/stream") as ws:  # no key
        assert ws.receive_json()["error"]["type"] == "authentication_error"
    assert responses(state) == {("GET", "/v1/stream", "101"): 2}
    assert errors(state) == {("", "invalid_request_error", "malformed_frame"): 2,
                             (MODEL, "rate_limit_error", "queue_full"): 1,
                             (MODEL, "internal_error", "sampling_failed"): 1,
                             ("", "authentication_error", "invalid_api_key"): 1}


def test_responses_the_api_answers_exist_at_zero(served):
    client, state = served
    declared = set(samples(state.metrics, "xlserve_http_requests_total"))
    assert {("POST", "/v1/completions", status) for status in ("200", "400", "401", "404", "409", "429", "503")} \
        <= declared
    assert ("GET", "/v1/sessions/{session_id}", "404") in declared and ("GET", "/v1/stream", "101") in declared
    assert ("GET", "/docs", "200") in declared and ("GET", "/docs", "404") not in declared  # a page: 200 only
    assert not [key for key in declared if key[0] == "HEAD"]
    assert len(declared) < 250  # bounded: routes x methods x statuses, never paths
    client.request("FOO", "/v1/models")  # a method that is no HTTP method is not a label value
    assert ("other", "/v1/models", "405") in responses(state)


def test_errors_of_every_type_and_code_exist_at_zero_for_requests_of_no_served_model():
    """Each type without a code and with each registered code of that type, for every model and
    for "": the pairs a client can be answered with, never every type with every code."""
    metrics = Metrics()
    metrics.declare_api_series([MODEL], ERROR_TYPES)
    declared = {(model, type_, code) for code, model, type_ in samples(metrics, "xlserve_request_errors_total")}
    pairs = {(t, NO_CODE) for t in ERROR_TYPES} | {(t, code) for code, t in error_codes().items()}
    assert {(model, t, code) for model in ("", MODEL) for t, code in pairs} == declared
    assert ("", "not_found_error", "model_not_found") in declared
    assert (MODEL, "not_found_error", "session_not_found") in declared
    assert (MODEL, "internal_error", "forward_failed") in declared  # a code raised in place of a default
    assert not {code for _, _, code in declared} - set(error_codes()) - {NO_CODE}
    assert len(declared) < 2 * (len(ERROR_TYPES) + len(error_codes())) + 1  # per model: linear, not a product


def test_model_not_found_and_session_not_found_are_told_apart_by_code(served):
    client, state = served
    assert client.post("/v1/completions", json={"model": "someone-elses", "prompt": "x"}).status_code == 404
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "session_id": "s"}).status_code == 404
    assert errors(state) == {("", "not_found_error", "model_not_found"): 1,
                             (MODEL, "not_found_error", "session_not_found"): 1}


def test_the_code_label_takes_only_registered_codes():
    assert error_code_label(None) == NO_CODE
    assert error_code_label("session_not_found") == "session_not_found"
    assert error_code_label("malformed_frame") == "malformed_frame"  # one the API raises, not a class's default
    for unknown in ("a code nobody registered", "", 404):
        assert error_code_label(unknown) == UNREGISTERED_CODE
    assert NO_CODE not in error_codes() and UNREGISTERED_CODE not in error_codes()


def test_where_errors_are_counted_every_code_is_registered_and_metrics_imports_no_layer():
    """server/metrics.py reads the registry as imported so far and imports no layer: in a fresh
    interpreter, metrics alone loads neither the engine nor the cache, and once the module that
    counts errors (server/api/errors.py) is imported, every engine and cache code is a label value
    and is declared at 0."""
    script = (
        "import sys\n"
        "from xlserve.server.metrics import Metrics, error_code_label\n"
        "assert not [m for m in sys.modules if m.startswith(('xlserve.server.engine', 'xlserve.server.cache'))]\n"
        "from xlserve.server.api.errors import ERROR_TYPES, count_error\n"
        "assert error_code_label('session_not_found') == 'session_not_found'\n"
        "assert error_code_label('queue_full') == 'queue_full'\n"
        "metrics = Metrics()\n"
        "metrics.declare_api_series(['m'], ERROR_TYPES)\n"
        "text = metrics.render().decode()\n"
        "assert 'xlserve_request_errors_total{code=\"session_not_found\",model=\"m\",type=\"not_found_error\"} 0.0' in text\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def codes_written_in(source: str) -> set[str]:
    """The string codes a module writes where an error is made: `code="..."` arguments,
    `code or "..."` fallbacks and the code given to the scheduler's `request_error`."""
    written = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg == "code":
            candidates = [node.value]
        elif isinstance(node, ast.BoolOp) and isinstance(node.values[0], ast.Name) and node.values[0].id == "code":
            candidates = node.values[1:]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "request_error" and len(node.args) > 1:
            candidates = [node.args[1]]
        else:
            continue
        written |= {c.value for c in candidates if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return written


def test_every_code_written_in_the_server_is_registered():
    """The label's values stay the registry's: a code a module raises an error with and the
    registry (server/errors.py RAISED_CODES, or a class's default_code) lacks would be counted
    as "unregistered"."""
    written = {path.relative_to(SERVER_ROOT).as_posix(): codes_written_in(path.read_text())
               for path in sorted(SERVER_ROOT.rglob("*.py"))}
    everything = set().union(*written.values())
    assert {"malformed_frame", "invalid_api_key", "forward_failed", "server_shutting_down"} <= everything  # the scan sees them
    unregistered = {module: sorted(codes - set(error_codes())) for module, codes in written.items()
                    if codes - set(error_codes())}
    assert not unregistered, f"codes missing from server/errors.py RAISED_CODES: {unregistered}"


# -- the engine process's side -------------------------------------------------------------------


def test_tier_budgets_and_usage_ratio_are_read_at_every_scrape():
    metrics = Metrics()
    used = {"device": 0, "host": 0, "disk": 0, "redis": 5}
    metrics.declare_tiers({"device": 1000, "host": 4000, "disk": 0, "redis": None}, used.__getitem__, "redis")
    assert samples(metrics, "xlserve_session_cache_last_tier") == {("redis",): 1}  # the disk only spills
    assert samples(metrics, "xlserve_session_cache_budget_bytes") == {("device",): 1000, ("host",): 4000,
                                                                      ("disk",): 0}
    assert samples(metrics, "xlserve_session_cache_usage_ratio") == {("device",): 0, ("host",): 0, ("disk",): 0}
    used.update(device=750, host=4000)
    assert samples(metrics, "xlserve_session_cache_usage_ratio") == {("device",): 0.75, ("host",): 1, ("disk",): 0}


def test_each_process_renders_its_own_process_metrics():
    metrics = Metrics()
    api = {f.name for f in text_string_to_metric_families(metrics.render(engine_side=False).decode())}
    engine = {f.name for f in text_string_to_metric_families(metrics.render(engine_side=True).decode())}
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds"} <= api
    assert {"xlserve_engine_process_cpu_seconds", "xlserve_engine_process_resident_memory_bytes",
            "xlserve_engine_process_open_fds"} <= engine
    assert not {name for name in api if "engine_process" in name}
    assert not {name for name in engine if name.startswith("process_")}
    assert {"xlserve_http_requests", "xlserve_request_errors"} <= api
    assert {"xlserve_request_queue_time_seconds", "xlserve_session_cache_usage_ratio"} <= engine - api


def test_queue_prefill_and_decode_times_are_observed_per_request():
    """One batch row: the second of two requests waits in the queue while the first decodes.
    Each phase is observed once per request that went through it: a max_tokens=0 request and
    an append have no decode phase."""
    from tests.server.test_engine import HistoryModel, collect, generation, make_engine
    from xlserve.server.engine import local

    engine = make_engine(HistoryModel(), max_batch_size=1)

    async def main():
        started = time.monotonic()
        answers = await asyncio.gather(collect(engine, generation(engine, "ab", max_tokens=40)),
                                       collect(engine, generation(engine, "cd", max_tokens=40)))
        took = time.monotonic() - started
        await collect(engine, generation(engine, "ef", max_tokens=0))
        await local.append(engine, engine.fresh_data(), list(b"gh"))
        return answers, took

    try:
        answers, took = asyncio.run(main())
    finally:
        engine.close()
    assert [len(answer["tokens"][0]) for answer in answers] == [40, 40]

    def histogram(name):
        found = samples(engine.metrics, f"xlserve_request_{name}_time_seconds_count"), \
            samples(engine.metrics, f"xlserve_request_{name}_time_seconds_sum")
        return found[0][("m",)], found[1][("m",)]

    queued, queue_seconds = histogram("queue")
    prefilled, _ = histogram("prefill")
    decoded, decode_seconds = histogram("decode")
    assert (queued, prefilled, decoded) == (4, 4, 2)
    # the second request waited for (most of) the first one's decoding, and nothing took longer than the run
    assert 0 < decode_seconds / 2 <= took and queue_seconds >= 0.5 * decode_seconds / 2


def test_requests_are_counted_once_each_and_appends_with_their_latency():
    """xlserve_requests_total counted a request once per choice (n=3 made 3) and never an append,
    whose end-to-end latency was never observed either (its consumer stops at its last event)."""
    from tests.server.test_engine import HistoryModel, collect, generation, make_engine
    from xlserve.server.engine import local

    engine = make_engine(HistoryModel())

    async def main():
        await collect(engine, generation(engine, "ab", max_tokens=3, n=3, temperature=1.0, seed=1))
        await collect(engine, generation(engine, "cd", max_tokens=2))
        await local.append(engine, engine.fresh_data(), list(b"gh"))

    try:
        asyncio.run(main())
    finally:
        engine.close()
    counted = {labels: value for labels, value in samples(engine.metrics, "xlserve_requests_total").items() if value}
    assert counted == {("length", "m"): 2, ("appended", "m"): 1}
    assert samples(engine.metrics, "xlserve_e2e_request_latency_seconds_count")[("m",)] == 3


def test_latency_histograms_reach_past_a_minute():
    """4,096 tokens after a 1 MB prompt take minutes on a CPU: 60 s buckets clamped the p99 panels
    and the time-to-first-token alert."""
    metrics = Metrics()
    metrics.e2e_latency.labels("m").observe(500.0)
    metrics.time_to_first_token.labels("m").observe(200.0)
    for name in ("xlserve_e2e_request_latency_seconds_bucket", "xlserve_time_to_first_token_seconds_bucket"):
        buckets = {labels[0]: value for labels, value in samples(metrics, name).items()}
        assert buckets["60.0"] == 0 and buckets["600.0"] == 1, name


def test_a_step_that_fails_leaves_no_running_requests_counted():
    """The running gauge was set only at a step's end: a step that raised left it at its old value
    until another request finished a step."""
    from tests.server.test_engine import HistoryModel, collect, generation, make_engine

    engine = make_engine(HistoryModel())
    real_step = engine._step
    calls = []

    def step_then_fail():
        calls.append(1)
        real_step()
        if len(calls) == 3:
            engine._running_metric.set(len(engine._running))  # as a step's end does: 1 running
            raise RuntimeError("injected: the step loop's own bug")

    engine._step = step_then_fail

    async def main():
        return await collect(engine, generation(engine, "ab", max_tokens=40))

    try:
        with pytest.raises(Exception):
            asyncio.run(main())
    finally:
        engine.close()
    assert samples(engine.metrics, "xlserve_requests_running")[("m",)] == 0


def test_an_error_once_a_session_is_held_is_counted_under_its_model(served):
    """A session route names no model: what failed once its session was held (the engine process
    restarting mid-append, a commit whose outcome is unknown) was counted under model "", which
    the per-model error ratio and its alert drop."""
    from xlserve.server.cache.errors import SessionInfo
    from xlserve.server.engine.client import RemoteLease
    from xlserve.server.engine.errors import EngineRestarting

    client, state = served
    engine = state.engine
    released = []

    async def acquire(session_id, owner, key):
        return RemoteLease(1, session_id, SessionInfo(session_id, MODEL, None, 0, 0, 10, "device", 0.0, 0.0), False)

    async def append(lease, tokens, score):
        raise EngineRestarting("the engine process is restarting", code="engine_restarting")

    engine.acquire, engine.append, engine.release = acquire, append, released.append
    assert client.post("/v1/sessions/s/append", json={"text": "x"}).status_code == 503
    assert errors(state) == {(MODEL, "service_unavailable", "engine_restarting"): 1} and len(released) == 1


def test_latencies_count_the_wait_for_the_session(served):
    """Time to first token and end-to-end latency were counted from the engine's submission, after
    the request had waited for its session (a restore from host RAM, disk or Redis: 237 MB at
    wt103's size; or a compaction's hold): a slow restore never reached the TTFT alert."""
    client, state = served
    wait = 0.3

    async def commit(info):
        return info

    script_a_session(state, commit, acquire_wait=wait)
    answer = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "session_id": "s"})
    assert answer.status_code == 200, answer.text
    assert samples(state.metrics, "xlserve_time_to_first_token_seconds_sum")[(MODEL,)] >= wait
    assert samples(state.metrics, "xlserve_e2e_request_latency_seconds_sum")[(MODEL,)] >= wait
    assert client.post("/v1/sessions/s/append", json={"text": "more"}).status_code == 200
    latencies = samples(state.metrics, "xlserve_e2e_request_latency_seconds_sum")[(MODEL,)]
    assert samples(state.metrics, "xlserve_e2e_request_latency_seconds_count")[(MODEL,)] == 2
    assert latencies >= 2 * wait


def test_a_request_whose_commit_fails_counts_once_in_the_error_ratio(served):
    """The engine counts a request in xlserve_requests_total when it finishes; a commit refused
    after that (a full tier: every delta commit grows the log) was an error too, so the error
    ratio's denominator counted it twice and a tier refusing every commit read 50%, not 100%."""
    from xlserve.server.cache.errors import CacheFull

    client, state = served
    engine = state.engine

    async def commit(info):
        raise CacheFull("the disk tier is full")

    script_a_session(state, commit)
    not_committed = lambda: samples(state.metrics, "xlserve_requests_not_committed_total")[(MODEL,)]  # noqa: E731
    assert not_committed() == 0  # declared: the ratio has a series before the first failure
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                "session_id": "s"}).status_code == 503
    assert client.post("/v1/sessions/s/append", json={"text": "more"}).status_code == 503
    assert not_committed() == 2
    assert errors(state) == {(MODEL, "service_unavailable", "session_cache_full"): 2}
    # a stream answered before its commit: the error comes as an event, counted the same way
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                        "session_id": "s", "stream": True}) as answer:
        assert "session_cache_full" in "".join(answer.iter_text())
    assert not_committed() == 3
    assert errors(state) == {(MODEL, "service_unavailable", "session_cache_full"): 3}
    # a cache's 503 is answered as its own; nothing else moved
    script_a_session(state, lambda info: asyncio.sleep(0, info))
    assert client.post("/v1/sessions/s/append", json={"text": "more"}).status_code == 200
    assert not_committed() == 3


def test_an_engine_restart_counts_once_however_many_starts_it_took(monkeypatch):
    """Each failed attempt to start the new engine process counted a restart too: one death
    whose first two respawns failed (the GPU's memory not yet freed) read as 3 restarts."""
    from xlserve.server.engine import client as engine_client

    metrics = Metrics()
    engine = engine_client.EngineClient(Settings(models="none-loaded", engine_restart_limit=5), metrics)
    engine.models = [{"name": MODEL}]
    attempts = []

    async def spawn():
        attempts.append(1)
        if len(attempts) < 3:
            raise engine_client.EngineStartFailed("CUDA out of memory")
        engine.process = type("Process", (), {"pid": 1})()

    async def no_wait(seconds):
        pass

    engine._spawn, engine._ready = spawn, lambda restarted: None
    monkeypatch.setattr(engine_client.asyncio, "sleep", no_wait)
    asyncio.run(engine._restart("the engine process was killed"))
    assert len(attempts) == 3
    assert samples(metrics, "xlserve_engine_restarts_total")[(MODEL,)] == 1
    # one that never comes up (its starts fail past the limit) counts all the same: its alert fires
    failing = engine_client.EngineClient(Settings(models="none-loaded", engine_restart_limit=2), metrics)
    failing.models, failing._fatal = [{"name": "other"}], lambda reason: None

    async def never():
        raise engine_client.EngineStartFailed("CUDA out of memory")

    failing._spawn = never
    asyncio.run(failing._restart("the engine process was killed"))
    assert samples(metrics, "xlserve_engine_restarts_total")[("other",)] == 1


def script_a_session(state, commit, acquire_wait: float = 0.0) -> None:
    """The scripted engine with one session "s" of MODEL: taken after `acquire_wait` seconds (a
    restore), committed by `commit`, appended to at once; a generation's one token, then its end."""
    from xlserve.server.cache.errors import SessionInfo
    from xlserve.server.engine.client import RemoteLease
    from xlserve.server.engine.types import Appended, Submission

    info = SessionInfo("s", MODEL, None, 5, 1, 10, "disk", 0.0, 0.0)

    async def acquire(session_id, owner, key):
        await asyncio.sleep(acquire_wait)
        return RemoteLease(1, session_id, info, True)

    async def append(lease, tokens, score):
        submission = Submission(MODEL, state.metrics, threading.Event(), wake=lambda: None)
        submission.put(Appended(None, 0.0, 0))
        return submission

    async def committed(lease, result=None):
        return await commit(info)

    engine = state.engine
    engine.acquire, engine.commit, engine.append, engine.release = acquire, committed, append, lambda lease: None
    engine.events = [TokenEvent(ord("a"), "a", -0.1, []), ChoiceFinished(0, "length", "", 1),
                     Finished(choices=[ChoiceFinished(0, "length", "", 1)], prompt_tokens=1, completion_tokens=1,
                              cached_tokens=5, data=None)]
