"""The prefix-state cache (server/cache/prefix_cache.py) and the engine's use of it: the longest
cached prefix is found, scopes never share entries, budgets evict least recently used entries;
a request that starts from a hit answers exactly what a cold engine answers (tokens, log-probs,
echoed prompt log-probs, seeded samples), for a model that is chunking-invariant (entries at
the end of every prompt and prompt + completion) and one that is not (entries only where the
cold path's prefill chunks end)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from xlserve.models.tokenizer import ByteTokenizer
from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig
from xlserve.server.cache import SessionData
from xlserve.server.cache.prefix_cache import PrefixCache, scope_key
from xlserve.server.engine import local
from xlserve.server.engine.request import EngineRequest
from xlserve.server.engine.scheduler import Engine
from xlserve.server.engine.types import PromptLogprobs, SamplingParams, TokenEvent
from xlserve.server.metrics import Metrics
from tests.redis_server import redis_url  # noqa: F401  (fixture)

SCOPE = scope_key("m", "owner-a", None)


def data(n: int, nbytes: int = 64) -> SessionData:
    """A stand-in state of about `nbytes` bytes that has seen n tokens."""
    from tests.server.test_engine import History

    return SessionData(state=History(tokens=torch.zeros(1, nbytes // 8, dtype=torch.long)), tokens=n,
                       next_log_probs=None)


def offer(cache: PrefixCache, tokens: list[int], scope: bytes = SCOPE, nbytes: int = 64) -> bool:
    return cache.offer("m", scope, tokens, data(len(tokens), nbytes), [None] + [-1.0] * (len(tokens) - 1))


# -- the books ------------------------------------------------------------------------------------


def test_lookup_finds_the_longest_cached_prefix_at_any_position():
    cache = PrefixCache(1 << 20, block_tokens=4)
    prompt = list(range(30))
    for n in (3, 9, 17):  # inside blocks 0, 2 and 4
        assert offer(cache, prompt[:n])
    assert cache.lookup("m", SCOPE, prompt).tokens == 17
    assert cache.lookup("m", SCOPE, prompt[:16]).tokens == 9
    assert cache.lookup("m", SCOPE, prompt, limit=12).tokens == 9
    assert cache.lookup("m", SCOPE, prompt[:3]).tokens == 3
    assert cache.lookup("m", SCOPE, prompt[:2]) is None
    # one token different inside the cached prefix: only the entries before it match
    changed = prompt[:5] + [99] + prompt[6:]
    assert cache.lookup("m", SCOPE, changed).tokens == 3


def test_scopes_never_share_entries():
    cache = PrefixCache(1 << 20, block_tokens=4)
    prompt = list(range(20))
    offer(cache, prompt)
    assert cache.lookup("m", scope_key("m", "owner-b", None), prompt) is None
    assert cache.lookup("m", scope_key("m", "owner-a", "salt"), prompt) is None
    assert cache.lookup("m", scope_key("other-model", "owner-a", None), prompt) is None
    assert cache.lookup("m", SCOPE, prompt).tokens == 20


def test_the_budget_evicts_least_recently_used_entries():
    metrics = Metrics()
    cache = PrefixCache(3 * (64 + 4 * 8), block_tokens=4, metrics=metrics)
    prompts = [[k] * 8 for k in range(4)]
    for prompt in prompts[:3]:
        assert offer(cache, prompt)
    assert cache.lookup("m", SCOPE, prompts[0]) is not None  # 0 is now the most recently used
    assert offer(cache, prompts[3])  # evicts 1, the least recently used
    assert cache.lookup("m", SCOPE, prompts[1]) is None
    assert all(cache.lookup("m", SCOPE, prompts[k]) is not None for k in (0, 2, 3))
    assert cache.usage() == {"m": (3, 3 * (64 + 32))}
    assert not offer(cache, [7] * 8, nbytes=1 << 20)  # larger than the whole budget: not kept
    text = metrics.render().decode()
    assert 'xlserve_prefix_cache_evictions_total{model="m"} 1.0' in text
    assert 'xlserve_prefix_cache_entries{model="m",tier="device"} 3.0' in text
    assert 'xlserve_prefix_cache_hits_total{model="m"} 32.0' in text


# -- the engine: a hit changes nothing but speed ----------------------------------------------------


def xl_model(same_length: bool = True) -> TransformerXL:
    torch.manual_seed(0)
    config = TransformerXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=24,
                                 same_length=same_length)
    return TransformerXL(config).eval()


def request(engine: Engine, prompt: list[int], scope: bytes | None = SCOPE, **params) -> EngineRequest:
    params.setdefault("temperature", 0)
    sampling = SamplingParams(**params)
    if scope is None:
        return EngineRequest("generate", prompt, engine.fresh_data(), sampling)
    fields = engine.start_from_prefix(prompt, scope, sampling.echo and bool(sampling.logprobs))
    return EngineRequest("generate", prompt, params=sampling, **fields)


async def answer(engine: Engine, req: EngineRequest) -> dict:
    tokens, logprobs, echoed = [], [], None
    async for event in local.generate(engine, req):
        if isinstance(event, TokenEvent):
            tokens.append(event.token)
            logprobs.append(event.logprob)
        elif isinstance(event, PromptLogprobs):
            echoed = event.logprobs
    return {"tokens": tokens, "logprobs": logprobs, "echo": echoed, "cached": event.cached_tokens}


TURNS = ["import os\nimport sys\n\n", "def main(argv):\n", "    return 0\n\n", "class A:\n    pass\n", "if x:\n"]


def conversation(engine: Engine, scope: bytes | None, **params) -> list[dict]:
    """Five turns of a stateless client: each prompt is the last prompt + its completion + a new
    user message; the last turn also echoes its whole prompt with log-probs."""

    async def main():
        answers, prompt = [], []
        for turn, message in enumerate(TURNS):
            prompt = prompt + list(message.encode())
            last = turn == len(TURNS) - 1
            result = await answer(engine, request(engine, prompt, scope, max_tokens=6, echo=last,
                                                  logprobs=0 if last else None, **params))
            answers.append(result)
            prompt = prompt + result["tokens"]
        return answers

    try:
        return asyncio.run(main())
    finally:
        engine.close()


def same(cached: list[dict], cold: list[dict]) -> None:
    for hit, expected in zip(cached, cold):
        assert hit["tokens"] == expected["tokens"]
        assert hit["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-5)
    assert cached[-1]["echo"][0] is None and cold[-1]["echo"][0] is None
    assert cached[-1]["echo"][1:] == pytest.approx(cold[-1]["echo"][1:], abs=1e-5)


def test_a_stateless_conversation_reuses_each_turn_and_answers_as_a_cold_engine():
    cache = PrefixCache(64 << 20, block_tokens=4)
    cached = conversation(Engine("m", xl_model(), ByteTokenizer(), Metrics(), prefill_chunk=7, prefix_cache=cache),
                          SCOPE)
    cold = conversation(Engine("m", xl_model(), ByteTokenizer(), Metrics(), prefill_chunk=7), None)
    same(cached, cold)
    assert cached[0]["cached"] == 0
    # from turn 2 on, the whole previous prompt + completion came from the cache
    for turn in range(1, len(TURNS)):
        previous = sum(len(m.encode()) for m in TURNS[:turn]) + sum(len(r["tokens"]) for r in cached[:turn])
        assert cached[turn]["cached"] == previous, turn
    assert all(result["cached"] == 0 for result in cold)


def test_seeded_sampling_gives_the_same_tokens_from_a_hit():
    cache = PrefixCache(64 << 20, block_tokens=4)
    cached = conversation(Engine("m", xl_model(), ByteTokenizer(), Metrics(), prefill_chunk=7, prefix_cache=cache),
                          SCOPE, temperature=0.9, seed=3, frequency_penalty=0.5)
    cold = conversation(Engine("m", xl_model(), ByteTokenizer(), Metrics(), prefill_chunk=7), None,
                        temperature=0.9, seed=3, frequency_penalty=0.5)
    same(cached, cold)
    assert all(result["cached"] > 0 for result in cached[1:])


def test_a_chunking_dependent_model_resumes_only_where_cold_prefill_chunks_end():
    """Transformer-XL with same_length=False sees further back in longer chunks: states are
    offered only after whole prefill chunks from the start, so a hit resumes where a cold
    request's chunks also break."""
    assert not xl_model(same_length=False).chunking_invariant
    cache = PrefixCache(64 << 20, block_tokens=4)
    cached = conversation(Engine("m", xl_model(False), ByteTokenizer(), Metrics(), prefill_chunk=8,
                                 prefix_cache=cache), SCOPE)
    cold = conversation(Engine("m", xl_model(False), ByteTokenizer(), Metrics(), prefill_chunk=8), None)
    same(cached, cold)
    assert all(result["cached"] % 8 == 0 for result in cached)
    assert cached[-1]["cached"] > 0


