"""Reuse without sessions, through a real server and the unmodified `openai` client: a stateless
five-turn conversation is served from the prefix cache from turn 2 on, its answers and echoed
log-probs are those of a freshly started server, and cached states stay within their API key
and cache_salt."""

from __future__ import annotations

import time

import pytest
from openai import OpenAI

from tests.e2e.server_process import ServerProcess
from tests.e2e.session_tools import metric
from tests.redis_server import redis_url  # noqa: F401  (fixture)

MODEL = "txl-tiny"
KEYS = ("key-a", "key-b")
MESSAGES = ["import os\nimport sys\n\n", "def main(argv):\n", "    return 0\n\n", "class A:\n    pass\n",
            "if __name__ == '__main__':\n"]


@pytest.fixture(scope="module")
def keyed_server(tiny_checkpoint):
    server = ServerProcess([tiny_checkpoint], env={"XLSERVE_API_KEYS": ",".join(KEYS)}).start()
    yield server
    server.stop()


def client(server, key: str = KEYS[0]) -> OpenAI:
    return server.openai_client(api_key=key, timeout=60)


def cached(result) -> int:
    return result.usage.prompt_tokens_details.cached_tokens


def echo_logprobs(oai: OpenAI, prompt: str, **extra) -> tuple[list, int]:
    result = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0, **extra)
    return result.choices[0].logprobs.token_logprobs, cached(result)


def test_a_stateless_conversation_is_served_from_the_prefix_cache(keyed_server, tiny_checkpoint):
    prompt, answers = "", []
    with client(keyed_server) as oai:
        for turn, message in enumerate(MESSAGES):
            prompt += message
            result = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
            answers.append(result.choices[0].text)
            if turn == 0:
                assert cached(result) == 0
            else:  # the previous turn's prompt + completion is exactly what this one resends first
                assert cached(result) == len(prompt.encode()) - len(message.encode()), turn
            prompt += result.choices[0].text
        final = prompt
        hot, hot_cached = echo_logprobs(oai, final)
    assert hot_cached == len(final.encode())  # the last answer's state was offered too

    fresh = ServerProcess([tiny_checkpoint], env={"XLSERVE_API_KEYS": ",".join(KEYS)}).start()
    try:
        with client(fresh) as oai:
            cold, cold_cached = echo_logprobs(oai, final)
            replayed, prompt = [], ""
            for message in MESSAGES:  # the same conversation, every turn cold
                prompt += message
                text = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                              extra_body={"prefix_cache": False}).choices[0].text
                replayed.append(text)
                prompt += text
    finally:
        fresh.stop()
    assert cold_cached == 0
    assert hot[0] is None and cold[0] is None
    assert hot[1:] == pytest.approx(cold[1:], abs=1e-5)
    assert answers == replayed


def test_cached_states_stay_within_their_api_key_and_salt(keyed_server):
    prompt = "def helper(value):\n    return value * 2\n"
    with client(keyed_server, KEYS[0]) as oai:
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        _, again = echo_logprobs(oai, prompt)
        _, salted = echo_logprobs(oai, prompt, extra_body={"cache_salt": "tenant-7"})
        _, salted_again = echo_logprobs(oai, prompt, extra_body={"cache_salt": "tenant-7"})
        _, opted_out = echo_logprobs(oai, prompt, extra_body={"prefix_cache": False})
    with client(keyed_server, KEYS[1]) as oai:
        _, other_key = echo_logprobs(oai, prompt)
    assert again == len(prompt.encode())
    assert salted == 0 and salted_again == len(prompt.encode())
    assert opted_out == 0
    assert other_key == 0


def test_prefix_cache_metrics(keyed_server):
    with client(keyed_server) as oai:
        for _ in range(2):
            oai.completions.create(model=MODEL, prompt="for i in range(3):\n", max_tokens=2, temperature=0)
    with keyed_server.client() as http:
        text = http.get("/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    assert metric(text, "xlserve_prefix_cache_queries_total", model=MODEL) > 0
    assert metric(text, "xlserve_prefix_cache_hits_total", model=MODEL) > 0
    assert metric(text, "xlserve_prefix_cache_entries", model=MODEL, tier="device") >= 1
    assert metric(text, "xlserve_prefix_cache_bytes", model=MODEL, tier="device") > 0


def test_replicas_sharing_redis_hit_on_each_others_prefixes(tiny_checkpoint, tmp_path_factory, redis_url):  # noqa: F811
    """A prefix stored by replica A is a hit on replica B (through a real redis-server), with the
    log-probs A computed cold; another API key gets no hit on it, on either replica."""
    env = {"XLSERVE_API_KEYS": ",".join(KEYS), "XLSERVE_REDIS_URL": redis_url}
    servers = [ServerProcess([tiny_checkpoint], env={**env, "XLSERVE_STATE_DIR": str(tmp_path_factory.mktemp(name))})
               for name in "ab"]
    prompt = "import json\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n"
    try:
        for server in servers:
            server.start()
        a, b = servers
        with client(a) as oai:
            cold, cold_cached = echo_logprobs(oai, prompt)
        deadline = time.monotonic() + 10  # A's writer thread puts the entry in Redis after answering
        while True:
            with client(b) as oai:
                warm, warm_cached = echo_logprobs(oai, prompt)
            if warm_cached or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # another key, on either replica: nothing of key A's prompt (each asks a longer prompt of
        # its own, so that key B's own entry on one replica is no prefix of its prompt on the other)
        with client(b, KEYS[1]) as oai:
            _, other_key_on_b = echo_logprobs(oai, prompt + "x")
        with client(a, KEYS[1]) as oai:
            _, other_key_on_a = echo_logprobs(oai, prompt + "y")
    finally:
        for server in servers:
            server.stop()
    assert cold_cached == 0 and warm_cached == len(prompt.encode())
    assert warm[1:] == pytest.approx(cold[1:], abs=1e-6)
    assert other_key_on_b == 0 and other_key_on_a == 0
