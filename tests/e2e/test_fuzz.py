"""A bounded fuzz run against a real server: no request, valid or not, gets a 5xx, every error
is the one error body, and every answer is what /openapi.json says it is.

HTTP: schemathesis reads the server's own /openapi.json and Hypothesis draws requests for every
operation, ones that fit the schema and ones that break it, with a real model name and live
session ids substituted in most of the time (so that requests get past "no such model" into
the code behind it). Each answer is checked against the document (schemathesis's
response_schema_conformance and content_type_conformance: the body of its status, every SSE
chunk of a stream), and its status must be one the operation lists, not only its "default".
Drawn requests seldom get as far as a stream, so a few streamed ones are sent as written and
their chunks checked the same way.
The websocket is not in the OpenAPI document: Hypothesis draws frames for it directly, on one
connection that must stay usable, and every frame it answers must fit protocol.ServerFrame.

The server serves Transformer-XL, a chat copy of it, and a Reformer of 8 positions (its
max_context), which the drawn requests and frames name too. Few requests drawn from the schema
get past validation to the Reformer's limit, so Hypothesis also draws plausible completions and
appends for it, alone and on a session that fills up: each one past the limit must get 400
context_length_exceeded (and none within it), never a 5xx, and both kinds must occur.

The budget is fixed (FUZZ_EXAMPLES examples per operation and kind, derandomized, so a run is
repeatable); `make test` runs the small default, `make fuzz` a larger one. The server runs with
small limits (XLSERVE_MAX_TOKENS_LIMIT, XLSERVE_MAX_PROMPT_BYTES) so that every valid request is
quick. The test process runs no model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st
from pydantic import ValidationError
from schemathesis import GenerationMode
from schemathesis.checks import content_type_conformance, response_schema_conformance
from schemathesis.core.failures import FailureGroup
from websockets.sync.client import connect

from tests.e2e.server_process import ServerProcess, make_checkpoint
from xlserve.server.api.protocol import server_frame

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "30"))  # per operation and generation mode
FRAMES = int(os.environ.get("FUZZ_FRAMES", str(EXAMPLES * 8)))  # websocket frames
REFORMER = "reformer-tiny"
REFORMER_AXIAL_SHAPE = [2, 4]  # max_context 8: short enough that drawn prompts (mostly a few characters) reach it
REFORMER_LIMIT = math.prod(REFORMER_AXIAL_SHAPE)
MODELS = ("txl-tiny", "chat-tiny", REFORMER)
ERROR_FIELDS = {"message", "type", "param", "code"}
CONFORMANCE = [response_schema_conformance, content_type_conformance]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def fuzz_server(tiny_checkpoint, tmp_path_factory):
    chat = shutil.copytree(tiny_checkpoint, tmp_path_factory.mktemp("fuzz-weights") / "chat-tiny")
    (chat / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    reformer = make_checkpoint(tmp_path_factory.mktemp("fuzz-weights") / REFORMER, arch="reformer",
                               config={"axial_pos_shape": REFORMER_AXIAL_SHAPE})
    process = ServerProcess([tiny_checkpoint, chat, reformer],
                            env={"XLSERVE_MAX_TOKENS_LIMIT": "16", "XLSERVE_MAX_PROMPT_BYTES": "2048"},
                            log_path=tmp_path_factory.mktemp("logs") / "fuzz.log").start()
    yield process
    process.stop()


def error_body_problem(body) -> str | None:
    """What is wrong with an error body, or None when it is {"error": {message, type, param, code}}."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(body) != {"error"} or set(error) != ERROR_FIELDS:
        return f"not the error schema: {body!r:.300}"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return f"error without message or type: {error!r:.300}"
    if not all(error[name] is None or isinstance(error[name], str) for name in ("param", "code")):
        return f"param and code must be strings or null: {error!r:.300}"
    if error["type"] == "internal_error":
        return f"internal error: {error['message']}"
    return None