def test_echo_with_alternatives_computes_its_prompt_and_tiny_budgets_stay_exact():
    cache = PrefixCache(1, block_tokens=4)  # nothing fits: every request is cold, none fails
    cached = conversation(Engine("m", xl_model(), ByteTokenizer(), Metrics(), prefill_chunk=7, prefix_cache=cache),
                          SCOPE)
    cold = conversation(Engine("m", xl_model(), ByteTokenizer(), Metrics(), prefill_chunk=7), None)
    same(cached, cold)
    assert all(result["cached"] == 0 for result in cached)

    cache = PrefixCache(64 << 20, block_tokens=4)
    engine = Engine("m", xl_model(), ByteTokenizer(), Metrics(), prefill_chunk=7, prefix_cache=cache)
    prompt = list(b"def main(argv):\n    return 0\n")

    async def main():
        await answer(engine, request(engine, prompt, max_tokens=2))
        with_top = await answer(engine, request(engine, prompt, max_tokens=2, echo=True, logprobs=2))
        plain = await answer(engine, request(engine, prompt, max_tokens=2, echo=True, logprobs=0))
        return with_top, plain

    try:
        with_top, plain = asyncio.run(main())
    finally:
        engine.close()
    assert with_top["cached"] == 0 and plain["cached"] == len(prompt)
    assert plain["echo"][1:] == pytest.approx(with_top["echo"][1:], abs=1e-5)
    assert plain["tokens"] == with_top["tokens"]


