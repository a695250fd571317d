"""What the server answers is what server/api/protocol.py's response models say, and what
/openapi.json documents: every route's body, its errors, the chunks of its streams.

The app `build_app` makes, driven through starlette's test client with a stand-in for the engine
process that plays back a script of engine events (no model, no torch work). JSON bodies are
validated by FastAPI as they are sent; the SSE chunks and websocket frames are built as dicts
on the hot path and checked here. Sessions need a real engine process: tests/e2e/ covers them
(test_response_models.py there, and the fuzz test's conformance checks)."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel, TypeAdapter
from starlette.testclient import TestClient

from xlserve.models.tokenizer import ByteTokenizer
from xlserve.server.api.chat import ChatTemplate
from xlserve.server.api.deps import ServedModel
from xlserve.server.api.errors import InvalidRequest
from xlserve.server.api.protocol import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeResponse,
    ErrorFrame,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    ReadyResponse,
    ServerStatus,
    TokenizeResponse,
    VersionResponse,
    server_frame,
)
from xlserve.server.api.serving import error_frame
from xlserve.server.engine.errors import QueueFull, RequestFailed
from xlserve.server.engine.types import ChoiceFinished, Finished, PromptLogprobs, TokenEvent
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings

from tests.server.scripted_engine import ScriptedEngine, scripted_app

MODEL = "m"
CARD = {"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "xlserve", "architecture": "transformer-xl",
        "state_kind": "segment-recurrence", "state_grows_with_context": False, "max_context": None,
        "parameters": 1234, "config": {"d_model": 8, "dropout": 1e-05, "tie_weights": True},
        "quantize": "none", "weight_bytes": 4936,
        "state_bytes_per_session": 9216}
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


@pytest.fixture
def served():
    """(client, engine): the app with one served model, which has a chat template."""
    app, state = scripted_app(Settings(models="none-loaded", max_request_body_bytes=100_000),
                              ScriptedEngine(Metrics()),
                              {MODEL: ServedModel(MODEL, ByteTokenizer(), 256, CARD, ChatTemplate(TEMPLATE, "test"))})
    client = TestClient(app)  # not entered: no lifespan, no engine process
    yield client, state.engine
    client.close()


def fits(model, body) -> None:
    """`body` is exactly an answer of `model`: valid, and nothing in it the model does not know
    or would leave out (what FastAPI sends for a route with this response model)."""
    adapter = TypeAdapter(model)
    assert adapter.dump_python(adapter.validate_python(body), mode="json", exclude_unset=True) == body


def written_by_json_dumps(response) -> dict:
    """The JSON body of `response`, checked to be written as JSONResponse writes it (json.dumps,
    compact, not ASCII-escaped): byte for byte what the routes sent before they had models."""
    body = response.json()
    assert response.content == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    return body


def events(response) -> list[str]:
    """The `data` of each event of an SSE answer."""
    return [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]


def chunks_fit(chunk_model: type[BaseModel], stream: list[str]) -> list[dict]:
    """Every event of `stream` is a chunk of `chunk_model` or the error body, and the last is [DONE];
    returns the chunks."""
    assert stream[-1] == "[DONE]" and "[DONE]" not in stream[:-1]
    chunks = [json.loads(data) for data in stream[:-1]]
    for chunk in chunks:
        fits(ErrorResponse if "error" in chunk else chunk_model, chunk)
    return chunks


def tokens(text: str, logprob: float = -0.5, top=()) -> list[TokenEvent]:
    return [TokenEvent(ord(character), character, logprob, list(top)) for character in text]


def finished(*reasons: str, prompt_tokens: int = 2, completion_tokens: int = 3) -> list:
    ends = [ChoiceFinished(index, reason, "", completion_tokens) for index, reason in enumerate(reasons)]
    return [*ends, Finished(ends, prompt_tokens, completion_tokens * len(reasons), 0, None)]


# -- /openapi.json ---------------------------------------------------------------------------------


def operations(document: dict):
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield f"{method.upper()} {path}", operation


def references(value):
    if isinstance(value, dict):
        if "$ref" in value:
            yield value["$ref"]
        for item in value.values():
            yield from references(item)
    elif isinstance(value, list):
        for item in value:
            yield from references(item)


ERROR_BODY = {"$ref": "#/components/schemas/ErrorResponse"}
PROBE_REFUSAL = {"$ref": "#/components/schemas/ServerStatus"}  # /health and /ready say no with a status body


def test_every_operation_documents_its_answer_and_the_error_body_of_its_errors(served):
    client, _ = served
    document = client.get("/openapi.json").json()
    found = dict(operations(document))
    assert len(found) >= 19, sorted(found)
    for name, operation in found.items():
        answers = operation["responses"]
        ok = answers.get("200", {}).get("content")
        assert ok, f"{name} documents no 200 body"
        for media_type, content in ok.items():
            assert content.get("schema"), f"{name}: 200 {media_type} has no schema"
            schema = content["schema"]
            if media_type == "application/json":
                assert "$ref" in schema, f"{name}: 200 has no model"
        assert answers["default"]["content"] == {"application/json": {"schema": ERROR_BODY}}, name
        errors = {status: answer for status, answer in answers.items() if status[0] in "45"}
        assert errors or name in ("GET /health", "GET /ready", "GET /version"), f"{name} lists no error status"
        for status, answer in errors.items():
            expected = PROBE_REFUSAL if name in ("GET /health", "GET /ready") and status == "503" else ERROR_BODY
            assert answer["content"] == {"application/json": {"schema": expected}}, f"{name} {status}"
            assert answer["description"], f"{name} {status}"
    schemas = document["components"]["schemas"]
    # FastAPI's own 422 body is never sent: invalid requests are 400s with the error body
    assert "HTTPValidationError" not in schemas
    for reference in set(references(document)):
        assert reference.removeprefix("#/components/schemas/") in schemas, reference


def test_the_error_statuses_documented_are_those_each_route_answers(served):
    client, _ = served
    found = dict(operations(client.get("/openapi.json").json()))
    statuses = {name: sorted(int(s) for s in operation["responses"] if s[0] in "45") for name, operation in found.items()}
    assert statuses["POST /v1/completions"] == [400, 401, 404, 409, 413, 422, 429, 500, 503]
    assert statuses["POST /v1/chat/completions"] == [400, 401, 404, 413, 429, 500, 503]  # chat has no session
    assert statuses["POST /v1/sessions/{session_id}/append"] == [400, 401, 404, 409, 413, 422, 429, 500, 503]
    assert statuses["GET /v1/sessions/{session_id}"] == [400, 401, 404, 413, 503]
    assert statuses["GET /metrics"] == [400, 401]  # open while loading and draining; a key only if configured
    assert statuses["GET /ready"] == statuses["GET /health"] == [400, 503]  # 400: any query parameter
    assert statuses["GET /version"] == [400]


def chunk_validator(document: dict, path: str) -> Draft202012Validator:
    """A validator of the JSON in one event of `path`'s stream, as the document describes it."""
    event = document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    return Draft202012Validator(event["properties"]["data"]["else"]["contentSchema"])