def response_problem(status: int, content_type: str, text: str) -> str | None:
    """What is wrong with an answer: a 5xx, an error that is not the error body, or an internal
    error sent inside an event stream."""
    if status >= 500:
        return f"status {status}: {text[:300]}"
    if status >= 400:
        try:
            return error_body_problem(json.loads(text))
        except ValueError:
            return f"status {status} without a JSON error body: {text[:300]}"
    if content_type.startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                problem = error_body_problem(json.loads(line[len("data: "):]))
                if problem:
                    return f"in the stream: {problem}"
    return None


class LiveSessions:
    """A few sessions that exist, for path parameters (one of the Reformer's, whose appends reach
    its limit); one that a fuzzed DELETE removed is replaced by one of the same model."""

    def __init__(self, url: str, models: tuple[str, ...] = (MODELS[0], MODELS[0], REFORMER)):
        self.url = url
        self.models = list(models)
        self.ids = [self._create(model) for model in self.models]

    def _create(self, model: str) -> str:
        response = httpx.post(self.url + "/v1/sessions", json={"model": model}, timeout=30)
        response.raise_for_status()
        return response.json()["id"]

    def deleted(self, session_id: str) -> None:
        if session_id in self.ids:
            index = self.ids.index(session_id)
            self.ids[index] = self._create(self.models[index])


def substitute(case, data, sessions: LiveSessions) -> None:
    """Most of the time, a real model name and a live session id where the drawn request names one."""
    real = st.integers(0, 4).map(lambda roll: roll > 0)  # four in five
    if isinstance(case.body, dict) and "model" in case.body and data.draw(real):
        case.body["model"] = data.draw(st.sampled_from(MODELS))
    for name in ("session_id", "name"):
        if case.path_parameters and name in case.path_parameters and data.draw(real):
            case.path_parameters[name] = data.draw(st.sampled_from(sessions.ids if name == "session_id" else MODELS))
    if case.query and "model" in case.query and data.draw(real):
        case.query["model"] = data.draw(st.sampled_from(MODELS))


def error_code(text: str) -> str | None:
    """The code of an error body, or None."""
    try:
        return json.loads(text)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def fuzz_operation(operation, mode: GenerationMode, base_url: str, sessions: LiveSessions,
                   statuses: Counter, codes: Counter, failures: list[str], documented: dict) -> None:
    """Fuzz one operation; `documented` is its entry in /openapi.json; `codes` counts the codes
    of the 4xx answers."""
    http_session = requests.Session()
    listed = set(documented["responses"]) - {"default"}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    def run(case, data):
        substitute(case, data, sessions)
        try:
            response = case.call(base_url=base_url, session=http_session, timeout=60)
        except (requests.exceptions.InvalidHeader, requests.exceptions.InvalidURL, UnicodeError, ValueError):
            statuses["not sendable"] += 1  # a header or URL the client library itself refuses to send
            return
        statuses[response.status_code] += 1
        content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis: name -> values
        text = response.content.decode("utf-8", "replace")
        if 400 <= response.status_code < 500:
            codes[error_code(text)] += 1
        problem = response_problem(response.status_code, content_type, text)
        if problem is None and str(response.status_code) not in listed:
            problem = f"status {response.status_code} is not among those documented ({sorted(listed)})"
        if problem is None:
            try:
                case.validate_response(response, checks=CONFORMANCE)
            except FailureGroup as failed:
                problem = f"the answer does not fit /openapi.json: {failed}"
        if problem:
            failures.append(f"{case.method} {case.formatted_path} ({mode.value}) body={case.body!r:.300}: "
                            f"{problem:.1500}")
        if case.method == "DELETE" and response.status_code == 200:
            sessions.deleted(case.path_parameters.get("session_id"))

    try:
        run()
    except Unsatisfiable:  # nothing to break: an operation without parameters or body has no invalid form
        assert mode is GenerationMode.NEGATIVE


