"""`X-Request-Id` on every HTTP answer (server/api/request_ids.py): a client's own id when it is one
word of visible ASCII up to 128 characters, a fresh one otherwise, on answers from a route, from a
middleware's refusal, and from the last-resort handler of an unexpected exception (sent outside
the middleware), which also logs the id with the request.

The app `build_app` makes, with the scripted engine of tests/server/test_request_edges.py."""

from __future__ import annotations

import logging
import re

from starlette.testclient import TestClient

from tests.server.test_request_edges import MODEL, make_app

BODY = {"model": MODEL, "prompt": "ab", "max_tokens": 1}


def test_an_answer_carries_a_fresh_id_or_the_clients_own():
    app, state = make_app()
    client = TestClient(app)
    first, second = client.post("/v1/completions", json=BODY), client.get("/v1/models")
    assert first.status_code == 200 and second.status_code == 200
    ids = [response.headers["x-request-id"] for response in (first, second)]
    assert all(re.fullmatch("[0-9a-f]{32}", request_id) for request_id in ids) and ids[0] != ids[1]
    mine = "trace-7f3a:batch/12"
    assert client.get("/v1/models", headers={"X-Request-Id": mine}).headers["x-request-id"] == mine
    # one header, never two: the client's replaces nothing the app would add
    assert client.get("/v1/models", headers={"X-Request-Id": mine}).headers.get_list("x-request-id") == [mine]


def test_an_id_that_would_not_fit_one_log_word_is_replaced():
    app, state = make_app()
    client = TestClient(app)
    for unfit in ("two words", "x" * 129, "tab\there", ""):
        answered = client.get("/v1/models", headers={"X-Request-Id": unfit}).headers["x-request-id"]
        assert re.fullmatch("[0-9a-f]{32}", answered), unfit
    assert client.get("/v1/models", headers={"X-Request-Id": "x" * 128}).headers["x-request-id"] == "x" * 128


def test_refusals_before_the_route_carry_the_id_too():
    app, state = make_app()
    client = TestClient(app)
    too_large = client.post("/v1/completions", content=b"{" + b" " * 200_000 + b"}",
                            headers={"content-type": "application/json", "x-request-id": "big-1"})
    assert too_large.status_code == 413 and too_large.headers["x-request-id"] == "big-1"
    unknown = client.get("/v1/nothing-here", headers={"x-request-id": "lost-1"})
    assert unknown.status_code == 404 and unknown.headers["x-request-id"] == "lost-1"
    invalid = client.post("/v1/completions", json={**BODY, "max_tokens": -1}, headers={"x-request-id": "bad-1"})
    assert invalid.status_code == 400 and invalid.headers["x-request-id"] == "bad-1"


def test_an_unexpected_failure_is_answered_and_logged_with_the_id(caplog):
    app, state = make_app()

    async def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug in the server")

    state.engine.acquire = broken
    client = TestClient(app, raise_server_exceptions=False)
    with caplog.at_level(logging.WARNING, logger="xlserve.server"):
        response = client.post("/v1/sessions/s1/append", json={"text": "hi"}, headers={"x-request-id": "oops-42"})
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal error: ZeroDivisionError"
    assert response.headers.get_list("x-request-id") == ["oops-42"]
    assert any("oops-42" in record.getMessage() and "/v1/sessions/s1/append" in record.getMessage()
               for record in caplog.records)


def test_every_answer_of_the_servers_side_is_logged_with_the_id(caplog):
    """A 5xx an engine error maps to (here a request that failed in its forward) is logged with the
    id, the route and the code; a 4xx, the client's own mistake, is not."""
    import logging

    from xlserve.server.engine.errors import RequestFailed

    app, state = make_app()
    state.engine.events = [RequestFailed("this request failed while running the model", code="forward_failed")]
    client = TestClient(app)
    with caplog.at_level(logging.WARNING, logger="xlserve.server"):
        failed = client.post("/v1/completions", json=BODY, headers={"x-request-id": "engine-7"})
        refused = client.post("/v1/completions", json={**BODY, "max_tokens": -1}, headers={"x-request-id": "mine-8"})
    assert failed.status_code == 500 and refused.status_code == 400
    lines = [record.getMessage() for record in caplog.records]
    assert any("engine-7" in line and "/v1/completions" in line and "forward_failed" in line for line in lines), lines
    assert not any("mine-8" in line for line in lines)