def test_streamed_operations_document_their_chunks_as_events(served):
    client, _ = served
    document = client.get("/openapi.json").json()
    for path, chunk in (("/v1/completions", CompletionStreamResponse),
                        ("/v1/chat/completions", ChatCompletionStreamResponse)):
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        data = content["text/event-stream"]["schema"]["properties"]["data"]  # one event (OpenAPI 3.1 has no itemSchema)
        assert data["if"] == {"const": "[DONE]"} and data["else"]["contentMediaType"] == "application/json"
        assert "$ref" not in json.dumps(data)  # written out whole: it reads the same to every tool
        assert [option["title"] for option in data["else"]["contentSchema"]["anyOf"]] == [chunk.__name__,
                                                                                         "ErrorResponse"]
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
             "choices": [{"text": "a", "index": 0, "logprobs": None, "finish_reason": None}]}
    validator = chunk_validator(document, "/v1/completions")
    assert validator.is_valid(chunk)
    assert validator.is_valid({**chunk, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2,
                                                                  "total_tokens": 3}})
    assert validator.is_valid({"error": {"message": "m", "type": "internal_error", "param": None, "code": None}})
    assert not validator.is_valid({**chunk, "surprise": 1})  # an undocumented field is a failure
    assert not validator.is_valid({**chunk, "object": "chat.completion.chunk"})
    assert not validator.is_valid({"error": {"message": "m"}})


# -- /v1/completions and /v1/chat/completions --------------------------------------------------------