def test_fuzzed_http_requests_get_no_5xx_only_the_error_body_and_documented_answers(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    document = httpx.get(fuzz_server.url + "/openapi.json", timeout=10).json()
    sessions = LiveSessions(fuzz_server.url)
    statuses: Counter = Counter()
    codes: Counter = Counter()
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15, [op.label for op in operations]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz_operation(operation, mode, fuzz_server.url, sessions, statuses, codes, failures,
                           document["paths"][operation.path][operation.method.lower()])
    cases = sum(statuses.values())
    print(f"\nfuzzed {cases} HTTP requests over {len(operations)} operations; statuses: {dict(statuses)}; "
          f"4xx codes: {dict(codes)}")
    assert not failures, "\n".join(failures[:20])
    assert cases >= len(operations) * EXAMPLES  # the budget was spent on real requests
    assert httpx.get(fuzz_server.url + "/ready", timeout=10).status_code == 200


# -- the Reformer's limit: plausible requests, drawn ------------------------------------------------------

PROMPTS = st.text(max_size=8) | st.lists(st.integers(0, 255), max_size=12)
LIMIT_REQUESTS = st.one_of(
    st.tuples(st.just("completion"), PROMPTS, st.integers(0, 8)),
    st.tuples(st.just("session completion"), PROMPTS, st.integers(0, 8)),
    st.tuples(st.just("append"), PROMPTS.filter(len), st.just(0)),
)


def ok_json(response: httpx.Response) -> dict:
    response.raise_for_status()
    return response.json()


def prompt_length(prompt: str | list[int]) -> int:
    return len(prompt.encode("utf-8")) if isinstance(prompt, str) else len(prompt)


def test_drawn_requests_past_the_reformers_limit_get_400_context_length_exceeded(fuzz_server):
    client = httpx.Client(base_url=fuzz_server.url, timeout=60)
    outcomes: Counter = Counter()
    failures: list[str] = []

    def new_session() -> str:
        return ok_json(client.post("/v1/sessions", json={"model": REFORMER}))["id"]

    session = {"id": new_session()}

    @settings(max_examples=EXAMPLES * 2, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(request=LIMIT_REQUESTS)
    def run(request):
        kind, prompt, max_tokens = request
        history = 0 if kind == "completion" else ok_json(client.get(f"/v1/sessions/{session['id']}"))["tokens"]
        reach = history + prompt_length(prompt) + (kind != "append" and max_tokens > 0)
        if kind == "append":
            response = client.post(f"/v1/sessions/{session['id']}/append", json={"text": prompt})
        else:
            body = {"model": REFORMER, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            if kind == "session completion":
                body["session_id"] = session["id"]
            response = client.post("/v1/completions", json=body)
        problem = response_problem(response.status_code, response.headers.get("content-type", ""), response.text)
        code = error_code(response.text) if response.status_code >= 400 else None
        if problem is None and (reach > REFORMER_LIMIT) != (code == "context_length_exceeded"):
            problem = f"reach {reach} of {REFORMER_LIMIT}: status {response.status_code}, code {code}"
        if problem:
            failures.append(f"{kind} {prompt!r} max_tokens={max_tokens} on {history}: {problem}")
        outcomes["past the limit" if code == "context_length_exceeded" else response.status_code] += 1
        if history + prompt_length(prompt) >= REFORMER_LIMIT:  # full, or nearly: start the session again
            session["id"] = new_session()

    try:
        run()
    finally:
        client.close()
    print(f"\ndrew {sum(outcomes.values())} requests for the Reformer's limit: {dict(outcomes)}")
    assert not failures, "\n".join(failures[:20])
    assert outcomes["past the limit"] > 0 and outcomes[200] > 0


# requests whose answers are event streams, which drawn requests seldom get as far as; each of
# fewer than 20 events, schemathesis's default limit on the events it reads of a stream
STREAMED = [
    ("/v1/completions", {"model": MODELS[0], "prompt": "def f(", "max_tokens": 4, "n": 2, "stream": True}),
    ("/v1/completions", {"model": MODELS[0], "prompt": ["a", "b"], "max_tokens": 3, "logprobs": 2, "echo": True,
                         "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": MODELS[1], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "logprobs": True, "top_logprobs": 1, "stream": True,
                              "stream_options": {"include_usage": True}}),
]


def test_streamed_answers_fit_the_document(fuzz_server):
    """Every chunk of a stream is checked against the event schema /openapi.json gives it."""
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    for path, body in STREAMED:
        case = schema[path]["POST"].Case(body=body, media_type="application/json")
        response = case.call(base_url=fuzz_server.url, session=requests.Session(), timeout=60)
        assert response.status_code == 200 and response.content.endswith(b"data: [DONE]\n\n"), response.content[:300]
        assert response.content.count(b"data: {") >= 2
        case.validate_response(response, checks=CONFORMANCE)


# -- the websocket --------------------------------------------------------------------------------------

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                | st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELD_VALUES = {
    "model": st.sampled_from(MODELS) | JSON_VALUES,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-2, 300), max_size=8) | JSON_VALUES,
    "max_tokens": st.integers(-2, 20) | JSON_VALUES,
    "temperature": st.floats(-1, 3) | JSON_VALUES,
    "top_p": st.floats(-1, 2) | JSON_VALUES,
    "seed": st.integers(-5, 2**65) | JSON_VALUES,
    "logit_bias": st.dictionaries(st.integers(0, 400).map(str), st.floats(-150, 150), max_size=3) | JSON_VALUES,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=5) | JSON_VALUES,
    "session_id": st.sampled_from(["sess_missing"]) | JSON_VALUES,
    "text": st.text(max_size=40) | JSON_VALUES,
    "id": st.text(max_size=10) | JSON_VALUES,
    "logprobs": st.integers(-1, 25) | JSON_VALUES,
    "unknown": JSON_VALUES,
}
PLAUSIBLE = {  # values of the right type, mostly within range: requests that run
    "max_tokens": st.integers(0, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 300),
    "seed": st.integers(0, 2**64 - 1),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100), max_size=3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
    "logprobs": st.integers(0, 5),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
}
FRAME_STRATEGY = st.one_of(
    st.builds(lambda model, prompt, fields: {"type": "generate", "model": model, "prompt": prompt, **fields},
              st.sampled_from(MODELS), st.text(min_size=1, max_size=30),
              st.fixed_dictionaries({}, optional=PLAUSIBLE)).map(json.dumps),
    st.builds(lambda kind, fields: {"type": kind, **fields},
              st.sampled_from(["generate", "append", "cancel", "dance"]) | JSON_VALUES,
              st.fixed_dictionaries({}, optional=FIELD_VALUES)).map(json.dumps),
    JSON_VALUES.map(json.dumps),
    st.text(max_size=60),  # mostly not JSON
)


