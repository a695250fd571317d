"""Batching correctness over real HTTP: the same greedy request gives identical text alone and
inside a batch of 16 sessions whose memories have different lengths."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from tests.e2e.session_tools import histogram as read_histogram

MODEL = "txl-tiny"
DOCUMENT = "import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n    return 0\n\n" * 4


def histogram(client, name: str) -> dict[str, float]:
    """le -> cumulative count for the model's histogram `name`."""
    return read_histogram(client.get("/metrics").text, name, model=MODEL)


def sessions_with_history(client, lengths: list[int]) -> list[str]:
    ids = []
    for length in lengths:
        session = client.post("/v1/sessions", json={"model": MODEL}).json()["id"]
        response = client.post(f"/v1/sessions/{session}/append", json={"text": DOCUMENT[:length]})
        assert response.status_code == 200, response.text
        ids.append(session)
    return ids


def test_greedy_text_is_identical_alone_and_in_a_batch_of_16(server, client):
    lengths = [1, 3, 7, 12, 20, 31, 32, 33, 45, 64, 90, 128, 150, 200, 270, 350]  # around mem_len 32
    prompts = [f"def f{i}(" for i in range(16)]
    body = dict(model=MODEL, max_tokens=48, temperature=0)

    alone_sessions = sessions_with_history(client, lengths)
    alone = []
    for session, prompt in zip(alone_sessions, prompts):
        response = client.post("/v1/completions", json={**body, "prompt": prompt, "session_id": session})
        alone.append(response.json()["choices"][0]["text"])

    batch_sessions = sessions_with_history(client, lengths)
    before = histogram(client, "xlserve_batch_size")
    start = threading.Barrier(16)

    def request(i: int) -> str:
        with server.client() as own:
            start.wait(timeout=30)
            response = own.post("/v1/completions", json={**body, "prompt": prompts[i], "session_id": batch_sessions[i]})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(16) as pool:
        batched = list(pool.map(request, range(16)))
    after = histogram(client, "xlserve_batch_size")

    assert batched == alone
    # they really shared steps: some decode steps ran with more than 8 rows
    big_steps = lambda h: h["+Inf"] - h["8.0"]  # noqa: E731
    assert big_steps(after) > big_steps(before)

    # and a session continuation equals one request over history + prompt
    for i in (0, 9, 15):
        one_pass = client.post("/v1/completions", json={**body, "prompt": DOCUMENT[: lengths[i]] + prompts[i]})
        assert one_pass.json()["choices"][0]["text"] == alone[i]