def test_a_completion_body_fits_its_model_in_the_order_it_was_built(served):
    client, engine = served
    engine.events = [PromptLogprobs([104, 105], [None, -1.25], [[], [(105, -1.25), (106, -2.5)]]),
                     *tokens("ok", -1e-05, [(111, -1e-05)]), *finished("length")]
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "echo": True,
                                                    "logprobs": 1})
    assert response.status_code == 200
    body = written_by_json_dumps(response)
    fits(CompletionResponse, body)
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]  # no session_id without a session
    (choice,) = body["choices"]
    assert list(choice) == ["text", "index", "finish_reason", "logprobs"]
    assert choice["text"] == "hiok" and choice["logprobs"]["token_logprobs"] == [None, -1.25, -1e-05, -1e-05]
    assert b"-1e-05" in response.content  # numbers written by json.dumps, as before
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_chunks_fit_their_model(served):
    client, engine = served
    engine.events = [*tokens("ab", -0.5, [(97, -0.5)]), TokenEvent(99, "", -0.25, [(99, -0.25)], index=1),
                     *finished("stop", "length")]
    request = {"model": MODEL, "prompt": "x", "max_tokens": 3, "n": 2, "logprobs": 1, "stream": True,
               "stream_options": {"include_usage": True}}
    response = client.post("/v1/completions", json=request)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    chunks = chunks_fit(CompletionStreamResponse, events(response))
    assert all("usage" in chunk for chunk in chunks) and chunks[-1]["choices"] == []
    assert {chunk["choices"][0]["finish_reason"] for chunk in chunks[:-1]} == {None, "stop", "length"}
    # without include_usage no chunk carries `usage`, not even as null
    engine.events = [*tokens("ab"), *finished("length")]
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True, "echo": True})
    chunks = chunks_fit(CompletionStreamResponse, events(response))
    assert chunks[0]["choices"][0]["text"] == "x" and not any("usage" in chunk for chunk in chunks)


def test_an_error_inside_a_stream_is_the_error_body(served):
    client, engine = served
    engine.events = [*tokens("a"), RequestFailed("row failed", code="sampling_failed")]
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    chunks = chunks_fit(CompletionStreamResponse, events(response))
    assert chunks[-1]["error"]["code"] == "sampling_failed"
    response = client.post("/v1/chat/completions", json={"model": MODEL, "stream": True,
                                                         "messages": [{"role": "user", "content": "x"}]})
    assert chunks_fit(ChatCompletionStreamResponse, events(response))[-1]["error"]["code"] == "sampling_failed"


def test_chat_bodies_and_chunks_fit_their_models(served):
    client, engine = served
    messages = [{"role": "user", "content": "hi"}]
    engine.events = [*tokens("yo", -0.5, [(121, -0.5), (122, -3.0)]), *finished("stop")]
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "logprobs": True,
                                                         "top_logprobs": 2})
    body = written_by_json_dumps(response)
    fits(ChatCompletionResponse, body)
    assert list(body["choices"][0]) == ["index", "message", "logprobs", "finish_reason"]
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1] == {"token": "z", "logprob": -3.0,
                                                                               "bytes": [122]}
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "logprobs": True,
                                                         "stream": True, "stream_options": {"include_usage": True}})
    chunks = chunks_fit(ChatCompletionStreamResponse, events(response))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "y"}
    assert chunks[-2]["choices"][0]["delta"] == {} and chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


def test_refusals_are_the_error_body(served):
    client, engine = served
    engine.refuse = QueueFull("the queue is full", code="queue_full")
    for stream in (False, True):
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
        assert response.status_code == 429
        fits(ErrorResponse, written_by_json_dumps(response))
    fits(ErrorResponse, client.post("/v1/completions", json={"model": MODEL, "best_of": 2}).json())


# -- the other routes this stand-in can serve ------------------------------------------------------------


def test_models_tokenize_and_probes_fit_their_models(served):
    client, _ = served
    answers = [
        (ModelList, client.get("/v1/models")),
        (ModelCard, client.get(f"/v1/models/{MODEL}")),
        (TokenizeResponse, client.post("/tokenize", json={"model": MODEL, "prompt": "héllo"})),
        (TokenizeResponse, client.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user",
                                                                                         "content": "x"}]})),
        (DetokenizeResponse, client.post("/detokenize", json={"model": MODEL, "tokens": [104, 195, 169, 255]})),
        (HealthResponse, client.get("/health")),
        (ReadyResponse, client.get("/ready")),
        (VersionResponse, client.get("/version")),
    ]
    for model, response in answers:
        assert response.status_code == 200, response.text
        fits(model, written_by_json_dumps(response))
    # the card as the engine process described it, nothing filtered, and vLLM's name for its context length
    assert answers[1][1].json() == {**CARD, "max_model_len": CARD["max_context"]}
    assert answers[2][1].json() == {"count": 6, "max_model_len": None, "tokens": list("héllo".encode())}
    assert "é" in answers[4][1].text  # not ASCII-escaped, as before


