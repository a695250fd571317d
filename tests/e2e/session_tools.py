"""Helpers for the session end-to-end tests (HTTP only: the test process runs no model)."""

from __future__ import annotations

import json
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODEL = "txl-tiny"
CONTINUATION = "\n\ndef tail(values):\n    return sorted(values)[-1]\n"


def document(i: int, repeat: int = 3) -> str:
    """A distinct Python-looking document of a few hundred bytes (longer than mem_len)."""
    return f"import module_{i}\n\nclass Thing{i}:\n    def run(self, n={i}):\n        return n * {i + 2}\n\n" * repeat


def full_state_bytes(checkpoint: Path) -> int:
    """Bytes of a Transformer-XL session whose memory is full: keys and values (float32) of
    mem_len positions per layer, the bool `valid` row, and the next-token log-probs."""
    c = json.loads((checkpoint / "config.json").read_text())["config"]
    return 2 * c["n_layer"] * c["mem_len"] * c["n_head"] * c["d_head"] * 4 + c["mem_len"] + c["vocab_size"] * 4


def ok(response):
    assert response.status_code == 200, response.text
    return response.json()


def create(client, model: str = MODEL) -> str:
    return ok(client.post("/v1/sessions", json={"model": model}))["id"]


def append(client, session_id: str, text: str, score: bool = False) -> dict:
    return ok(client.post(f"/v1/sessions/{session_id}/append", json={"text": text, "score": score}))


def info(client, session_id: str) -> dict:
    return ok(client.get(f"/v1/sessions/{session_id}"))


def score(client, session_id: str, text: str = CONTINUATION, model: str = MODEL) -> list[float]:
    """Per-token log-probs of `text` continuing the session (committed into it)."""
    body = ok(client.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 0, "echo": True,
                                                    "logprobs": 0, "session_id": session_id}))
    return body["choices"][0]["logprobs"]["token_logprobs"]


def wait_idle(client, session_id: str, timeout: float = 30) -> dict:
    """Poll until no request holds the session (a cancelled stream lets go within a step)."""
    deadline = time.monotonic() + timeout
    while True:
        current = info(client, session_id)
        if not current["in_use"]:
            return current
        assert time.monotonic() < deadline, f"session {session_id} still in use after {timeout}s"
        time.sleep(0.05)


def safetensors_metadata(blob: bytes) -> dict:
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length])["__metadata__"]


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        inside = line[len(name) + 1 : line.index("}")]
        if ",".join(sorted(inside.split(","))) == wanted:
            return float(line.split()[-1])
    return 0.0


def metric_total(text: str, name: str, **labels) -> float:
    """The sum of the samples of `name` whose labels include `labels`, whatever their other labels
    (xlserve_request_errors_total{type="internal_error"} over every model and code)."""
    wanted = {f'{key}="{value}"' for key, value in labels.items()}
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and wanted <= set(line[len(name) + 1 : line.index("}")].split(",")):
            total += float(line.split()[-1])
    return total


def histogram(text: str, name: str, **labels) -> dict[str, float]:
    """le -> cumulative count of the Prometheus histogram `name` with `labels` (empty when absent)."""
    buckets = {}
    for line in text.splitlines():
        if not line.startswith(name + "_bucket{"):
            continue
        inside = dict(pair.split("=", 1) for pair in line[len(name) + 8 : line.index("}")].split(","))
        le = inside.pop("le").strip('"')
        if {k: v.strip('"') for k, v in inside.items()} == {k: str(v) for k, v in labels.items()}:
            buckets[le] = float(line.split()[-1])
    return buckets


def race_generate_against_append(generating, appending, session_id: str, text: str, max_tokens: int = 4000) -> dict:
    """`generating` streams a completion on the session while `appending` appends `text` to it,
    both from the same version: whoever commits second must be refused with a version conflict,
    and only the winner's tokens count. Returns the session's info after the race (as
    `generating` sees it), having checked that exactly one was refused and what the winner
    left.

    The append must land while the stream runs (one that comes after its commit starts from the
    new version and wins too): `max_tokens` is long enough that the stream runs for seconds
    (about 3 s on two idle cores), past a loaded machine's stalls."""
    before = info(generating, session_id)
    with generating.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": max_tokens,
                                                            "temperature": 0, "stream": True,
                                                            "session_id": session_id}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        on_append = appending.post(f"/v1/sessions/{session_id}/append", json={"text": text})
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    stream_error = next((e["error"] for e in events if "error" in e), None)
    refused = [stream_error] if stream_error else []
    if on_append.status_code != 200:
        refused.append(on_append.json()["error"])
    assert len(refused) == 1, (on_append.text, stream_error)
    assert refused[0]["type"] == "conflict" and refused[0]["code"] == "session_version_conflict"
    final = info(generating, session_id)
    assert final["version"] == before["version"] + 1 == info(appending, session_id)["version"]
    winner_tokens = before["tokens"] + (len(text) if on_append.status_code == 200 else 1 + max_tokens)
    assert final["tokens"] == winner_tokens  # the refused request left no trace
    return final


def greedy(client, model: str, session: str, prompt: str, max_tokens: int = 24) -> str:
    body = ok(client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0, "session_id": session}))
    assert body["usage"]["completion_tokens"] == max_tokens
    return body["choices"][0]["text"]


def fork(client, session: str) -> str:
    return ok(client.post(f"/v1/sessions/{session}/fork"))["id"]


def decode_steps_with_rows(client, model: str, more_than: int = 1) -> float:
    """Decode steps of `model` that ran with more than `more_than` rows, so far."""
    buckets = histogram(client.get("/metrics").text, "xlserve_batch_size", model=model)
    return buckets["+Inf"] - buckets[f"{float(more_than)}"]


def decode_together_as_alone(server, client, model: str, histories: list[str], prompts: list[str],
                             max_tokens: int, attempts: int = 4, more_than: int = 1) -> list[str]:
    """Sessions with `histories` generate `prompts` at once (one thread and connection each):
    greedy gives each the text it gets alone, and the engine ran steps with more than
    `more_than` rows (one: some rows shared a step). Returns the texts alone.

    Starting at once is up to the machine: on a loaded one (CI's two cores, another test worker)
    one request can finish its few tokens before the other is admitted. So the race is run again
    from fresh forks, at most `attempts` times, until one run had a step that big; every run must
    give each row its text alone, shared or not."""
    sources = []
    for history in histories:
        sources.append(create(client, model))
        append(client, sources[-1], history)
    alone = [greedy(client, model, fork(client, s), p, max_tokens=max_tokens) for s, p in zip(sources, prompts)]
    for attempt in range(attempts):
        together_sessions = [fork(client, s) for s in sources]
        before = decode_steps_with_rows(client, model, more_than)
        start = threading.Barrier(len(sources))

        def run(i: int) -> str:
            with server.client() as own:
                start.wait(timeout=30)
                return greedy(own, model, together_sessions[i], prompts[i], max_tokens=max_tokens)

        with ThreadPoolExecutor(len(sources)) as pool:
            together = list(pool.map(run, range(len(sources))))
        assert together == alone, f"attempt {attempt + 1}"
        if decode_steps_with_rows(client, model, more_than) > before:
            return alone
    raise AssertionError(f"no decode step ran with more than {more_than} rows in {attempts} attempts")