def test_fuzzed_websocket_frames_get_answers_and_the_connection_stays_usable(fuzz_server):
    url = fuzz_server.url.replace("http://", "ws://") + "/v1/stream"
    kinds: Counter = Counter()
    codes: Counter = Counter()
    failures: list[str] = []
    with connect(url, max_size=None) as ws:

        @settings(max_examples=FRAMES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        @given(frame=FRAME_STRATEGY)
        def run(frame):
            ws.send(frame)
            while True:  # the frames of its answer: token frames, then one done or error frame
                answer = json.loads(ws.recv(timeout=60))
                try:
                    server_frame.validate_python(answer)
                except ValidationError as error:
                    failures.append(f"{frame[:300]}: the frame {answer!r:.300} does not fit ServerFrame: {error}")
                if answer["type"] == "token":
                    continue
                kinds[answer["type"]] += 1
                if answer["type"] == "error":
                    codes[answer["error"].get("code")] += 1
                    problem = error_body_problem({"error": answer["error"]})
                    if problem:
                        failures.append(f"{frame[:300]}: {problem}")
                elif answer["type"] != "done":
                    failures.append(f"{frame[:300]}: unexpected frame {answer!r:.300}")
                return

        run()
        ws.send(json.dumps({"type": "generate", "model": MODELS[0], "prompt": "ok", "max_tokens": 1}))
        assert json.loads(ws.recv(timeout=60))["type"] in ("token", "done")
    print(f"\nfuzzed {sum(kinds.values())} websocket frames; answers: {dict(kinds)}; error codes: {dict(codes)}")
    assert not failures, "\n".join(failures[:20])
    assert codes["context_length_exceeded"] > 0  # drawn frames reached the Reformer's limit, and got the error