def test_tokenize_and_detokenize_take_what_vllm_s_do(served):
    """vLLM's tokenize and detokenize take no model where the server serves one, and tokenize's
    return_token_strs; /v1/models' cards carry vLLM's max_model_len. Each was a 400 (or missing)."""
    client, _ = served
    answer = client.post("/tokenize", json={"prompt": "hé", "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    fits(TokenizeResponse, written_by_json_dumps(answer))
    assert answer.json() == {"count": 3, "max_model_len": None, "tokens": [104, 195, 169],
                             "token_strs": ["h", "<0xC3>", "<0xA9>"]}
    assert "token_strs" not in client.post("/tokenize", json={"prompt": "hé"}).json()
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    state = client.app.state.xlserve
    state.models = {**state.models, "other": state.models[MODEL]}  # with two, the model must be named
    refused = client.post("/detokenize", json={"tokens": [104]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    assert "other" in refused.json()["error"]["message"]
    assert client.post("/tokenize", json={"model": MODEL, "prompt": "h"}).status_code == 200


def test_a_probe_that_says_no_answers_with_its_status_body(served):
    client, _ = served
    client.app.state.xlserve.draining = True
    response = client.get("/ready")
    assert response.status_code == 503
    fits(ServerStatus, response.json())
    assert response.json() == {"status": "draining", "reason": "the server is shutting down"}


# -- the websocket's frames -----------------------------------------------------------------------------


def test_websocket_frames_fit_server_frame(served):
    client, engine = served
    received = []
    with client.websocket_connect("/v1/stream") as ws:
        engine.events = [*tokens("ab", -0.5, [(97, -0.5)]), *finished("length")]
        ws.send_json({"type": "generate", "id": "r1", "model": MODEL, "prompt": "x", "max_tokens": 2, "logprobs": 1})
        while not received or received[-1]["type"] == "token":
            received.append(ws.receive_json())
        engine.events = [*tokens("a"), RequestFailed("row failed", code="sampling_failed")]
        ws.send_json({"type": "generate", "model": MODEL, "prompt": "x"})
        received += [ws.receive_json(), ws.receive_json()]
        ws.send_text("{not json")
        received.append(ws.receive_json())
    for frame in received:
        assert server_frame.dump_python(server_frame.validate_python(frame), mode="json", exclude_unset=True) == frame
    assert [frame["type"] for frame in received] == ["token", "token", "done", "token", "error", "error"]
    assert received[0]["top_logprobs"] == {"a": -0.5} and received[2]["usage"]["completion_tokens"] == 3


def test_an_error_frame_with_retry_after_fits():
    frame = error_frame("r1", QueueFull("the queue is full", code="queue_full"))
    assert frame["retry_after"] == 1
    fits(ErrorFrame, frame)
    fits(ErrorFrame, error_frame(None, InvalidRequest("no", param="prompt")))


def test_the_openapi_document_describes_the_api_key(served):
    """The routes take the key through a plain dependency, which FastAPI does not describe:
    /openapi.json had no security scheme, so /docs had no Authorize button and every try of a
    route on a server with keys was a 401."""
    client, _ = served
    document = client.get("/openapi.json").json()
    assert document["components"]["securitySchemes"]["apiKey"] == {
        "type": "http", "scheme": "bearer",
        "description": "one of the server's API keys (XLSERVE_API_KEYS); a server without keys takes any or none"}
    secured = {(path, method) for path, operations in document["paths"].items()
               for method, operation in operations.items() if operation.get("security") == [{"apiKey": []}]}
    assert {("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"), ("/tokenize", "post"),
            ("/v1/sessions/{session_id}/append", "post"), ("/v1/sessions/import", "post")} <= secured
    assert not {(path, method) for path, method in secured if path in ("/health", "/ready", "/version", "/metrics")}
    # /metrics asks for the key in its body, when the server is told to
    from xlserve.server.app import build_app

    keyed = build_app(Settings(models="none-loaded", metrics_require_key=True)).openapi()
    assert keyed["paths"]["/metrics"]["get"]["security"] == [{"apiKey": []}]
