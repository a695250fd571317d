"""Structured output in the engine (server/engine/constraints.py): the compiled-constraint cache
and its limits, the sampler's mask and its "end here" choice, rows of the shipped byte-level
Transformer-XL that end by their constraint, alone or beside unconstrained rows, and requests
that end alone, saying why, for a matcher's own error or a parser too slow per token."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from xlserve.models.checkpoint import load_checkpoint
from xlserve.server.cache.codec import SessionData
from xlserve.models.tokenizer import ByteTokenizer, WordTokenizer
from xlserve.server.engine import local
from xlserve.server.engine.constraints import NO_ALLOWED_TOKEN, SLOW_TOKENS_IN_A_ROW, ConstraintCompiler, RowConstraint
from xlserve.server.engine.errors import InvalidInput
from xlserve.server.engine.request import EngineRequest
from xlserve.server.engine.sampling import Sampler
from xlserve.server.engine.scheduler import Engine
from xlserve.server.engine.types import ChoiceFinished, Finished, SamplingParams, TokenEvent
from xlserve.server.metrics import Metrics

SHIPPED = Path(__file__).resolve().parents[2] / "weights" / "transformer-xl-stdlib"


def schema(i: int) -> str:
    return json.dumps({"type": "object", "properties": {f"f{i}": {"type": "integer"}}, "required": [f"f{i}"]})


def test_a_flood_of_distinct_schemas_stays_within_the_cache_bound():
    compiler = ConstraintCompiler(ByteTokenizer(), "m", cache_size=8)
    for i in range(40):
        compiler.matcher("json_schema", schema(i))
        assert len(compiler) <= 8
    assert compiler.compiles == 40
    compiler.matcher("json_schema", schema(39))  # recent: cached, not compiled again
    assert compiler.compiles == 40
    compiler.matcher("json_schema", schema(0))  # dropped long ago: compiled again
    assert compiler.compiles == 41 and len(compiler) == 8


def test_a_refused_schema_is_remembered_and_refused_the_same_way():
    compiler = ConstraintCompiler(ByteTokenizer(), "m")
    for _ in range(3):
        with pytest.raises(InvalidInput) as refused:
            compiler.matcher("json_schema", '{"type": "nonsense"}', param="guided_json")
        assert (refused.value.code, refused.value.param) == ("invalid_response_format", "guided_json")
        assert "nonsense" in refused.value.message
    assert compiler.compiles == 1


def test_a_compile_past_the_time_limit_is_grammar_too_large():
    properties = {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},40}}"} for i in range(400)}
    big = json.dumps({"type": "object", "properties": properties, "required": list(properties)})
    compiler = ConstraintCompiler(ByteTokenizer(), "m", compile_seconds=1e-6)
    with pytest.raises(InvalidInput) as refused:
        compiler.matcher("json_schema", big, param="response_format")
    assert refused.value.code == "grammar_too_large" and "XLSERVE_STRUCTURED_COMPILE_SECONDS" in refused.value.message


def test_time_spent_waiting_for_a_compile_thread_is_not_the_constraints():
    """The time limit is the compile's own: a small schema that waits behind other clients'
    compiles compiles; with every thread taken past the wait, the request is refused as busy
    (429), and nothing is kept for the schema, which compiles once a thread frees."""
    import threading

    from xlserve.server.engine.errors import QueueFull

    compiler = ConstraintCompiler(ByteTokenizer(), "m", compile_seconds=0.5)
    compiler.matcher("regex", "a+")  # the pool exists from here
    free = threading.Event()
    blockers = [compiler._pool.submit(free.wait, 30) for _ in range(2)]  # every compile thread taken
    threading.Timer(0.7, free.set).start()  # longer than the limit, shorter than the wait for a thread
    assert compiler.matcher("json_schema", schema(1)) is not None
    free.clear()
    blockers = [compiler._pool.submit(free.wait, 30) for _ in range(2)]
    with pytest.raises(QueueFull) as refused:
        compiler.matcher("json_schema", schema(2), param="guided_json")
    assert refused.value.code == "constraint_compiler_busy"
    assert compiler.cached_matcher("json_schema", schema(2)) is None  # nothing kept for it
    free.set()
    for blocker in blockers:
        blocker.result(timeout=30)
    compiled = compiler.compiles
    assert compiler.matcher("json_schema", schema(2)) is not None and compiler.compiles == compiled + 1


def test_a_vocabulary_that_is_not_bytes_is_refused_naming_why():
    compiler = ConstraintCompiler(WordTokenizer(["the", "cat", "<eos>"]), "wt103")
    with pytest.raises(InvalidInput) as refused:
        compiler.matcher("regex", "the", param="guided_regex")
    assert refused.value.code == "constraint_not_supported" and "WordTokenizer" in refused.value.message


def test_the_sampler_draws_only_allowed_tokens_and_ends_with_the_forbidden_mass():
    log_probs = torch.log_softmax(torch.randn(256, generator=torch.Generator().manual_seed(0)), -1)
    allowed = torch.zeros(256, dtype=torch.bool)
    allowed[ord("0"):ord("9") + 1] = True
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    drawn = [sampler.choose(log_probs, allowed, may_end=False) for _ in range(300)]
    assert all(allowed[token] for token in drawn)
    # may end: "end here" (token 256) carries the mass of the 246 forbidden tokens, most of it
    ends = [sampler.choose(log_probs, allowed, may_end=True) for _ in range(300)]
    forbidden_mass = float(log_probs[~allowed].exp().sum())
    assert abs(ends.count(256) / 300 - forbidden_mass) < 0.1
    greedy = Sampler(SamplingParams(temperature=0))
    best_allowed = int(torch.where(allowed, log_probs, float("-inf")).argmax())
    assert greedy.choose(log_probs, allowed, may_end=False) == best_allowed
    everything = torch.ones(256, dtype=torch.bool)  # nothing forbidden: it never ends by itself
    assert greedy.choose(log_probs, everything, may_end=True) == int(log_probs.argmax())


@pytest.mark.parametrize("temperature", [0.5, 1.5])
def test_truncation_that_removes_nothing_does_not_change_how_often_a_row_ends(temperature):
    """With top-k, top-p or min-p, "end here" is drawn beside the allowed tokens; its share must be
    the forbidden tokens' tempered mass, as a draw without truncation gives it (the perturbed
    row's argmax forbidden). It was their mass before the temperature, tempered as one token:
    at T=0.5 a row here ended 85% of the time with top_p=0.9999 and 7% without."""
    probabilities = torch.full((256,), 1e-9)
    probabilities[0] = 0.30  # the one allowed token
    probabilities[1:71] = 0.01  # 70 forbidden ones
    log_probs = torch.log(probabilities / probabilities.sum())
    allowed = torch.zeros(256, dtype=torch.bool)
    allowed[0] = True
    tempered = torch.softmax(log_probs / temperature, -1)
    expected = float(tempered[~allowed].sum())
    truncating = Sampler(SamplingParams(temperature=temperature, top_p=0.9999, seed=5))
    assert truncating.truncates
    draws = 600
    ends = sum(truncating.choose(log_probs, allowed, may_end=True) == 256 for _ in range(draws))
    plain = Sampler(SamplingParams(temperature=temperature, seed=6))
    plain_ends = sum(int(plain.perturbed(log_probs).argmax()) != 0 for _ in range(draws))
    assert abs(ends / draws - expected) < 0.06, (ends / draws, expected)
    assert abs(plain_ends / draws - expected) < 0.06, (plain_ends / draws, expected)


def test_the_perturbed_row_draws_from_the_allowed_tokens_in_their_proportions():
    """A constrained row that does not truncate draws with the Gumbel-max trick: the argmax of
    one perturbed row over the allowed tokens is a draw from the row restricted to them."""
    log_probs = torch.log_softmax(torch.randn(256, generator=torch.Generator().manual_seed(1)) * 2, -1)
    allowed = torch.zeros(256, dtype=torch.bool)
    allowed[[3, 50, 97, 200]] = True
    sampler = Sampler(SamplingParams(temperature=1.0, seed=11))
    draws = [int(np.where(allowed.numpy(), sampler.perturbed(log_probs), -np.inf).argmax()) for _ in range(4000)]
    expected = torch.softmax(log_probs[allowed], -1).tolist()
    observed = [draws.count(token) / len(draws) for token in (3, 50, 97, 200)]
    assert observed == pytest.approx(expected, abs=0.03)
    again = Sampler(SamplingParams(temperature=1.0, seed=11))  # seeded: the same noise
    assert np.array_equal(again.perturbed(log_probs), Sampler(SamplingParams(temperature=1.0, seed=11)).perturbed(
        log_probs))


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    engine = Engine("m", load_checkpoint(SHIPPED), ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery())
    yield engine
    engine.close()


def request(engine, prompt: str, keep_state: bool = False, matcher=None, **params) -> EngineRequest:
    """A generation; `matcher`, a compiled constraint given directly (else params name one)."""
    return EngineRequest("generate", list(prompt.encode()), engine.fresh_data(), SamplingParams(**params),
                         keep_state=keep_state, constraint=matcher)


async def collect(engine, queued: EngineRequest) -> dict:
    texts, reasons, finished = {}, {}, None
    async for event in local.generate(engine, queued):
        if isinstance(event, TokenEvent):
            texts[event.index] = texts.get(event.index, "") + event.text
        elif isinstance(event, ChoiceFinished):
            texts[event.index] = texts.get(event.index, "") + event.text_tail
            reasons[event.index] = event.finish_reason
        elif isinstance(event, Finished):
            finished = event
    return {"texts": [texts.get(i, "") for i in sorted(reasons)], "reasons": [reasons[i] for i in sorted(reasons)],
            "finished": finished}


def test_a_row_its_constraint_leaves_no_token_ends_alone(engine):
    # after "7" only the end of the output (token 256, no token of the model's) may come, and then
    # more: no token to draw, and it may not end; the matcher is in no error
    stuck_grammar = 'start: "7" <[256]> "7"\n'
    plain = dict(max_tokens=24, temperature=1.0, seed=5)

    async def together():
        return await asyncio.gather(collect(engine, request(engine, "n = ", max_tokens=24, constraint_kind="grammar",
                                                            constraint=stuck_grammar)),
                                    collect(engine, request(engine, "def f():\n", **plain)))

    stuck, beside = asyncio.run(together())
    alone = asyncio.run(collect(engine, request(engine, "def f():\n", **plain)))
    assert stuck["reasons"] == [NO_ALLOWED_TOKEN] and stuck["texts"] == ["7"]
    assert beside["texts"] == alone["texts"] and beside["reasons"] == ["length"]


async def failure_of(engine, queued: EngineRequest) -> Exception:
    with pytest.raises(InvalidInput) as failed:
        await collect(engine, queued)
    return failed.value


def test_a_matcher_stopped_by_an_error_of_its_own_fails_its_request_alone_saying_why(engine, caplog):
    """A matcher in llguidance's error state (a limit reached mid-output) is no end of its language:
    the client is told llguidance's reason, and the server logs it, rather than a bare
    no_allowed_token; the request beside goes on as alone."""
    dead = engine.constraints.matcher("regex", "[0-9]+").deep_copy()
    dead.consume_token(ord("x"))  # a token the regex forbids: the matcher is in its error state for good
    assert dead.is_error()
    plain = dict(max_tokens=24, temperature=1.0, seed=5)

    async def together():
        stuck = request(engine, "n = ", matcher=dead, max_tokens=24, constraint_param="guided_regex")
        return await asyncio.gather(failure_of(engine, stuck), collect(engine, request(engine, "def f():\n", **plain)))

    failure, beside = asyncio.run(together())
    alone = asyncio.run(collect(engine, request(engine, "def f():\n", **plain)))
    assert (failure.code, failure.param) == ("grammar_too_large", "guided_regex")
    assert "doesn't satisfy the grammar" in failure.message  # llguidance's own reason
    assert any("doesn't satisfy the grammar" in record.getMessage() for record in caplog.records)
    assert beside["texts"] == alone["texts"] and beside["reasons"] == ["length"]


def test_an_ambiguous_grammar_ends_its_request_alone_at_the_per_token_budget(engine):
    """Each step of `x: x x | x x x | "a"` costs the square of the output so far; every row
    runs on the engine's one thread, so without a bound it held every other request (a 200-token
    completion took 52 s instead of 0.65 s beside 8 such rows). Past XLSERVE_STRUCTURED_TOKEN_MILLISECONDS
    for 3 tokens in a row the request ends with 400 constraint_too_slow naming the setting, and
    the request beside it gets exactly its solo answer."""
    grammar = 'start: x "b"\nx: x x | x x x | "a"\n'
    plain = dict(max_tokens=32, temperature=1.0, seed=7)

    async def together():
        hog = request(engine, "a", max_tokens=400, n=2, seed=0, logit_bias={ord("a"): 100.0},
                      constraint_kind="grammar", constraint=grammar, constraint_param="guided_grammar")
        return await asyncio.gather(failure_of(engine, hog), collect(engine, request(engine, "def g(y):\n", **plain)))

    failure, beside = asyncio.run(together())
    alone = asyncio.run(collect(engine, request(engine, "def g(y):\n", **plain)))
    assert (failure.code, failure.param) == ("constraint_too_slow", "guided_grammar")
    assert "XLSERVE_STRUCTURED_TOKEN_MILLISECONDS" in failure.message
    assert beside["texts"] == alone["texts"] and beside["reasons"] == ["length"]


def test_a_row_ends_for_its_parser_time_only_after_tokens_in_a_row_over_the_limit():
    """One slow token alone is a spike (a garbage collection, lexer states built the first time):
    only SLOW_TOKENS_IN_A_ROW of them in a row end the row; a token within the limit starts the
    count again, and 0 is no limit."""
    row = RowConstraint(ConstraintCompiler(ByteTokenizer(), "m").matcher("regex", "[0-9]+"), 256)

    def token(seconds: float, limit: float = 0.005):
        row.start_token()
        row.token_seconds = seconds  # as if the parser had taken that long
        return row.too_slow(limit, "guided_regex")

    assert token(0.5) is None and token(0.5) is None and token(0.001) is None  # spikes, then a fast token
    assert [token(0.006) for _ in range(SLOW_TOKENS_IN_A_ROW - 1)] == [None] * (SLOW_TOKENS_IN_A_ROW - 1)
    refused = token(0.006)
    assert (refused.code, refused.param) == ("constraint_too_slow", "guided_regex")
    assert "6.0 ms" in refused.message and "XLSERVE_STRUCTURED_TOKEN_MILLISECONDS" in refused.message
    assert all(token(10.0, limit=0) is None for _ in range(5))


def test_the_rows_of_one_request_share_one_allowance_of_parser_time():
    """Every row's parser runs in turn on the engine's one worker thread: a request of 16 choices
    whose schema costs 140 ms a row at its first token took 2.2 s of every other request's step
    while no row went over its own allowance (1 s). The allowance is now the request's, over all
    of its rows; a request of one row keeps the whole of it."""
    from xlserve.server.engine.request import Row

    matcher = ConstraintCompiler(ByteTokenizer(), "m").matcher("regex", "[0-9]+")
    request = EngineRequest("generate", [1], SessionData(None, 0, None), SamplingParams(n=16))
    request.constraint = matcher
    rows = [Row(request, i, ByteTokenizer().detokenizer(), None, torch.zeros(256)) for i in range(16)]
    assert len({id(row.constraint.debt) for row in rows}) == 1

    def first_token(row, seconds=0.14, limit=0.005):
        row.constraint.start_token()
        row.constraint.token_seconds = seconds  # as if the parser had taken that long
        return row.constraint.too_slow(limit, "guided_json")

    refusals = [first_token(row) for row in rows]
    ended = next(i for i, refused in enumerate(refusals) if refused is not None)
    assert ended == 7 and refusals[ended].code == "constraint_too_slow"  # past 1 s over all of its rows
    alone = EngineRequest("generate", [1], SessionData(None, 0, None), SamplingParams())
    alone.constraint = matcher
    assert first_token(Row(alone, 0, ByteTokenizer().detokenizer(), None, torch.zeros(256))) is None


def test_ten_thousand_choices_generate_one_of_them(engine):
    """guided_choice takes 10,000 strings (the API's bound): one lexeme of them all, not a rule
    of 10,000 alternatives (llguidance's row bound, 2,000, ended those at the second token)."""
    choices = [f"category/{i}" for i in range(10_000)]
    picked = asyncio.run(collect(engine, request(engine, "tag: ", max_tokens=30, n=3, seed=1, constraint_kind="choice",
                                                 constraint=json.dumps(choices), constraint_param="guided_choice")))
    assert picked["reasons"] == ["stop"] * 3 and all(text in choices for text in picked["texts"]), picked


@pytest.mark.parametrize("choices", [["café", "日本", "😀 smile"], ['a"b', "c\\d", "a|b", "/re/", "%ignore"],
                                     ["", "x", "yes", "yes!"], ["a\nb", "tab\t", "nul\x00x", "\u2028"]])
def test_choices_are_exactly_their_strings(choices):
    compiler = ConstraintCompiler(ByteTokenizer(), "m")
    matcher = compiler.matcher("choice", json.dumps(choices))

    def takes(text: str) -> bool:
        copy = matcher.deep_copy()
        return copy.consume_tokens(list(text.encode())) and not copy.is_error() and copy.is_accepting()

    assert all(takes(choice) for choice in choices)
    others = [other for other in ("cafe", "a\\nb", "ye", "c\\\\d", "a b", "\\u2028") if other not in choices]
    assert not any(takes(other) for other in others)


def test_a_schema_of_600_optional_properties_goes_past_its_first_key():
    """Where a key may start, each optional property is four items of the parser's row: 600 of
    them passed llguidance's default bound (2,000) and the row stopped at `{"`."""
    properties = {f"field_{i}": {"type": "integer"} for i in range(600)}
    compiler = ConstraintCompiler(ByteTokenizer(), "m")
    matcher = compiler.matcher("json_schema", json.dumps({"type": "object", "properties": properties,
                                                          "additionalProperties": False}))
    row_matcher = matcher.deep_copy()
    text = b'{"field_3": 1, "field_250": 2, "field_599": 3}'
    assert row_matcher.consume_tokens(list(text)), row_matcher.get_error()
    assert row_matcher.is_stopped() and not row_matcher.is_error()


def test_a_session_row_that_ends_by_choice_keeps_exactly_the_text_sent(engine):
    """A regex that can always go on ("[0-9]+") ends only by drawing "end here", without a token
    of that step: the session's state must then be the state after prompt + text, as if fed."""
    prompt = "x = "
    ended = asyncio.run(collect(engine, request(engine, prompt, keep_state=True, max_tokens=40, temperature=0.8,
                                                seed=2, constraint_kind="regex", constraint="[0-9]+")))
    (text,) = ended["texts"]
    assert ended["reasons"] == ["stop"] and re.fullmatch("[0-9]+", text) and len(text) < 40
    data = ended["finished"].data
    fed = asyncio.run(local.append(engine, engine.fresh_data(), list((prompt + text).encode())))
    assert data.tokens == fed.data.tokens == len(prompt) + len(text)
    torch.testing.assert_close(data.next_log_probs, fed.data.next_log_probs, atol=1e-4, rtol=1e-4)


def test_truncated_sampling_masks_first_and_still_matches(engine):
    """With top-k, top-p or min-p the mask comes before the truncation (vLLM's order), through
    the sampler's masked draw: every choice still matches, and a seed repeats its text."""
    pattern = "[a-z]{2,6}=[0-9]{1,3}"
    kwargs = dict(max_tokens=30, temperature=0.9, top_k=8, top_p=0.9, min_p=0.01, seed=4, n=4,
                  constraint_kind="regex", constraint=pattern)
    first = asyncio.run(collect(engine, request(engine, "config: ", **kwargs)))
    assert all(re.fullmatch(pattern, text) for text in first["texts"]), first["texts"]
    assert first["reasons"] == ["stop"] * 4
    again = asyncio.run(collect(engine, request(engine, "config: ", **kwargs)))
    assert again["texts"] == first["texts"]


def generate_handler(engine):
    """The engine process's generate handler, with its own state alone (no model, no threads):
    its pools stand-ins, its counts of the generations waiting in them at 0."""
    import threading
    from types import SimpleNamespace

    from xlserve.server.engine import process

    handler = process.EngineProcess.__new__(process.EngineProcess)
    handler.models = {"m": SimpleNamespace(engine=engine)}
    handler.lock, handler.requests = threading.Lock(), {}
    handler.first_compiles, handler.prefix_lookups = object(), object()
    handler.first_compiles_waiting, handler.prefix_lookups_waiting = 0, 0
    handler.first_compiles_of, handler.prefix_lookups_of = process.Counter(), process.Counter()
    return handler


def test_first_compiles_wait_on_their_own_threads_and_their_queue_is_bounded():
    """A generation whose constraint compiles first runs on the engine process's first-compile
    threads, not the session-op pool that every acquire and commit needs, and once
    FIRST_COMPILE_THREADS + FIRST_COMPILES_QUEUED wait, the next is refused with 429
    constraint_compiler_busy (a client sending many distinct schemas cannot hold the others up)."""
    from types import SimpleNamespace

    from xlserve.server.engine import process
    from xlserve.server.engine.errors import QueueFull
    from xlserve.server.engine.wire import Generate

    compiler = SimpleNamespace(cached_matcher=lambda *args: None)  # never compiled before
    engine = SimpleNamespace(check_context=lambda *args: None, constraints=compiler, prefix_lookup_waits=False)
    handler = generate_handler(engine)

    def generation(i: int) -> Generate:
        params = SamplingParams(max_tokens=4, constraint_kind="json_schema", constraint=schema(i))
        return Generate(i, "m", [1, 2], params)

    limit = process.FIRST_COMPILE_THREADS + process.FIRST_COMPILES_QUEUED
    for i in range(limit):
        deferred = handler.generate(generation(i))
        assert isinstance(deferred, process.Deferred) and deferred.pool is handler.first_compiles
    with pytest.raises(QueueFull) as refused:
        handler.generate(generation(limit))
    assert refused.value.code == "constraint_compiler_busy"
    assert limit not in handler.requests and len(handler.requests) == limit  # the refused one left nothing


def test_generations_waiting_for_their_prefix_lookup_are_bounded():
    """A generation whose prefix lookup may wait (Redis, a file) waits on the prefix-lookup
    threads before it is queued, where the engine's queue bound does not count it yet: past
    PREFIX_LOOKUP_THREADS + XLSERVE_MAX_QUEUED_REQUESTS of them the next is refused with 429
    queue_full; one client flooding generations while Redis is slow cannot queue without bound."""
    from types import SimpleNamespace

    from xlserve.server.engine import process
    from xlserve.server.engine.errors import QueueFull
    from xlserve.server.engine.wire import Generate

    engine = SimpleNamespace(check_context=lambda *args: None, prefix_lookup_waits=True, max_queued=3,
                             constraints=SimpleNamespace(cached_matcher=lambda *args: None))
    handler = generate_handler(engine)
    limit = process.PREFIX_LOOKUP_THREADS + engine.max_queued
    for i in range(limit):
        deferred = handler.generate(Generate(i, "m", [1, 2], SamplingParams(max_tokens=4), prefix_scope="00"))
        assert isinstance(deferred, process.Deferred) and deferred.pool is handler.prefix_lookups
    with pytest.raises(QueueFull) as refused:
        handler.generate(Generate(limit, "m", [1, 2], SamplingParams(max_tokens=4), prefix_scope="00"))
    assert refused.value.code == "queue_full" and "prefix-cache lookup" in refused.value.message
    assert limit not in handler.requests and len(handler.requests) == limit


def test_one_api_key_s_prefix_lookups_wait_within_its_own_share():
    """XLSERVE_MAX_QUEUED_PER_KEY bounds one key's generations waiting for their prefix lookup too:
    it applied only once they were queued, so one key's burst of slow lookups filled the
    process's bound and every other key got 429."""
    from types import SimpleNamespace

    from xlserve.server.engine import process
    from xlserve.server.engine.errors import QueueFull
    from xlserve.server.engine.wire import Generate

    engine = SimpleNamespace(check_context=lambda *args: None, prefix_lookup_waits=True, max_queued=30,
                             max_queued_per_key=2, constraints=SimpleNamespace(cached_matcher=lambda *args: None))
    handler = generate_handler(engine)

    def generation(i: int, owner: str) -> Generate:
        return Generate(i, "m", [1, 2], SamplingParams(max_tokens=4), prefix_scope="00", owner=owner)

    for i in range(2):
        assert isinstance(handler.generate(generation(i, "alice")), process.Deferred)
    with pytest.raises(QueueFull) as refused:
        handler.generate(generation(2, "alice"))
    assert "XLSERVE_MAX_QUEUED_PER_KEY" in refused.value.message
    assert isinstance(handler.generate(generation(3, "bob")), process.Deferred)  # another key's goes on
    assert handler.prefix_lookups_of == {"alice": 2, "bob": 1}


def test_one_api_key_s_first_compiles_wait_within_its_own_share():
    """XLSERVE_MAX_QUEUED_PER_KEY bounds one key's generations waiting for a first compile: one key
    sending schemas that differ by a title took all FIRST_COMPILE_THREADS + FIRST_COMPILES_QUEUED
    places, and every other key's first schema got 429. A place is given back when its generation
    leaves the pool, cancelled before its compile as much as compiled."""
    import threading
    from types import SimpleNamespace

    from xlserve.server.engine import process
    from xlserve.server.engine.errors import Cancelled, QueueFull
    from xlserve.server.engine.wire import Generate

    engine = SimpleNamespace(check_context=lambda *args: None, prefix_lookup_waits=False, max_queued=30,
                             max_queued_per_key=2, constraints=SimpleNamespace(cached_matcher=lambda *args: None))
    handler = generate_handler(engine)

    def generation(i: int, owner: str) -> Generate:
        params = SamplingParams(max_tokens=4, constraint_kind="json_schema", constraint=schema(i))
        return Generate(i, "m", [1, 2], params, owner=owner)

    for i in range(2):
        assert isinstance(handler.generate(generation(i, "alice")), process.Deferred)
    with pytest.raises(QueueFull) as refused:
        handler.generate(generation(2, "alice"))
    assert refused.value.code == "constraint_compiler_busy" and "XLSERVE_MAX_QUEUED_PER_KEY" in refused.value.message
    assert isinstance(handler.generate(generation(3, "bob")), process.Deferred)  # another key's goes on
    assert handler.first_compiles_of == {"alice": 2, "bob": 1}
    cancelled = threading.Event()
    cancelled.set()  # alice's client left while its generation waited: nothing is compiled for it
    with pytest.raises(Cancelled):
        handler._deferred_generate(generation(0, "alice"), engine, cancelled, compile_first=True)
    assert handler.first_compiles_of == {"alice": 1, "bob": 1} and handler.first_compiles_waiting == 2


def test_a_generation_cancelled_while_it_waited_makes_no_prefix_lookup():
    """A generation whose client left while it waited for a prefix-lookup thread is dropped before
    its lookup: a lookup may fetch and decode hundreds of MB from Redis or a file, for nobody."""
    import threading
    from types import SimpleNamespace

    from xlserve.server.engine.errors import Cancelled
    from xlserve.server.engine.wire import Generate

    lookups = []
    engine = SimpleNamespace(check_admitted=lambda *args: None,
                             start_from_prefix=lambda *args: lookups.append(args) or {})
    handler = generate_handler(engine)
    handler.prefix_lookups_waiting, handler.prefix_lookups_of["alice"] = 1, 1  # this one's place
    cancelled = threading.Event()
    cancelled.set()
    request = Generate(0, "m", [1, 2], SamplingParams(max_tokens=4), prefix_scope="00", owner="alice")
    with pytest.raises(Cancelled):
        handler._deferred_generate(request, engine, cancelled, compile_first=False)
    assert lookups == [] and handler.prefix_lookups_waiting == 0 and handler.prefix_lookups_of == {}


# -- a byte-level BPE (tokenizer.json with a ByteLevel decoder) under a model of more rows ----------------


BPE_TOKENS, BPE_ROWS = 290, 300  # the tokenizer's tokens, the model's rows (padding past them, as mamba-130m-hf)
END_OF_TEXT = 0  # <|endoftext|>: the tokenizer's added token, the model's end of text
FORBIDDEN = [END_OF_TEXT, *range(BPE_TOKENS, BPE_ROWS)]
# made far likelier than any token of text, so a draw of the model would pick them most of the time
ATTRACTIVE = {token: 6.0 for token in FORBIDDEN}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "count", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b"]}}}}
COLOURS = ["red", "green", "blue", "dark red", "¿qué?"]


def holds_person(value) -> bool:
    """`value` fits PERSON, checked by hand."""
    return (isinstance(value, dict) and set(value) == {"name", "count", "ok", "tags"}
            and isinstance(value["name"], str) and len(value["name"]) <= 6
            and type(value["count"]) is int and 0 <= value["count"] <= 999
            and isinstance(value["ok"], bool)
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"})


@pytest.fixture(scope="module")
def bpe_engine():
    """A random Mamba of 300 rows that reads text with a trained byte-level BPE of 290 tokens,
    whose <|endoftext|> ends its unconstrained generations."""
    from tests.models.test_convert_recurrent import byte_level_tokenizer_json
    from xlserve.models.registry import build_model
    from xlserve.models.tokenizer import TokenizersTokenizer

    tokenizer = TokenizersTokenizer.from_bytes(byte_level_tokenizer_json(BPE_TOKENS).encode())
    tokenizer.stop_token_ids = frozenset({END_OF_TEXT})
    assert tokenizer.vocab_size == BPE_TOKENS and tokenizer.tokenizer.id_to_token(END_OF_TEXT) == "<|endoftext|>"
    torch.manual_seed(0)
    model = build_model("mamba", dict(vocab_size=BPE_ROWS, n_layer=1, d_model=32, d_inner=64, d_state=8,
                                      dt_rank=4)).eval()
    engine = Engine("bpe", model, tokenizer, Metrics(), sink=local.SubmissionDelivery())
    yield engine, tokenizer
    engine.close()


async def tokens_of(engine, queued: EngineRequest) -> dict:
    """Each choice's token ids, text and finish reason."""
    tokens, texts, reasons = {}, {}, {}
    async for event in local.generate(engine, queued):
        if isinstance(event, TokenEvent):
            tokens.setdefault(event.index, []).append(event.token)
            texts[event.index] = texts.get(event.index, "") + event.text
        elif isinstance(event, ChoiceFinished):
            texts[event.index] = texts.get(event.index, "") + event.text_tail
            reasons[event.index] = event.finish_reason
    order = sorted(reasons)
    return {"tokens": [tokens.get(i, []) for i in order], "texts": [texts.get(i, "") for i in order],
            "reasons": [reasons[i] for i in order]}


def bpe_generate(bpe_engine, prompt: str, **params) -> dict:
    engine, tokenizer = bpe_engine
    queued = EngineRequest("generate", tokenizer.encode(prompt), engine.fresh_data(), SamplingParams(**params))
    return asyncio.run(tokens_of(engine, queued))


def test_the_bias_makes_the_forbidden_tokens_the_models_likeliest(bpe_engine):
    """Unconstrained, the same bias has the model draw padding rows and end at <|endoftext|>:
    what the constrained draws below never do is what the model wants most."""
    drawn = bpe_generate(bpe_engine, "def f(x):", max_tokens=12, n=4, seed=1, logit_bias=ATTRACTIVE, ignore_eos=True)
    assert any(token in FORBIDDEN for tokens in drawn["tokens"] for token in tokens), drawn


@pytest.mark.parametrize("truncation", [{}, {"top_k": 40}], ids=["gumbel", "top-k"])
@pytest.mark.parametrize("bias", [None, ATTRACTIVE], ids=["plain", "forbidden-likeliest"])
def test_a_byte_level_bpe_model_generates_what_its_constraint_says(bpe_engine, truncation, bias):
    """With a tokenizer.json whose decoder is ByteLevel (the GPT-NeoX BPE of converted Mamba and
    RWKV checkpoints), a regex, a JSON schema and a choice list are enforced over the model's 300
    rows: at temperature 1, over several seeds, every choice decodes (with the tokenizer) to
    text that matches, and neither a padding row nor <|endoftext|> is ever drawn."""
    _, tokenizer = bpe_engine
    pattern = "[a-z]{2,8}-[0-9]{1,3}( [A-Z][a-z]+)?"
    constraints = [("regex", pattern, lambda text: re.fullmatch(pattern, text) is not None),
                   ("json_schema", json.dumps(PERSON), lambda text: holds_person(json.loads(text))),
                   ("choice", json.dumps(COLOURS), lambda text: text in COLOURS)]
    for kind, text, holds in constraints:
        for seed in range(4):
            drawn = bpe_generate(bpe_engine, "def parse(text):", max_tokens=120, temperature=1.0, seed=seed, n=3,
                                 logit_bias=bias, constraint_kind=kind, constraint=text, **truncation)
            assert drawn["reasons"] == ["stop"] * 3, (kind, drawn)
            for tokens, streamed in zip(drawn["tokens"], drawn["texts"]):
                assert not set(tokens) & set(FORBIDDEN), (kind, tokens)
                decoded = tokenizer.decode(tokens)
                assert decoded == streamed and holds(decoded), (kind, decoded)


def test_a_tool_grammar_on_a_byte_level_bpe_model(bpe_engine):
    """Chat's tools (here `required`: one call) are a grammar over the same tokens."""
    from xlserve.server.api.protocol import FunctionDefinition
    from xlserve.server.api.structured import tool_grammar

    function = FunctionDefinition(name="lookup", parameters={
        "type": "object", "required": ["key"], "additionalProperties": False,
        "properties": {"key": {"type": "string", "maxLength": 5}}})
    grammar = tool_grammar([function], auto=False, parallel=False)
    for seed in range(3):
        drawn = bpe_generate(bpe_engine, "<|user|>find x<|endoftext|><|assistant|>", max_tokens=80, seed=seed,
                             logit_bias=ATTRACTIVE, constraint_kind="grammar", constraint=grammar)
        (tokens,), (text,) = drawn["tokens"], drawn["texts"]
        assert drawn["reasons"] == ["stop"] and not set(tokens) & set(FORBIDDEN), drawn
        assert bpe_engine[1].decode(tokens) == text
        call = re.fullmatch(r"<tool_call>(.*)</tool_call>", text, re.S)
        assert call is not None, text
        arguments = json.loads(call.group(1))
        assert arguments["name"] == "lookup" and len(arguments["arguments"]["key"]) <= 5, arguments


def test_a_tokenizer_json_without_a_byte_level_decoder_is_refused_naming_its_decoder():
    from tokenizers import Tokenizer, decoders, models

    from xlserve.models.tokenizer import TokenizersTokenizer

    pieces = Tokenizer(models.BPE(vocab={"▁the": 0, "<0x0A>": 1}, merges=[]))
    pieces.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    compiler = ConstraintCompiler(TokenizersTokenizer(pieces), "llama-like")
    with pytest.raises(InvalidInput) as refused:
        compiler.matcher("regex", "the", param="guided_regex")
    assert refused.value.code == "constraint_not_supported"
    assert "Sequence, not ByteLevel" in refused.value.message and "byte-level BPE" in refused.value.message


# -- a byte checkpoint with more rows than bytes ----------------------------------------------------------


def test_a_byte_model_of_260_rows_enforces_its_constraint_over_bytes_only():
    """`xlserve new --config '{"vocab_size": 260}'`: llguidance's vocabulary was 256 + 1 while the
    logits are 260 wide, so a constrained row drew id 256, its end token, as a byte (HTTP 500
    "bytes must be in range(0, 256)"). Ids 256-259 are special now, the end bit is at 260, and
    the output matches, even where the model would rather draw those ids."""
    from xlserve.models.registry import build_model

    torch.manual_seed(0)
    model = build_model("mamba", dict(vocab_size=260, n_layer=1, d_model=32, d_inner=64, d_state=8, dt_rank=4)).eval()
    engine = Engine("v260", model, ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery())
    beyond = {token: 6.0 for token in range(256, 260)}
    try:
        for kind, text, holds in [("regex", "[a-z]{1,8}", lambda out: re.fullmatch("[a-z]{1,8}", out)),
                                  ("json_schema", json.dumps(PERSON), lambda out: holds_person(json.loads(out)))]:
            for extra in ({}, {"top_k": 50}, {"logit_bias": beyond}, {"logit_bias": beyond, "top_k": 50}):
                for seed in range(3):
                    queued = EngineRequest("generate", list(b"x = "), engine.fresh_data(),
                                           SamplingParams(max_tokens=150, temperature=1.0, seed=seed, n=4,
                                                          constraint_kind=kind, constraint=text, **extra))
                    drawn = asyncio.run(tokens_of(engine, queued))
                    assert drawn["reasons"] == ["stop"] * 4, (kind, extra, drawn)
                    for tokens, streamed in zip(drawn["tokens"], drawn["texts"]):
                        assert all(token < 256 for token in tokens) and holds(streamed), (kind, extra, streamed)
                        assert bytes(tokens).decode() == streamed
    finally:
        engine.close()


def test_ids_past_255_of_a_byte_model_decode_to_nothing():
    """Unconstrained, such a model may draw them: they stand for no byte, and are named."""
    tokenizer = ByteTokenizer()
    detokenizer = tokenizer.detokenizer()
    assert [detokenizer.push(token) for token in (0x68, 257, 0xC3, 259, 0xA9)] == ["h", "", "", "", "é"]
    assert tokenizer.decode([0x68, 257, 0x69]) == "hi" and tokenizer.byte_length([0x68, 257]) == 1
    assert tokenizer.token_text(258) == "<id 258>" and tokenizer.token_bytes(258) is None


@pytest.mark.parametrize("truncation", [{}, {"top_k": 5}], ids=["untruncated", "top_k"])
def test_a_model_that_rules_out_every_allowed_token_ends_the_row_without_breaking_its_constraint(truncation):
    """A model whose row gives every token the constraint allows no chance (log-probability −inf)
    while other tokens have one: the row ends with no_allowed_token, as when the constraint allows
    nothing, on both ways of drawing. The untruncated draw took the argmax of an all −inf masked
    row, token 0, which the constraint forbids; the truncating one failed the request as if its
    whole row were unusable. The row beside goes on as alone."""
    model = load_checkpoint(SHIPPED)
    digits = torch.tensor([ord(c) for c in "0123456789"])
    forward, forward_scored = model.forward, model.forward_scored

    def ruling_out(log_probs: torch.Tensor) -> torch.Tensor:
        return log_probs.index_fill(-1, digits, float("-inf"))

    def patched_forward(tokens, state, **kwargs):
        log_probs, state = forward(tokens, state, **kwargs)
        return ruling_out(log_probs), state

    def patched_forward_scored(tokens, state, lengths=None):
        last, scores, state = forward_scored(tokens, state, lengths)
        return ruling_out(last), scores, state

    model.forward, model.forward_scored = patched_forward, patched_forward_scored
    engine = Engine("m", model, ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery())
    plain = dict(max_tokens=12, temperature=1.0, seed=5)
    try:
        async def together():
            return await asyncio.gather(
                collect(engine, request(engine, "n = ", max_tokens=8, temperature=1.0, seed=3, constraint_kind="regex",
                                        constraint="[0-9]+", **truncation)),
                collect(engine, request(engine, "def f():\n", **plain)))

        ruled_out, beside = asyncio.run(together())
        alone = asyncio.run(collect(engine, request(engine, "def f():\n", **plain)))
    finally:
        engine.close()
    assert ruled_out["reasons"] == [NO_ALLOWED_TOKEN] and ruled_out["texts"] == [""]
    assert beside["texts"] == alone["texts"]


def test_slow_tokens_between_fast_ones_end_the_row_on_average():
    """A schema of thousands of properties costs about 300 ms at each ", " and next to nothing at
    the tokens between: never three slow tokens in a row, and it held every other request of its
    model for minutes. Past the limit on average, with SLOW_TOKENS_SPARE tokens' worth to spare, it
    ends; a single spike, and a schema whose keys cost 20 ms every ten tokens, do not."""
    from xlserve.server.engine.constraints import SLOW_TOKENS_SPARE

    def row_after(seconds: list[float], limit: float = 0.005):
        row = RowConstraint(ConstraintCompiler(ByteTokenizer(), "m").matcher("regex", "[0-9]+"), 256)
        for taken in seconds:
            row.start_token()
            row.token_seconds = taken  # as if the parser had taken that long
            refused = row.too_slow(limit, "response_format")
            if refused is not None:
                return refused
        return None

    refused = row_after(([0.3, 0.026] + [0.00001] * 7) * 20)
    assert refused is not None and refused.code == "constraint_too_slow" and "on average" not in refused.message
    assert "XLSERVE_STRUCTURED_TOKEN_MILLISECONDS" in refused.message
    assert row_after([0.5] + [0.0001] * 2000) is None  # a spike
    assert row_after(([0.02] + [0.0001] * 9) * 500) is None  # 2 ms a token on average
    assert row_after([0.5] * 50, limit=0) is None  # no limit
    assert SLOW_TOKENS_SPARE * 0.005 == pytest.approx(1.0)


def test_a_schemas_own_layout_options_cannot_make_the_output_no_json():
    """llguidance reads layout options from a schema's `x-guidance`; a client's separators there
    (`"item_separator": ";", "key_separator": "="`) made a response_format output, and a tool
    call's arguments, text no JSON parser reads. The layout is the server's: the schema's other
    options stay."""
    from xlserve.server.api.structured import enforced_schema
    from xlserve.server.engine.constraints import JSON_OPTIONS

    bent = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"], "additionalProperties": False,
            "x-guidance": {"item_separator": ";", "key_separator": "=", "whitespace_flexible": True}}
    compiler = ConstraintCompiler(ByteTokenizer(), "m")

    def takes(text: str) -> bool:
        row = RowConstraint(compiler.matcher("json_schema", json.dumps(bent)), 256)
        return all(row.accept(byte) for byte in text.encode())

    assert takes('{"a": 1, "b": 2}') and not takes('{"a"=1;"b"=2}')
    layout = enforced_schema(bent, strict=False, layout=JSON_OPTIONS)["x-guidance"]
    assert {key: layout[key] for key in JSON_OPTIONS} == JSON_OPTIONS and layout["lenient"] is True


def test_added_tokens_that_are_text_are_spelled_and_allowed_where_their_text_is():
    """GPT-NeoX's tokenizer (every converted Mamba, Mamba-2 and RWKV checkpoint's) spells runs of
    two spaces or more with added tokens that are not special. They were special to constraints,
    so no constraint allowed them: a row whose output could end then ended at the first drawn run
    of spaces ("stop"), even under a regex that allows them. They are now the text they decode
    to; a special added token stays special."""
    from tokenizers import AddedToken, Tokenizer

    from xlserve.models.tokenizer import TokenizersTokenizer
    from tests.models.test_convert_recurrent import byte_level_tokenizer_json

    raw = Tokenizer.from_str(byte_level_tokenizer_json(290))
    raw.add_tokens([AddedToken("  ", normalized=True, special=False), AddedToken("    ", normalized=True, special=False)])
    raw.add_special_tokens(["<|endoftext|>"])
    tokenizer = TokenizersTokenizer(raw)
    two, four, end = (raw.token_to_id(name) for name in ("  ", "    ", "<|endoftext|>"))
    assert two in tokenizer.encode("a  b") and four in tokenizer.encode("    x")
    for token in (two, four):
        assert tokenizer.token_bytes(token) == tokenizer.decode([token]).encode() == b" " * len(raw.id_to_token(token))
    assert tokenizer.token_bytes(end) is None
    compiler = ConstraintCompiler(tokenizer, "m", vocab_size=tokenizer.vocab_size)
    row = RowConstraint(compiler.matcher("regex", "[a-z ]+", param="guided_regex"), tokenizer.vocab_size)
    assert row.accept(tokenizer.encode("ab")[0])
    allowed = row.allowed_bits()
    assert allowed[two] and allowed[four] and not allowed[end]
    assert row.accept(two) and row.accept(tokenizer.encode("c")[0])


@pytest.mark.parametrize("truncation", [{}, {"top_k": 50}], ids=["gumbel", "truncating"])
def test_a_constrained_row_that_ends_at_the_end_of_text_counts_it_as_an_unconstrained_one_does(bpe_engine,
                                                                                               truncation):
    """The end-of-text token is counted in the usage's completion tokens (as OpenAI and vLLM count
    it): a constrained row whose draw is the end of text, where its output may end, counted one
    token fewer than a plain row ending the same way."""
    engine, tokenizer = bpe_engine
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=1, logit_bias={END_OF_TEXT: 30.0},
                            constraint_kind="regex", constraint="[a-z]*", **truncation)
    queued = EngineRequest("generate", tokenizer.encode("x = "), engine.fresh_data(), params)

    async def finished():
        async for event in local.generate(engine, queued):
            if isinstance(event, Finished):
                return event

    ended = asyncio.run(finished())
    choice = ended.choices[0]
    assert choice.finish_reason == "stop" and choice.completion_tokens >= 1, choice
