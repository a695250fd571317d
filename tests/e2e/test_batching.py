"""Batching correctness over real HTTP: the same greedy request gives identical text alone and
inside a batch of 16 sessions whose memories have different lengths."""

from __future__ import annotations

from tests.e2e.session_tools import decode_together_as_alone

MODEL = "txl-tiny"
DOCUMENT = "import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n    return 0\n\n" * 4


def test_greedy_text_is_identical_alone_and_in_a_batch_of_16(server, client):
    lengths = [1, 3, 7, 12, 20, 31, 32, 33, 45, 64, 90, 128, 150, 200, 270, 350]  # around mem_len 32
    prompts = [f"def f{i}(" for i in range(16)]
    body = dict(model=MODEL, max_tokens=48, temperature=0)

    # the 16 generate at once (fresh forks, again while no step ran with more than 8 rows: on a
    # loaded machine the threads may not reach the engine together), each giving its text alone,
    # and they really shared steps: some decode steps ran with more than 8 rows
    alone = decode_together_as_alone(server, client, MODEL, [DOCUMENT[:length] for length in lengths], prompts,
                                     max_tokens=body["max_tokens"], more_than=8)

    # and a session continuation equals one request over history + prompt
    for i in (0, 9, 15):
        one_pass = client.post("/v1/completions", json={**body, "prompt": DOCUMENT[: lengths[i]] + prompts[i]})
        assert one_pass.json()["choices"][0]["text"] == alone[i]
