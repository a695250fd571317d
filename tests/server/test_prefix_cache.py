"""The prefix-state cache (server/cache/prefix_cache.py) and the engine's use of it: the longest
cached prefix is found, scopes never share entries, budgets evict least recently used entries;
a request that starts from a hit answers exactly what a cold engine answers (tokens, log-probs,
echoed prompt log-probs, seeded samples), for a model that is chunking-invariant (entries at
the end of every prompt and prompt + completion) and one that is not (entries only where the
cold path's prefill chunks end)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from xlserve.models.tokenizer import ByteTokenizer
from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig
from xlserve.server.cache.codec import SessionData
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


def make_engine(model, **options) -> Engine:
    """An engine whose events go to the asyncio loop of each request's Submission (local.py)."""
    return Engine("m", model, ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery(), **options)


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
    cached = conversation(make_engine(xl_model(), prefill_chunk=7, prefix_cache=cache), SCOPE)
    cold = conversation(make_engine(xl_model(), prefill_chunk=7), None)
    same(cached, cold)
    assert cached[0]["cached"] == 0
    # from turn 2 on, the whole previous prompt + completion came from the cache
    for turn in range(1, len(TURNS)):
        previous = sum(len(m.encode()) for m in TURNS[:turn]) + sum(len(r["tokens"]) for r in cached[:turn])
        assert cached[turn]["cached"] == previous, turn
    assert all(result["cached"] == 0 for result in cold)


def counted_conversation(model, scope: bytes | None, monkeypatch, **options) -> tuple[list[dict], int, int]:
    """A conversation's answers, and how many forward calls and state copies it took."""
    calls = {"forward": 0, "clone": 0}
    forward, state_class = model.forward, type(model.init_state(1))
    clone = state_class.clone

    def counted_forward(*args, **kwargs):
        calls["forward"] += 1
        return forward(*args, **kwargs)

    def counted_clone(state):
        calls["clone"] += 1
        return clone(state)

    monkeypatch.setattr(model, "forward", counted_forward)
    monkeypatch.setattr(state_class, "clone", counted_clone)
    answers = conversation(make_engine(model, **options), scope)
    monkeypatch.setattr(state_class, "clone", clone)
    return answers, calls["forward"], calls["clone"]


def test_a_request_whose_final_state_nobody_takes_neither_feeds_its_last_token_nor_copies_its_state(monkeypatch):
    """The API sends a prefix scope with every stateless request. With the prefix cache off, each
    still fed its last token through the model and copied its final state out for an offer that
    went nowhere (237 MB at real size, a step or two of every stream); so did a model whose entries
    hold only where prefill chunks end, whose final state is never offered. Now both cost what a
    request without a scope costs, with the same tokens."""
    plain, forwards, copies = counted_conversation(xl_model(), None, monkeypatch, prefill_chunk=7)
    scoped = counted_conversation(xl_model(), SCOPE, monkeypatch, prefill_chunk=7)
    assert scoped == (plain, forwards, copies)
    cache = PrefixCache(64 << 20, block_tokens=4)
    _, chunked_forwards, _ = counted_conversation(xl_model(False), None, monkeypatch, prefill_chunk=8)
    cached, scoped_forwards, _ = counted_conversation(xl_model(False), SCOPE, monkeypatch, prefill_chunk=8,
                                                      prefix_cache=cache)
    assert scoped_forwards <= chunked_forwards and cached[-1]["cached"] > 0


def test_an_offer_of_a_prefix_already_cached_makes_no_copy():
    cache = PrefixCache(64 << 20, block_tokens=4)
    tokens = list(range(8))
    copies = []

    def copy(data):
        copies.append(data)
        return data.clone()

    assert cache.offer("m", SCOPE, tokens, data(8), [None] + [-1.0] * 7, copy=copy) and len(copies) == 1
    assert cache.offer("m", SCOPE, tokens, data(8), [None] + [-1.0] * 7, copy=copy) and len(copies) == 1


def test_an_offer_no_tier_has_room_for_makes_no_copy():
    """A state no tier could take (a cap below one state, or the room held by sessions) is not
    copied only to be dropped: at real size the copy is 93 ms of 237 MB on the engine's step
    thread, twice per request without a session."""
    tokens = list(range(8))
    entry_bytes = data(8).nbytes() + 4 * len(tokens)  # the state and its log-probs
    copies = []

    def copy(state):
        copies.append(state)
        return state.clone()

    cache = PrefixCache(entry_bytes - 1, block_tokens=4, host_bytes=entry_bytes - 1)
    assert not cache.offer("m", SCOPE, tokens, data(8), [None] + [-1.0] * 7, copy=copy) and copies == []
    cache = PrefixCache(entry_bytes - 1, block_tokens=4, host_bytes=entry_bytes)
    assert cache.offer("m", SCOPE, tokens, data(8), [None] + [-1.0] * 7, copy=copy) and len(copies) == 1


def test_queued_requests_hold_hit_states_the_cache_let_go_only_up_to_its_memory_caps():
    """A hit's state rides with its request until the request gets a batch slot, outside every
    budget once its entry is pushed down or dropped (237 MB each at real size; 256 queued hits
    would be 60 GB). Once the waiting requests hold as many bytes of such hits as the cache's
    device and host caps, a lookup is a miss: the prompt is computed. Hits on an entry the cache
    still holds share its memory, which its books count: any number of them may wait."""
    cache = PrefixCache(64 << 20, block_tokens=4)
    engine = make_engine(xl_model(), prefix_cache=cache)
    first, second, third = (list(text) for text in (b"import os\nimport sys\n\ndef main():\n",
                                                     b"class Config:\n    debug = True\n    x = 1\n",
                                                     b"for line in open(path):\n    print(line)\n"))
    for prompt in (first, second, third):
        asyncio.run(answer(engine, request(engine, prompt, max_tokens=2)))
    engine.close()  # no worker: what is queued stays queued

    def queue_a_hit(prompt) -> EngineRequest:
        fields = engine.start_from_prefix(prompt, SCOPE, False)
        assert fields["reused"] == len(prompt) and fields["hit_bytes"] > 0
        queued = EngineRequest("generate", prompt, params=SamplingParams(max_tokens=2), **fields)
        with engine._condition:
            engine._waiting.append(queued)
        return queued

    one = queue_a_hit(first)
    cache.caps["device"], cache.caps["host"] = one.hit_bytes + 4 * len(third), 0  # about one state
    for _ in range(3):  # hits on an entry the cache holds: they share its memory
        queue_a_hit(first)
    two = queue_a_hit(second)
    kept = engine.start_from_prefix(third, SCOPE, False)
    assert kept["reused"] == len(third)
    cache.clear()  # the entries dropped: the waiting requests hold two states alone now
    assert cache.offer("m", SCOPE, third, kept["start"].clone(), kept["reused_logprobs"])
    assert two.hit_bytes + one.hit_bytes >= cache.caps["device"]
    assert "reused" not in engine.start_from_prefix(third, SCOPE, False)  # computed instead
    with engine._condition:
        engine._waiting.clear()
    assert engine.start_from_prefix(third, SCOPE, False)["reused"] == len(third)

