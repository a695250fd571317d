"""Fair prefill over HTTP, against a real server with two API keys, judged by the order in which
first tokens arrive (never by a time):

- a 10-byte completion sent while long prompts prefill gets its first token before any of them;
- prefill is shared among API keys first: key B's one long prompt, sent beside key A's three of
  the same length, gets its first token before all of A's (it has half of every step's budget,
  each of A's a sixth), where round robin by request would have served all four together.

Chunks of CHUNK tokens make each long prompt thousands of engine steps. The scheduler's own
tests (tests/server/test_engine_fairness.py) check the shares exactly;
`xlserve bench fairness` measures the times.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.e2e.server_process import ServerProcess

MODEL = "txl-tiny"
CHUNK = 16
KEYS = ("key-a", "key-b")
LONG = "".join(f"row {i}: lorem ipsum dolor sit amet\n" for i in range(320))  # ~10 KB


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess([tiny_checkpoint], env={"XLSERVE_PREFILL_CHUNK_TOKENS": str(CHUNK),
                                                    "XLSERVE_API_KEYS": ",".join(KEYS)},
                            log_path=tmp_path_factory.mktemp("logs") / "fairness.log").start()
    yield process
    process.stop()


class FirstToken(threading.Thread):
    """A streamed completion for one token; `arrived` is when its first token came (monotonic)."""

    def __init__(self, server, key: str, prompt: str):
        super().__init__(daemon=True)
        self.server, self.key, self.prompt = server, key, prompt
        self.arrived: float | None = None
        self.error: str | None = None

    def run(self) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": 1, "temperature": 0, "stream": True,
                "prefix_cache": False}
        headers = {"Authorization": f"Bearer {self.key}"}
        try:
            with self.server.client(headers=headers) as client, \
                    client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    self.error = f"{response.status_code}: {response.read()[:200]!r}"
                    return
                for line in response.iter_lines():  # read to the end: the answer is one token
                    if self.arrived is None and line.startswith("data: ") and '"text"' in line:
                        self.arrived = time.monotonic()
        except Exception as error:  # reported by the test
            self.error = repr(error)


def run_all(requests: list[FirstToken]) -> None:
    for request in requests:
        if request.ident is None:  # not started yet
            request.start()
    for request in requests:
        request.join(timeout=120)
    for request in requests:
        assert request.error is None and request.arrived is not None, request.error


def test_a_short_prompt_is_served_before_long_ones_that_are_prefilling(keyed):
    longs = [FirstToken(keyed, "key-a", f"{index} {LONG}") for index in range(2)]
    short = FirstToken(keyed, "key-b", "0123456789")
    for request in longs:
        request.start()
    time.sleep(0.5)  # the long prompts are prefilling
    run_all([short])
    run_all(longs)
    assert short.arrived < min(request.arrived for request in longs)


def test_prefill_is_shared_among_api_keys_before_requests(keyed):
    owner_a = [FirstToken(keyed, "key-a", f"{index} {LONG}") for index in range(3)]
    owner_b = FirstToken(keyed, "key-b", f"b {LONG}")
    run_all([*owner_a, owner_b])
    assert owner_b.arrived < min(request.arrived for request in owner_a)