# -- Redis: shared entries, and a store that fails costs reuse only --------------------------------


def restore_for(model):
    engine = Engine("m", model, ByteTokenizer(), Metrics())
    try:
        return engine._restore_prefix
    finally:
        engine.close()


def test_entries_shared_through_redis_are_checked_and_a_dead_redis_costs_only_reuse(redis_url):  # noqa: F811
    from xlserve.server.cache.prefix_cache import block_chain, entry_key
    from xlserve.server.cache.stores import RedisPrefixStore

    model = xl_model()
    restore = restore_for(model)
    tokens = list(b"import os\nimport sys\n\ndef main():\n")
    with torch.inference_mode():
        log_probs, state = model(torch.tensor([tokens]), model.init_state(1))
    logprobs = [None] + log_probs[0, :-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()
    entry = SessionData(state=state, tokens=len(tokens), next_log_probs=log_probs[0, -1].clone())

    writer = PrefixCache(64 << 20, block_tokens=4, remote=RedisPrefixStore(redis_url, prefix="test:prefix:"))
    reader = PrefixCache(64 << 20, block_tokens=4, remote=RedisPrefixStore(redis_url, prefix="test:prefix:"))
    assert writer.offer("m", SCOPE, tokens, entry, logprobs) and writer.flush_remote()
    hit = reader.lookup("m", SCOPE, tokens + [10, 11], restore=restore)
    assert hit.tokens == len(tokens) and hit.logprobs[1:] == pytest.approx(logprobs[1:], abs=0)
    assert torch.equal(hit.data.next_log_probs, entry.next_log_probs)
    assert reader.lookup("m", scope_key("m", "owner-b", None), tokens, restore=restore) is None

    # an entry whose bytes were altered in Redis is refused: a miss, not an error
    other = list(b"class Config:\n    debug = True\n")
    with torch.inference_mode():
        log_probs, state = model(torch.tensor([other]), model.init_state(1))
    poisoned = SessionData(state=state._map(lambda t: t * float("nan") if t.is_floating_point() else t),
                           tokens=len(other), next_log_probs=log_probs[0, -1].clone())
    assert writer.offer("m", SCOPE, other, poisoned, [None] + [-1.0] * (len(other) - 1)) and writer.flush_remote()
    assert reader.lookup("m", SCOPE, other, restore=restore) is None
    key = entry_key(block_chain(SCOPE, other, 4), other, len(other), 4).hex()
    writer.remote.client.set("test:prefix:entry:" + key, b"not a safetensors blob")
    assert reader.lookup("m", SCOPE, other, restore=restore) is None

    # Redis gone: lookups answer from memory, offers stay local, nothing raises
    dead = PrefixCache(64 << 20, block_tokens=4,
                       remote=RedisPrefixStore("redis://127.0.0.1:1/0", prefix="test:prefix:", timeout_s=0.2))
    assert dead.lookup("m", SCOPE, tokens, restore=restore) is None
    assert dead.offer("m", SCOPE, tokens, entry, logprobs)
    assert dead.lookup("m", SCOPE, tokens, restore=restore).tokens == len(tokens)
    assert dead.flush_remote()