def test_seeded_sampling_gives_the_same_tokens_from_a_hit():
    cache = PrefixCache(64 << 20, block_tokens=4)
    cached = conversation(make_engine(xl_model(), prefill_chunk=7, prefix_cache=cache),
                          SCOPE, temperature=0.9, seed=3, frequency_penalty=0.5)
    cold = conversation(make_engine(xl_model(), prefill_chunk=7), None,
                        temperature=0.9, seed=3, frequency_penalty=0.5)
    same(cached, cold)
    assert all(result["cached"] > 0 for result in cached[1:])


def test_a_chunking_dependent_model_resumes_only_where_cold_prefill_chunks_end():
    """Transformer-XL with same_length=False sees further back in longer chunks: states are
    offered only after whole prefill chunks from the start, so a hit resumes where a cold
    request's chunks also break."""
    assert not xl_model(same_length=False).chunking_invariant
    cache = PrefixCache(64 << 20, block_tokens=4)
    cached = conversation(make_engine(xl_model(False), prefill_chunk=8, prefix_cache=cache), SCOPE)
    cold = conversation(make_engine(xl_model(False), prefill_chunk=8), None)
    same(cached, cold)
    assert all(result["cached"] % 8 == 0 for result in cached)
    assert cached[-1]["cached"] > 0


def test_echo_with_alternatives_computes_its_prompt_and_tiny_budgets_stay_exact():
    cache = PrefixCache(1, block_tokens=4)  # nothing fits: every request is cold, none fails
    cached = conversation(make_engine(xl_model(), prefill_chunk=7, prefix_cache=cache), SCOPE)
    cold = conversation(make_engine(xl_model(), prefill_chunk=7), None)
    same(cached, cold)
    assert all(result["cached"] == 0 for result in cached)

    metrics = Metrics()
    cache = PrefixCache(64 << 20, block_tokens=4, metrics=metrics)
    engine = make_engine(xl_model(), prefill_chunk=7, prefix_cache=cache)
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
    # the echo with alternatives counts as a query that missed (docs/design.md 6b), so the hit
    # rate reads what the prompts got: three prompts queried, one hit
    text = metrics.render().decode()
    assert f'xlserve_prefix_cache_queries_total{{model="m"}} {3.0 * len(prompt)}' in text
    assert f'xlserve_prefix_cache_hits_total{{model="m"}} {float(len(prompt))}' in text


# -- Redis: shared entries, and a store that fails costs reuse only --------------------------------


def restore_for(model):
    engine = make_engine(model)
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

    # a read is a use: the entry's block index lives a TTL from its last hit, not its last write
    block = block_chain(SCOPE, tokens, 4)[len(tokens) // 4].hex()
    writer.remote.client.expire("test:prefix:block:" + block, 5)
    third = PrefixCache(64 << 20, block_tokens=4, remote=RedisPrefixStore(redis_url, prefix="test:prefix:"))
    assert third.lookup("m", SCOPE, tokens, restore=restore).tokens == len(tokens)  # from Redis: nothing local
    assert writer.remote.client.ttl("test:prefix:block:" + block) > 3600

    # an entry whose bytes were altered in Redis is refused: a miss, not an error
    other = list(b"class Config:\n    debug = True\n")
    with torch.inference_mode():
        log_probs, state = model(torch.tensor([other]), model.init_state(1))
    poisoned = SessionData(state=state._map(lambda t: t * float("nan") if t.is_floating_point() else t),
                           tokens=len(other), next_log_probs=log_probs[0, -1].clone())
    assert writer.offer("m", SCOPE, other, poisoned, [None] + [-1.0] * (len(other) - 1)) and writer.flush_remote()
    assert reader.lookup("m", SCOPE, other, restore=restore) is None
    # a refused entry goes, with its place in its block: no later lookup downloads it again
    key = entry_key(block_chain(SCOPE, other, 4), other, len(other), 4).hex()
    other_block = block_chain(SCOPE, other, 4)[len(other) // 4].hex()
    assert not writer.remote.client.exists("test:prefix:entry:" + key)
    assert writer.remote.client.hget("test:prefix:block:" + other_block, str(len(other))) is None
    writer.remote.put_entry(other_block, len(other), key, b"not a safetensors blob")  # filed again, not a blob
    assert reader.lookup("m", SCOPE, other, restore=restore) is None
    assert not writer.remote.client.exists("test:prefix:entry:" + key)

    # Redis gone: lookups answer from memory, offers stay local, nothing raises; and after the
    # first failure Redis is left alone for a while, instead of costing every request its timeout
    dead = PrefixCache(64 << 20, block_tokens=4,
                       remote=RedisPrefixStore("redis://127.0.0.1:1/0", prefix="test:prefix:", timeout_s=0.2))
    assert dead.lookup("m", SCOPE, tokens, restore=restore) is None
    asked = []
    filed = dead.remote.filed
    dead.remote.filed = lambda names: asked.append(names) or filed(names)
    assert dead.lookup("m", SCOPE, other, restore=restore) is None and asked == []
    assert dead.offer("m", SCOPE, tokens, entry, logprobs)
    assert dead.lookup("m", SCOPE, tokens, restore=restore).tokens == len(tokens)
    assert dead.flush_remote()


def test_a_longer_entry_in_redis_is_taken_without_reading_back_the_local_one(tmp_path, redis_url):  # noqa: F811
    """Replica B holds turn 1's entry on disk; replica A shared turn 2's. B's lookup for turn 3
    takes Redis's without first reading its own file back and moving it up (at real size 237 MB
    read and checked, another entry pushed down, and then dropped for the longer one)."""
    from xlserve.server.cache.stores import RedisPrefixStore

    model = xl_model()
    restore = restore_for(model)
    turn_1 = list(b"import os\nimport sys\n\n")
    turn_2 = turn_1 + list(b"def main():\n    pass\n")

    def entry(tokens):
        with torch.inference_mode():
            log_probs, state = model(torch.tensor([tokens]), model.init_state(1))
        logprobs = [None] + log_probs[0, :-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()
        return SessionData(state=state, tokens=len(tokens), next_log_probs=log_probs[0, -1].clone()), logprobs

    a = PrefixCache(64 << 20, block_tokens=4, remote=RedisPrefixStore(redis_url, prefix="test:longer:"))
    b = PrefixCache(1, block_tokens=4, disk_bytes=64 << 20, directory=tmp_path / "b",
                    remote=RedisPrefixStore(redis_url, prefix="test:longer:"))
    assert b.offer("m", SCOPE, turn_1, *entry(turn_1), share=False) and b.flush_disk()
    assert a.offer("m", SCOPE, turn_2, *entry(turn_2)) and a.flush_remote()
    restored = []
    hit = b.lookup("m", SCOPE, turn_2 + list(b"x = 1\n"), restore=lambda blob: restored.append(1) or restore(blob))
    assert hit.tokens == len(turn_2) and len(restored) == 1  # Redis's entry alone was read
    assert b.lookup("m", SCOPE, turn_1 + [9], restore=restore).tokens == len(turn_1)  # the local one is there still


def test_an_entry_filed_in_place_of_another_removes_it_from_redis(redis_url):  # noqa: F811
    """A block files one entry per length: the entry it filed before (another prompt's, the same
    up to that block) is unreachable once replaced, and goes, instead of holding its bytes a day."""
    from xlserve.server.cache.stores import RedisPrefixStore

    store = RedisPrefixStore(redis_url, prefix="test:replaced:")
    store.put_entry("aa", 8, "01" * 8, b"first")
    store.put_entry("aa", 8, "02" * 8, b"second")
    assert store.get_entry("01" * 8) is None and store.get_entry("02" * 8) == b"second"
    assert store.filed(["aa"]) == [{8: "02" * 8}]
    store.put_entry("aa", 8, "02" * 8, b"second")  # the same entry again: kept
    assert store.get_entry("02" * 8) == b"second"


def test_two_replicas_filing_one_slot_at_once_leave_no_entry_unreachable(redis_url):  # noqa: F811
    """Replica A's entry (hundreds of MB) is still arriving when replica B files another under the
    same block and length: the slot was read in A's pipeline before its entry had arrived, so
    B's entry was replaced without being deleted and held its bytes, unreachable, for a day."""
    from xlserve.server.cache.stores import RedisPrefixStore

    a = RedisPrefixStore(redis_url, prefix="test:race:")
    b = RedisPrefixStore(redis_url, prefix="test:race:")
    swap = a._script

    def b_files_while_a_is_between_its_entry_and_its_swap(name, keys, args):
        b.put_entry("bb", 20, "02" * 8, b"small")
        return swap(name, keys, args)

    a._script = b_files_while_a_is_between_its_entry_and_its_swap
    a.put_entry("bb", 20, "01" * 8, b"large")
    assert a.filed(["bb"]) == [{20: "01" * 8}]
    assert a.get_entry("01" * 8) == b"large" and a.get_entry("02" * 8) is None  # nothing left unreachable


def test_entries_are_not_shared_past_half_of_redis_maxmemory():
    """With `noeviction`, a Redis full of prefix entries would refuse every session commit for
    the entries' TTL: entries are shared only while Redis holds less than half its maxmemory,
    counting what the writer wrote since Redis last said."""
    from tests.server.cache_helpers import size

    class ReportingRedis:
        def __init__(self, used: int, most: int):
            self.written, self.used, self.most = [], used, most

        def put_entry(self, block, n, key, blob):
            self.written.append(key)

        def memory(self):
            return [(self.used, self.most)]

    entry_bytes = size(100) + 4 * 8
    for used, most, shared in [(0, 0, 3), (0, 10 * entry_bytes, 3), (0, 5 * entry_bytes, 2),
                               (2 * entry_bytes, 5 * entry_bytes, 0)]:
        remote = ReportingRedis(used, most)
        cache = PrefixCache(1 << 20, block_tokens=4, remote=remote)
        for k in range(3):
            assert cache.offer("toy", SCOPE, *toy_entry(k))  # kept locally, shared or not
        assert cache.flush_remote()
        assert len(remote.written) == shared, (used, most)
    # a Redis of their own (XLSERVE_PREFIX_CACHE_REDIS_URL) holds no sessions: it evicts entries by
    # its own policy (allkeys-lru, as deploy/README.md says), and sharing never stops at half of it
    remote = ReportingRedis(4 * entry_bytes, 5 * entry_bytes)
    cache = PrefixCache(1 << 20, block_tokens=4, remote=remote, remote_holds_sessions=False)
    for k in range(3):
        assert cache.offer("toy", SCOPE, *toy_entry(k))
    assert cache.flush_remote() and len(remote.written) == 3


def test_only_the_sessions_redis_keeps_room_for_sessions(tmp_path):
    from types import SimpleNamespace

    sessions = SimpleNamespace(state_dir=tmp_path, redis_url="redis://sessions:6379/0", store_timeout_seconds=1.0)
    group = dict(bytes=1 << 20, block_tokens=4, host_bytes=0, disk_bytes=0, redis_ttl_seconds=60)
    for url, holds_sessions in (("", True), ("redis://sessions:6379/0", True), ("redis://entries:6379/0", False)):
        cache = PrefixCache.from_settings(SimpleNamespace(**group, redis_url=url), sessions)
        assert cache.remote_holds_sessions is holds_sessions


# -- tiers, and the budget shared with sessions -------------------------------------------------------


def toy_entry(k: int, floats: int = 100):
    """An entry for the prompt [k] * 8: a toy state of `floats` floats (cache_helpers)."""
    from tests.server.cache_helpers import data as toy_data

    return [k] * 8, toy_data(floats, seed=k, tokens=8), [None] + [-0.5 - k] * 7


def toy_restore(blob: bytes):
    from tests.server.cache_helpers import ToyState
    from xlserve.server.cache.prefix_cache import decode_entry

    return decode_entry(blob, "toy", ToyState, "cpu")


def test_entries_pushed_off_the_device_move_to_host_then_disk_and_come_back_exact(tmp_path):
    from tests.server.cache_helpers import same, size

    entry_bytes = size(100) + 4 * 8
    metrics = Metrics()
    cache = PrefixCache(entry_bytes, block_tokens=4, metrics=metrics, host_bytes=entry_bytes,
                        disk_bytes=2 * entry_bytes, directory=tmp_path / "prefix")
    entries = [toy_entry(k) for k in range(5)]
    for prompt, state, logprobs in entries:
        assert cache.offer("toy", SCOPE, prompt, state, logprobs)
    # newest on the device, the one before in host RAM, two on disk, the oldest dropped
    assert [cache.usage(t) for t in ("device", "host", "disk")] == [{"toy": (1, entry_bytes)}] * 2 + [{"toy": (2, 2 * entry_bytes)}]
    assert cache.flush_disk()  # written by the disk writer thread
    assert len(list((tmp_path / "prefix").glob("*.safetensors"))) == 2
    assert cache.lookup("toy", SCOPE, entries[0][0], restore=toy_restore) is None
    text = metrics.render().decode()
    assert 'xlserve_prefix_cache_entries{model="toy",tier="disk"} 2.0' in text
    assert 'xlserve_prefix_cache_evictions_total{model="toy"} 1.0' in text

    # without a way to check a file, disk entries are not used
    assert cache.lookup("toy", SCOPE, entries[1][0]) is None
    # a disk hit: the same state and log-probs as offered, and the entry is back on the device
    for k in (1, 3, 2):
        prompt, state, logprobs = entries[k]
        hit = cache.lookup("toy", SCOPE, prompt, restore=toy_restore)
        assert hit.tokens == 8 and same(hit.data, state) and hit.logprobs == logprobs, k
        assert cache.usage("device") == {"toy": (1, entry_bytes)}
    # the three tiers still hold four entries in all, each found exactly
    assert sum(cache.usage(t).get("toy", (0, 0))[0] for t in ("device", "host", "disk")) == 4
    for k in (1, 2, 3, 4):
        prompt, state, logprobs = entries[k]
        assert same(cache.lookup("toy", SCOPE, prompt, restore=toy_restore).data, state)
    # a file that changed on disk is refused, never used, and costs only that entry
    assert cache.flush_disk()
    files = list((tmp_path / "prefix").glob("*.safetensors"))
    assert files
    for path in files:
        path.write_bytes(path.read_bytes()[:-9] + b"corrupted")
    results = [cache.lookup("toy", SCOPE, entries[k][0], restore=toy_restore) for k in (1, 2, 3, 4)]
    assert sum(hit is None for hit in results) == len(files)
    assert all(same(hit.data, entries[k][1]) for k, hit in zip((1, 2, 3, 4), results) if hit is not None)
    assert not list((tmp_path / "prefix").glob("*.safetensors"))  # refused files are removed


def test_a_file_that_cannot_be_removed_costs_no_request_and_leaves_the_books_whole(tmp_path, monkeypatch):
    """Giving disk room back to the sessions drops entries and removes their files. A removal that
    failed (a disk remounted read-only, an I/O error) raised into the session request whose room
    it freed (a 500), with the entry gone from the tier's table but still in the index, so that
    every later pass failed again. It is now logged and the file left for the start-up wipe."""
    from tests.server.cache_helpers import size

    entry_bytes = size(100) + 4 * 8
    cache = PrefixCache(entry_bytes, block_tokens=4, host_bytes=entry_bytes, disk_bytes=3 * entry_bytes,
                        directory=tmp_path / "prefix")
    entries = [toy_entry(k) for k in range(5)]
    for prompt, state, logprobs in entries:
        assert cache.offer("toy", SCOPE, prompt, state, logprobs)
    assert cache.flush_disk() and cache.usage("disk") == {"toy": (3, 3 * entry_bytes)}
    unlink = Path.unlink

    def read_only(path, missing_ok=False):
        if "prefix" in path.parts:
            raise OSError(30, "Read-only file system", str(path))
        return unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    cache.release("disk", 2 * entry_bytes)  # no OSError
    assert cache.usage("disk") == {"toy": (1, entry_bytes)}
    assert len(cache._index) == sum(len(entries) for entries in cache._tiers.values()) == 3
    cache.release("disk", entry_bytes)
    assert cache.usage("disk") == {} and len(cache._index) == 2
    assert len(list((tmp_path / "prefix").glob("*.safetensors"))) == 3  # left for the start-up wipe


def test_entries_go_to_disk_on_a_thread_of_their_own_and_are_found_meanwhile(tmp_path, monkeypatch):
    """An offer that pushes an entry to disk never writes it on the offering thread (an engine's
    worker, between two decoding steps of its model's streams): the disk writer does. Until the
    file is written the entry is found in host RAM; an entry dropped meanwhile leaves no file;
    with the writer's queue full, one more entry pushed to disk is dropped, not waited for."""
    import threading

    from tests.server.cache_helpers import same, size
    from xlserve.server.cache import prefix_cache as module

    entry_bytes = size(100) + 4 * 8
    cache = PrefixCache(1, block_tokens=4, disk_bytes=10 * entry_bytes, directory=tmp_path / "prefix")
    encode, gate, writing = module.encode_entry, threading.Event(), threading.Event()

    def held_encode(*args):
        writing.set()
        assert gate.wait(30)
        return encode(*args)

    monkeypatch.setattr(module, "encode_entry", held_encode)
    monkeypatch.setattr(module, "DISK_WRITES_BYTES", 4 * entry_bytes)
    entries = [toy_entry(k) for k in range(7)]
    def offer_all():
        cache.offer("toy", SCOPE, *entries[0])
        assert writing.wait(30)  # the writer has the first in its hands
        for entry in entries[1:]:
            cache.offer("toy", SCOPE, *entry)

    offered = threading.Thread(target=offer_all)
    offered.start()
    offered.join(30)
    assert not offered.is_alive()  # the offers returned while the writer waits on its first file
    assert not list((tmp_path / "prefix").glob("*.safetensors"))
    # DISK_WRITES_BYTES of them waiting for the writer, one in its hands: the rest were dropped
    kept = 4
    assert cache.usage("disk") == {"toy": (kept, kept * entry_bytes)}
    assert cache.lookup("toy", SCOPE, entries[-1][0], restore=toy_restore) is None
    hit = cache.lookup("toy", SCOPE, entries[1][0], restore=toy_restore)  # found in host RAM: no file yet
    assert same(hit.data, entries[1][1]) and hit.logprobs == entries[1][2]
    cache.release("disk", entry_bytes)  # the oldest on disk, whose file is being written, is dropped
    gate.set()
    assert cache.flush_disk()
    files = {path.name for path in (tmp_path / "prefix").glob("*")}
    assert len(files) == kept - 1 and all(name.endswith(".safetensors") for name in files)
    for k in range(1, kept):  # each from its file now (the device's cap of 1 byte keeps them on disk)
        hit = cache.lookup("toy", SCOPE, entries[k][0], restore=toy_restore)
        assert same(hit.data, entries[k][1]) and hit.logprobs == entries[k][2]


def test_a_restarted_cache_forgets_the_entries_its_last_run_wrote(tmp_path):
    entry_bytes = 600
    first = PrefixCache(1, block_tokens=4, disk_bytes=10 * entry_bytes, directory=tmp_path / "prefix")
    prompt, state, logprobs = toy_entry(0)
    assert first.offer("toy", SCOPE, prompt, state, logprobs)  # straight to disk: the device cap is 1 byte
    assert first.flush_disk() and list((tmp_path / "prefix").glob("*.safetensors"))
    second = PrefixCache(1, block_tokens=4, disk_bytes=10 * entry_bytes, directory=tmp_path / "prefix")
    assert not list((tmp_path / "prefix").glob("*")) and second.lookup("toy", SCOPE, prompt, restore=toy_restore) is None


def test_sessions_and_entries_share_each_tier_and_sessions_come_first(tmp_path):
    from xlserve.server.cache.session_cache import SessionCache
    from tests.server.cache_helpers import MODEL, data as toy_data, same, size

    session_bytes = size(1000)
    entry_bytes = size(100) + 4 * 8
    device_budget = 2 * session_bytes
    sessions = SessionCache(tmp_path / "state", device_budget, 4 * session_bytes, 100 * session_bytes)
    sessions.open({"toy": MODEL})
    cache = PrefixCache(1 << 20, block_tokens=4, host_bytes=1 << 20, sessions=sessions.manager)
    sessions.lend_to(cache)

    # with no session, entries may use the device's whole budget (but no more)
    entries = [toy_entry(k) for k in range(40)]
    for prompt, state, logprobs in entries:
        assert cache.offer("toy", SCOPE, prompt, state, logprobs)
    assert device_budget - entry_bytes < cache.held("device") <= device_budget
    assert cache.held("host") > 0  # the rest went down a tier

    # a session needs the device: it takes the room back from the entries, not from other sessions
    first = sessions.create("toy", None, toy_data(1000, seed=1))
    second = sessions.create("toy", None, toy_data(1000, seed=2))
    assert sessions.manager.used("device") == 2 * session_bytes
    assert sessions.manager.used("device") + cache.held("device") <= device_budget
    assert cache.held("device") == 0
    # an entry now finds no room on the device and goes to host RAM; the sessions stay
    prompt, state, logprobs = toy_entry(99)
    assert cache.offer("toy", SCOPE, prompt, state, logprobs)
    assert cache.held("device") == 0 and sessions.manager.used("device") == 2 * session_bytes
    hit = cache.lookup("toy", SCOPE, prompt)
    assert same(hit.data, state) and cache.held("device") == 0  # served from host, no room to move up
    for info, seed in ((first, 1), (second, 2)):
        lease = sessions.acquire(info.id, None)
        assert same(lease.data, toy_data(1000, seed=seed))
        sessions.release(lease)
    # a session leaving frees room that entries may take again
    sessions.delete(second.id, None)
    assert cache.offer("toy", SCOPE, *toy_entry(100)[0:1], *toy_entry(100)[1:])
    assert cache.held("device") > 0
    assert sessions.manager.used("device") + cache.held("device") <= device_budget


def test_a_lookup_that_may_read_a_file_runs_off_the_reader_thread(tmp_path):
    """In the engine process a request without a session looks its prompt up in the prefix cache
    on the reader thread while every entry is in memory; once entries lie on disk (a hit there
    reads and checks a file, hundreds of MB at real size) the lookup is deferred to the
    session-op pool, as a Redis lookup is, and still hits."""
    from xlserve.server.engine.process import Deferred
    from xlserve.server.engine.types import SamplingParams
    from xlserve.server.engine.wire import Generate
    from tests.server.engine_process_helpers import engine_process
    from tests.server.polling import eventually

    with engine_process(tmp_path, prefix_cache_bytes=1, prefix_cache_host_bytes=0,
                        prefix_cache_disk_bytes=1 << 30) as (process, _):
        engine = process.models["tiny"].engine
        cache = engine.prefix_cache
        params = SamplingParams(max_tokens=1, temperature=0)
        hits = []
        lookup = cache.lookup

        def watched(*args, **kwargs):
            hits.append(lookup(*args, **kwargs))
            return hits[-1]

        cache.lookup = watched
        prompt = list(b"def parse(text):\n    return text")
        scope = SCOPE.hex()
        assert cache.held("disk") == 0 and not engine.prefix_lookup_waits
        first = process.generate(Generate(1, "tiny", prompt, params, prefix_scope=scope))
        assert not isinstance(first, Deferred)  # nothing on disk: looked up in memory, inline
        assert eventually(lambda: cache.held("disk") > 0, seconds=60)  # its state went to disk (the device cap is 1 byte)
        assert cache.flush_disk() and engine.prefix_lookup_waits
        second = process.generate(Generate(2, "tiny", prompt + list(b"\n"), params, prefix_scope=scope))
        assert isinstance(second, Deferred)
        second.work()  # what the session-op pool runs
        assert hits[-1] is not None and hits[-1].tokens >= len(prompt) - 1  # from the file on disk


def test_a_lookup_that_may_copy_from_host_ram_runs_off_the_reader_thread(tmp_path):
    """A hit in host RAM copies the entry to the device (and may push another down): hundreds of
    MB at real size on a GPU, which ran on the reader thread every request's frames wait on."""
    from xlserve.server.engine.process import Deferred
    from xlserve.server.engine.types import SamplingParams
    from xlserve.server.engine.wire import Generate
    from tests.server.engine_process_helpers import engine_process
    from tests.server.polling import eventually

    with engine_process(tmp_path, prefix_cache_bytes=1, prefix_cache_host_bytes=1 << 30,
                        prefix_cache_disk_bytes=0) as (process, _):
        engine = process.models["tiny"].engine
        cache = engine.prefix_cache
        params = SamplingParams(max_tokens=1, temperature=0)
        prompt = list(b"def parse(text):\n    return text")
        scope = SCOPE.hex()
        assert not engine.prefix_lookup_waits
        first = process.generate(Generate(1, "tiny", prompt, params, prefix_scope=scope))
        assert not isinstance(first, Deferred)
        assert eventually(lambda: cache.held("host") > 0, seconds=60)  # the device cap is 1 byte
        assert engine.prefix_lookup_waits
        second = process.generate(Generate(2, "tiny", prompt + list(b"\n"), params, prefix_scope=scope))
        assert isinstance(second, Deferred)
        assert second.pool is process.prefix_lookups  # not the session operations' threads
        second.work()


def test_the_disk_writer_skips_entries_gone_before_their_turn_and_outlives_any_error(tmp_path, monkeypatch):
    """The disk writer encodes an entry only if it is still waiting for its file (one dropped,
    moved up or written again meanwhile would be encoded for nothing, holding its bytes against
    the writer's bound), and an error of any kind while writing costs that entry alone: the
    writer goes on, and its bound counts nothing it no longer holds."""
    import threading

    from tests.server.cache_helpers import same, size
    from xlserve.server.cache import prefix_cache as module

    entry_bytes = size(100) + 4 * 8
    cache = PrefixCache(1, block_tokens=4, disk_bytes=10 * entry_bytes, directory=tmp_path / "prefix")
    encode, gate, writing, encoded = module.encode_entry, threading.Event(), threading.Event(), []

    def held_encode(model, data, logprobs):
        encoded.append(logprobs[1])
        if len(encoded) == 1:
            writing.set()
            assert gate.wait(30)
            raise RuntimeError("not an OSError")  # the first write fails in a way nobody planned for
        return encode(model, data, logprobs)

    monkeypatch.setattr(module, "encode_entry", held_encode)
    entries = [toy_entry(k) for k in range(4)]
    cache.offer("toy", SCOPE, *entries[0])
    assert writing.wait(30)
    for entry in entries[1:]:
        cache.offer("toy", SCOPE, *entry)
    cache.release("disk", 3 * entry_bytes)  # the oldest three go: 0 (in the writer's hands), 1 and 2
    gate.set()
    assert cache.flush_disk()
    assert encoded == [-0.5, -3.5]  # entry 0, then only entry 3: 1 and 2 were gone before their turn
    assert cache._disk_writes_bytes == 0
    hit = cache.lookup("toy", SCOPE, entries[3][0], restore=toy_restore)  # from its file
    assert same(hit.data, entries[3][1])


def test_a_lookup_whose_file_another_lookup_took_finds_the_entry_where_it_went(tmp_path):
    """Two requests for one prefix on disk (a batched prompt list, parallel chat turns): the first
    reads the file and moves the entry up, removing the file; the second, whose read then fails,
    must not drop the entry the first just promoted, and finds it on the device."""
    from tests.server.cache_helpers import same, size

    entry_bytes = size(100) + 4 * 8
    cache = PrefixCache(entry_bytes, block_tokens=4, disk_bytes=2 * entry_bytes, directory=tmp_path / "prefix")
    first, second = toy_entry(1), toy_entry(2)
    cache.offer("toy", SCOPE, *first)
    cache.offer("toy", SCOPE, *second)  # the first goes to disk, the second holds the device
    assert cache.flush_disk() and cache.usage("disk") == {"toy": (1, entry_bytes)}
    cache.release("device", entry_bytes)  # room on the device for the first to come back to
    (entry,) = cache._tiers["disk"].values()

    def raced(blob):  # the other lookup reads the same file first and moves the entry up
        assert cache.lookup("toy", SCOPE, first[0], restore=toy_restore) is not None
        raise FileNotFoundError("the file went with the entry it held")

    hit = cache._bring_back(entry, raced)
    assert hit is not None and same(hit.data, first[1])
    assert cache.usage("device") == {"toy": (1, entry_bytes)}


def test_entries_waiting_for_redis_are_bounded_in_bytes(monkeypatch):
    """An entry queued for the Redis writer holds its state where the request left it (the
    model's device) until it is written, outside every budget: past REMOTE_WRITES_BYTES waiting,
    a new entry stays local instead of being queued."""
    import threading

    from tests.server.cache_helpers import size
    from xlserve.server.cache import prefix_cache as module

    entry_bytes = size(100) + 4 * 8
    monkeypatch.setattr(module, "REMOTE_WRITES_BYTES", 2 * entry_bytes)
    gate, written = threading.Event(), []

    class SlowRedis:
        def put_entry(self, block, n, key, blob):
            assert gate.wait(30)
            written.append(key)

        def memory(self):
            return [(0, 0)]  # no maxmemory set

    cache = PrefixCache(1 << 20, block_tokens=4, remote=SlowRedis())
    entries = [toy_entry(k) for k in range(5)]
    for entry in entries:
        assert cache.offer("toy", SCOPE, *entry)  # kept locally every time
    assert cache._remote_writes_bytes <= 2 * entry_bytes + entry_bytes  # one in the writer's hands at most
    gate.set()
    assert cache.flush_remote()
    assert 2 <= len(written) <= 3 and cache._remote_writes_bytes == 0


def test_entries_name_the_weights_that_made_them_where_they_outlive_the_process(tmp_path):
    """Prefix entries in Redis outlive the replica that wrote them: a replica with other weights
    under the same model name (a new checkpoint rolled out, int8 beside float32) must not find
    them. The engine mixes its weights' identity into every scope; the identity changes with
    any byte of the checkpoint, the dtype, the quantization and the release of xlserve (which
    may compute a model otherwise: a rolling upgrade runs two)."""
    from xlserve.models.checkpoint import save_checkpoint
    from xlserve.server.engine import process
    from xlserve.server.engine.process import weights_identity

    save_checkpoint(xl_model(), tmp_path / "a")
    first = weights_identity(tmp_path / "a", torch.float32, "none")
    assert weights_identity(tmp_path / "a", torch.float32, "none") == first
    assert weights_identity(tmp_path / "a", torch.bfloat16, "none") != first
    assert weights_identity(tmp_path / "a", torch.float32, "int8") != first
    real_version = process.package_version
    process.package_version = lambda: real_version() + ".next"
    try:
        assert weights_identity(tmp_path / "a", torch.float32, "none") != first
    finally:
        process.package_version = real_version
    weights = tmp_path / "a" / "model.safetensors"
    changed = bytearray(weights.read_bytes())
    changed[-1] ^= 1
    weights.write_bytes(bytes(changed))
    assert weights_identity(tmp_path / "a", torch.float32, "none") != first

    cache = PrefixCache(64 << 20, block_tokens=4)
    prompt = list(b"import os\nimport sys\n\n")

    def cached_tokens(identity: bytes) -> int:
        engine = make_engine(xl_model(), prefix_cache=cache, weights_identity=identity)
        try:
            return asyncio.run(answer(engine, request(engine, prompt, max_tokens=2)))["cached"]
        finally:
            engine.close()

    assert cached_tokens(b"old weights") == 0
    assert cached_tokens(b"old weights") > 0  # the same weights find their entry
    assert cached_tokens(b"new weights") == 0  # other weights under the same name do not


def test_an_entry_whose_move_fails_leaves_the_books_instead_of_every_tier():
    """An entry pushed off the device whose copy to host RAM fails (out of memory) used to stay in
    the index but in no tier: never evicted, its memory outside every budget. It goes instead,
    counted as an eviction, and the offer that pushed it down is kept: a failed copy costs reuse,
    never the request that offered."""
    from tests.server.cache_helpers import size

    entry_bytes = size(100) + 4 * 8
    metrics = Metrics()
    cache = PrefixCache(entry_bytes, block_tokens=4, host_bytes=entry_bytes, metrics=metrics)
    first, second = toy_entry(1), toy_entry(2)
    assert cache.offer("toy", SCOPE, *first)

    def failing_copy(*args, **kwargs):
        raise RuntimeError("out of host memory")

    moved = cache._index[next(iter(cache._index))]
    moved.data.to = failing_copy  # the copy to host RAM of the entry pushed down
    assert cache.offer("toy", SCOPE, *second)
    assert moved.key not in cache._index and sum(len(t) for t in cache._tiers.values()) == len(cache._index)
    assert cache.lookup("toy", SCOPE, first[0]) is None
    assert cache.lookup("toy", SCOPE, second[0]).tokens == 8
    assert cache.usage("host") == {} and 'xlserve_prefix_cache_evictions_total{model="toy"} 1.0' in metrics.render().decode()


def test_a_copy_off_the_device_is_made_outside_the_lock_and_the_entry_found_meanwhile(tmp_path):
    """A state's copy to host RAM (hundreds of MB from a GPU) is booked under the cache's lock and
    made outside it: lookups, and the session cache's `release` (which it calls under its own
    lock), do not wait behind it. Meanwhile the entry is found with the state it had; brought back
    to the device before its copy lands, that copy is let go; an entry bound for disk is written
    once its copy has landed."""
    import threading

    from tests.server.cache_helpers import same, size

    entry_bytes = size(100) + 4 * 8
    cache = PrefixCache(entry_bytes, block_tokens=4, host_bytes=entry_bytes, disk_bytes=4 * entry_bytes,
                        directory=tmp_path / "prefix")
    first, second, third = toy_entry(1), toy_entry(2), toy_entry(3)
    assert cache.offer("toy", SCOPE, *first)
    moved = cache._index[next(iter(cache._index))]
    copy, copying, gate = moved.data.to, threading.Event(), threading.Event()

    def held_copy(device, *args, **kwargs):
        if device == "cpu":  # the copy down; a promotion asks for the entry's device (a torch.device)
            copying.set()
            assert gate.wait(30)
        return copy(device, *args, **kwargs)

    moved.data.to = held_copy
    offered = threading.Thread(target=cache.offer, args=("toy", SCOPE, *second))
    offered.start()
    try:
        assert copying.wait(30)  # the offer pushed `first` down to host RAM and copies it there now
        answers = []

        def meanwhile():
            answers.append(cache.lookup("toy", SCOPE, second[0]))  # on the device
            cache.release("disk", entry_bytes)  # the session cache taking room back: nothing to drop
            answers.append(cache.lookup("toy", SCOPE, first[0]))  # in host RAM by the books, its copy not made

        other = threading.Thread(target=meanwhile)
        other.start()
        other.join(10)
        assert not other.is_alive(), "a lookup waited behind a copy to host RAM"
    finally:
        gate.set()
        offered.join(30)
    assert not offered.is_alive()
    hit_second, hit_first = answers
    assert same(hit_second.data, second[1]) and same(hit_first.data, first[1]) and hit_first.logprobs == first[2]
    # `first` is back on the device (its copy, landed late, was let go) and `second` went down in its place
    assert cache._index[moved.key].tier == "device" and cache._index[moved.key].copying == 0
    assert cache.usage("host") == {"toy": (1, entry_bytes)}
    assert all(entry.copying == 0 for entry in cache._index.values())  # every copy booked has landed or was let go
    # an entry pushed to disk is written once its copy has landed, and read back exact
    assert cache.offer("toy", SCOPE, *third)
    assert cache.flush_disk() and len(list((tmp_path / "prefix").glob("*.safetensors"))) == 1
    assert cache._disk_writes_bytes == 0
    for prompt, state, logprobs in (first, second, third):
        hit = cache.lookup("toy", SCOPE, prompt, restore=toy_restore)
        assert same(hit.data, state) and hit.logprobs == logprobs


def test_a_copy_is_not_made_for_an_entry_dropped_before_its_turn_and_a_failed_own_copy_is_not_kept():
    """Copies booked by one offer are made one at a time; an entry the sessions took its room from
    (`release`) before its turn is not copied at all (host RAM just given back is not taken), and
    the disk writes booked stay balanced. An offer whose own entry went straight to host RAM and
    could not be copied there says it was not kept."""
    import threading

    from tests.server.cache_helpers import size

    entry_bytes = size(100) + 4 * 8
    cache = PrefixCache(2 * entry_bytes, block_tokens=4, host_bytes=3 * entry_bytes)
    first, second = toy_entry(1), toy_entry(2)
    assert cache.offer("toy", SCOPE, *first) and cache.offer("toy", SCOPE, *second)
    # first's log-probs are -1.5, second's -2.5: the older entry is pushed down, and copied, first
    older, newer = sorted(cache._index.values(), key=lambda entry: entry.logprobs[1], reverse=True)
    copy, copying, gate, copied = older.data.to, threading.Event(), threading.Event(), []

    def held_copy(*args, **kwargs):
        copying.set()
        assert gate.wait(30)
        return copy(*args, **kwargs)

    def recorded_copy(*args, **kwargs):
        copied.append(args)
        return copy(*args, **kwargs)

    older.data.to, newer.data.to = held_copy, recorded_copy
    big = toy_entry(3, floats=2 * 100 + 8)  # room for it pushes both down: two copies booked by one offer
    offered = threading.Thread(target=cache.offer, args=("toy", SCOPE, *big))
    offered.start()
    try:
        assert copying.wait(30)
        cache.release("host", 2 * entry_bytes)  # the sessions take host RAM back: both are dropped
    finally:
        gate.set()
        offered.join(30)
    assert not offered.is_alive()
    assert copied == [] and older.key not in cache._index and newer.key not in cache._index
    assert cache.usage("host") == {} and cache._disk_writes_bytes == 0 and not cache._bookings()

    # an entry kept below the device at once (the device's cap is 1 byte) whose copy fails
    direct = PrefixCache(1, block_tokens=4, host_bytes=4 * entry_bytes)
    prompt, state, logprobs = toy_entry(4)

    def failing_copy(*args, **kwargs):
        raise RuntimeError("out of host memory")

    state.to = failing_copy
    assert not direct.offer("toy", SCOPE, prompt, state, logprobs)
    assert direct.lookup("toy", SCOPE, prompt) is None and direct.usage("host") == {}


def test_a_shared_entry_this_replica_cannot_take_stays_for_the_others(redis_url):  # noqa: F811
    """An entry that fails its checks goes from Redis; one this replica cannot take for a reason
    of its own (its device out of memory) stays there for the replicas that can."""
    from xlserve.server.cache.prefix_cache import block_chain, entry_key
    from xlserve.server.cache.stores import RedisPrefixStore

    writer = PrefixCache(1 << 20, block_tokens=4, remote=RedisPrefixStore(redis_url, prefix="test:stays:"))
    prompt, state, logprobs = toy_entry(3)
    assert writer.offer("toy", SCOPE, prompt, state, logprobs) and writer.flush_remote()
    key = entry_key(block_chain(SCOPE, prompt, 4), prompt, len(prompt), 4).hex()

    def out_of_memory(blob):
        raise torch.OutOfMemoryError("CUDA out of memory")

    reader = PrefixCache(1 << 20, block_tokens=4, remote=RedisPrefixStore(redis_url, prefix="test:stays:"))
    assert reader.lookup("toy", SCOPE, prompt, restore=out_of_memory) is None
    assert writer.remote.client.exists("test:stays:entry:" + key)
    assert reader.lookup("toy", SCOPE, prompt, restore=toy_restore).tokens == len(prompt)


def test_where_entries_are_shared_is_its_own_setting(tmp_path):
    """Entries go through the sessions' Redis unless XLSERVE_PREFIX_CACHE_REDIS_URL says `none` or
    names another: a Redis that fsyncs every session write (the Kubernetes manifests') stalled
    every commit behind entries of up to a whole state."""
    from xlserve.server.settings import Settings

    def remote(**flat):
        settings = Settings(models="none-loaded", state_dir=str(tmp_path), **flat)
        cache = PrefixCache.from_settings(settings.prefix_cache, settings.cache)
        return None if cache.remote is None else cache.remote.url

    sessions, entries = "redis://127.0.0.1:6399/0", "redis://127.0.0.1:6400/0"
    assert remote() is None
    assert remote(redis_url=sessions) == sessions
    assert remote(redis_url=sessions, prefix_cache_redis_url="none") is None
    assert remote(redis_url=sessions, prefix_cache_redis_url=entries) == entries
    assert remote(prefix_cache_redis_url=entries) == entries
    with pytest.raises(ValueError):
        Settings(models="none-loaded", prefix_cache_redis_url="http://nowhere")


def test_starting_the_writer_threads_leaves_the_starting_threads_torch_count_alone(tmp_path):
    """The prefix cache's writer threads run torch on one thread of their own. torch's
    set_num_threads moves the process-wide default, which a thread that has not asked for its
    count yet takes up: the engine process's main thread, which shares the cores out among the
    engines after the prefix cache started, then read 1, and every engine ran on one core. In a
    fresh process (nothing settled yet), the thread that made the cache keeps torch's default."""
    import subprocess
    import sys

    script = (
        "import sys, time, torch\n"
        "from xlserve.server.cache.prefix_cache import PrefixCache\n"
        f"PrefixCache(1 << 20, disk_bytes=1 << 20, directory={str(tmp_path / 'prefix')!r})\n"
        "time.sleep(0.5)\n"
        "print(torch.get_num_threads())\n"
    )
    default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
    after = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert after.returncode == 0, after.stderr[-2000:]
    assert int(after.stdout) == int(default.stdout) == 2


def test_the_engine_process_shares_out_every_core_with_the_prefix_cache_on(tmp_path):
    """In a fresh engine process with the defaults (the prefix cache on host RAM and disk, torch
    threads and prompt threads 0: every core, less one for the API process for decode steps) the
    engine's threads are counted from the machine's cores, not from what a writer thread started
    before left torch's default at. Checked with OMP_NUM_THREADS=2, as on a 2-core machine."""
    import json
    import subprocess
    import sys

    script = (
        "import json, pathlib, sys\n"
        "from tests.server.engine_process_helpers import engine_process\n"
        "with engine_process(pathlib.Path(sys.argv[1]), torch_threads=0, prompt_threads=0) as (process, _):\n"
        "    print(json.dumps(process.ready().threads))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "2"}, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    threads = json.loads(done.stdout.strip().splitlines()[-1])
    assert (threads["forward"], threads["prompt"]) == (1, 2), threads


def test_a_cancelled_row_keeps_no_state():
    """A session's row (or an offering one) that leaves because its client went away had its whole
    state copied out of its batch for nothing: nothing is committed or offered for it."""
    from xlserve.models.tokenizer import ByteTokenizer as Bytes
    from xlserve.server.engine.request import Row

    model = xl_model()
    start = SessionData(model.init_state(1), 0, None)
    request = EngineRequest("generate", [1, 2], start, SamplingParams(max_tokens=2), keep_state=True)
    row = Row(request, 0, Bytes().detokenizer(), model.init_state(1), torch.zeros(256))
    assert row.keeps_state
    request.cancelled.set()
    assert not row.keeps_state


def test_a_row_cancelled_during_its_last_step_offers_nothing_and_logs_no_error(caplog):
    """Its state left the batch without a copy (a cancelled row keeps none): its final offer then
    met no state and logged an ERROR traceback for every such cancel."""
    import logging

    from tests.server.test_cache_architectures import tiny_model

    model = tiny_model("mamba")  # a fixed-shape state: rows leave a batch through put_row
    engine = make_engine(model, prefix_cache=PrefixCache(64 << 20, block_tokens=4))
    forward, requests = model.forward, {}

    def cancelling(*args, **kwargs):
        first = requests.get("first")
        if first is not None and first.rows and first.rows[0].finish_reason is not None:
            first.cancelled.set()  # the client's cancel arrives while the step's forward runs
        return forward(*args, **kwargs)

    model.forward = cancelling

    async def main():
        first = requests["first"] = request(engine, list(b"hello world"), SCOPE, max_tokens=3, ignore_eos=True)
        beside = request(engine, list(b"another prompt"), SCOPE, max_tokens=12, ignore_eos=True)
        return await asyncio.gather(answer(engine, first), answer(engine, beside), return_exceptions=True)

    with caplog.at_level(logging.WARNING):
        try:
            results = asyncio.run(main())
        finally:
            engine.close()
    assert len(results[1]["tokens"]) == 12
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR], caplog.text


def test_a_large_entry_is_read_from_redis_in_slices(redis_url, monkeypatch):  # noqa: F811
    """An entry past ENTRY_SLICE_BYTES is read in slices (redis-py's reader held the interpreter
    lock 250 ms for one reply of 236 MB, every stream of the engine process waiting): the same
    bytes come back, an entry gone is None, and no write changes an entry under its reader."""
    from xlserve.server.cache.stores import RedisPrefixStore

    store = RedisPrefixStore(redis_url, prefix="test-slices:")
    monkeypatch.setattr(RedisPrefixStore, "ENTRY_SLICE_BYTES", 1000)
    gets = []
    monkeypatch.setattr(type(store.client), "get", lambda self, name: gets.append(name))  # never the whole
    blob = os.urandom(10_500)
    store.put_entry("ab", 3, "cd", blob)
    assert bytes(store.get_entry("cd")) == blob and gets == []
    # an entry is written only where none is (its key names its prefix): another replica's write
    # of the same prefix cannot change it under a reader that slices it
    store.put_entry("ab", 3, "cd", os.urandom(10_500))
    assert bytes(store.get_entry("cd")) == blob
    assert store.get_entry("no-such-entry") is None
    store.close()
