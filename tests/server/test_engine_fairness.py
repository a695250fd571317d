"""Fair prefill, judged by the order of service: while a long prompt is prefilled, a short
prompt that arrives gets its first token in the step after the one under way (a step that feeds
it alone), long before the long prompt's prefill ends, and both get the answers they get alone
(a prompt fed in more, smaller pieces gives the same log-probabilities where the model is
chunking invariant; any other model is fed whole prefill chunks only). Long prompts share each
step's budget round robin among owners (API keys), then among one owner's requests. Each
request's prefilled tokens are counted in xlserve_prefill_tokens."""

from __future__ import annotations

import asyncio
import threading

import pytest

from xlserve.models.tokenizer import ByteTokenizer
from xlserve.server.engine import local
from xlserve.server.engine.request import EngineRequest
from xlserve.server.engine.scheduler import Engine
from xlserve.server.engine.types import TokenEvent
from xlserve.server.metrics import Metrics
from tests.server.test_engine import HistoryModel, collect, generation, same_answers, xl_model

LONG_PROMPT = "the quick brown fox jumps over the lazy dog\n" * 40  # 1,760 bytes
SHORT_PROMPT = "0123456789"  # the 10-byte completion
CHUNK = 16  # 110 prefill chunks for the long prompt


class InvariantHistoryModel(HistoryModel):
    """HistoryModel says what is true of it: a prompt in pieces of any size gives one pass's
    log-probabilities (each position's distribution is the mean over every token before it)."""

    chunking_invariant = True


class WatchedEngine:
    """An engine whose sink notes, in the worker thread at the step that sends it, how many of
    the watched request's prompt tokens were in its state when each request's first token left."""

    def __init__(self, model):
        self.delivery = local.SubmissionDelivery()
        self.watched: EngineRequest | None = None
        self.fed_at_first_token: dict[int, int] = {}  # id(request handle) -> watched.fed then
        self.engine = Engine("m", model, ByteTokenizer(), Metrics(), sink=self.sink, prefill_chunk=CHUNK)

    def sink(self, events):
        for handle, event in events:
            if isinstance(event, TokenEvent) and self.watched is not None:
                self.fed_at_first_token.setdefault(id(handle), self.watched.fed)
        self.delivery(events)


def serve_long_then_short(make_model):
    """A long prompt, then a short one queued while the worker is held inside the long one's
    first prefill forward; returns (alone answers, together answers, watcher, both requests)."""
    model = make_model()
    forward, held, release = model.forward, threading.Event(), threading.Event()
    release.set()

    def gated(tokens, state, **kwargs):
        held.set()
        if not release.wait(timeout=30):
            raise TimeoutError("the test never released the held forward")
        return forward(tokens, state, **kwargs)

    model.forward = gated
    watcher = WatchedEngine(model)
    engine = watcher.engine

    async def main():
        alone = [await collect(engine, generation(engine, p, max_tokens=4)) for p in (LONG_PROMPT, SHORT_PROMPT)]
        release.clear()
        held.clear()
        long_request = generation(engine, LONG_PROMPT, max_tokens=4)
        watcher.watched = long_request
        long_task = asyncio.create_task(collect(engine, long_request))
        for _ in range(3000):  # the worker is inside the long prompt's first forward
            if held.is_set():
                break
            await asyncio.sleep(0.01)
        assert held.is_set(), "the long prompt's prefill never started"
        short_request = generation(engine, SHORT_PROMPT, max_tokens=4)
        short_task = asyncio.create_task(collect(engine, short_request))
        for _ in range(3000):  # queued before the held step ends
            if short_request.handle is not None:
                break
            await asyncio.sleep(0.01)
        release.set()
        together = [await long_task, await short_task]
        return alone, together, long_request, short_request

    try:
        alone, together, long_request, short_request = asyncio.run(main())
    finally:
        engine.close()
    return alone, together, watcher, long_request, short_request


@pytest.mark.parametrize("make_model", [InvariantHistoryModel, xl_model], ids=["chunking-invariant", "whole-chunks"])
def test_a_short_prompt_gets_its_first_token_before_a_long_prompt_is_prefilled(make_model):
    alone, together, watcher, long_request, short_request = serve_long_then_short(make_model)
    long_tokens = len(LONG_PROMPT.encode())
    fed_then = watcher.fed_at_first_token[id(short_request.handle)]
    # the short prompt was served in the step right after the held one, a step of its own: the
    # long prompt had that one chunk in, of its 110
    assert fed_then == CHUNK < long_tokens
    assert watcher.fed_at_first_token[id(long_request.handle)] == long_tokens
    same_answers(together, alone)  # the long prompt in other pieces: the same log-probabilities


def test_a_prompt_that_can_finish_gets_a_step_of_its_own_and_every_request_counts_its_prefill_tokens():
    """The step after the held one feeds the short prompt alone (a short step: its first token
    does not wait for a chunk of the long prompt), then the long prompt goes on in whole
    chunks; each request's prefilled tokens land in the histogram."""
    model = InvariantHistoryModel()
    pieces: list[tuple[int, ...]] = []
    forward = model.forward

    def recording(tokens, state, **kwargs):
        pieces.append(tuple(tokens.shape))
        return forward(tokens, state, **kwargs)

    model.forward = recording
    alone, together, watcher, long_request, short_request = serve_long_then_short(lambda: model)
    engine = watcher.engine
    long_tokens, short_tokens = len(LONG_PROMPT.encode()), len(SHORT_PROMPT)
    prefill_lengths = [shape[1] for shape in pieces if shape[1] > 1]
    # alone: the long prompt's 110 chunks of 16, the short one's 10. Together: one held chunk of
    # the long prompt, the short prompt's 10 alone, the long prompt's other 109 chunks
    half = len(prefill_lengths) // 2
    assert prefill_lengths[:half] == [CHUNK] * 110 + [short_tokens]
    assert prefill_lengths[half:] == [CHUNK] + [short_tokens] + [CHUNK] * 109
    registry = engine.metrics.registry
    assert registry.get_sample_value("xlserve_prefill_tokens_count", {"model": "m"}) == 4
    assert registry.get_sample_value("xlserve_prefill_tokens_sum", {"model": "m"}) == 2 * (long_tokens + short_tokens)
    assert registry.get_sample_value("xlserve_prefill_tokens_bucket", {"model": "m", "le": "16.0"}) == 2


def planned_steps(engine: Engine, requests: list[EngineRequest], steps: int) -> list[dict[str, int]]:
    """What `_prefill_plan` gives each request (by its owner and index) over `steps` steps,
    the requests' progress recorded as the step would."""
    names = {request: f"{request.owner}{index}" for index, request in enumerate(requests)}
    given = []
    for step in range(1, steps + 1):
        plan = engine._prefill_plan([request for request in requests if request.fed < len(request.prompt)])
        for request, size in plan:
            request.fed += size
            request.prefill_turn = step
        given.append({names[request]: size for request, size in plan})
    return given


def test_owners_share_the_budget_first_then_their_requests():
    """Chunking-invariant model, budget 16: owner A's three long prompts share one half, owner
    B's one long prompt has the other; without owners each of the four has a quarter."""
    engine = Engine("m", InvariantHistoryModel(), ByteTokenizer(), Metrics(), sink=lambda events: None,
                    prefill_chunk=CHUNK)
    try:
        requests = [generation(engine, LONG_PROMPT) for _ in range(4)]
        for request, owner in zip(requests, "AAAB"):
            request.owner = owner
        first, second = planned_steps(engine, requests, 2)
        assert first == {"A0": 3, "A1": 3, "A2": 2, "B3": 8}
        assert second == {"A2": 3, "A0": 3, "A1": 2, "B3": 8}  # whoever was given least goes first
        anonymous = [generation(engine, LONG_PROMPT) for _ in range(4)]
        assert planned_steps(engine, anonymous, 1) == [{"None0": 4, "None1": 4, "None2": 4, "None3": 4}]
    finally:
        engine.close()


def test_owners_take_turns_with_whole_chunks():
    """A model fed in whole chunks only: the owners alternate, and each owner's requests take
    their turns within its own, so B's one prompt gets half the chunks, not a quarter."""
    model = HistoryModel()
    assert not model.chunking_invariant
    engine = Engine("m", model, ByteTokenizer(), Metrics(), sink=lambda events: None, prefill_chunk=CHUNK)
    try:
        requests = [generation(engine, LONG_PROMPT) for _ in range(4)]
        for request, owner in zip(requests, "AAAB"):
            request.owner = owner
        steps = planned_steps(engine, requests, 6)
        assert steps == [{"A0": CHUNK}, {"B3": CHUNK}, {"A1": CHUNK}, {"B3": CHUNK}, {"A2": CHUNK}, {"B3": CHUNK}]
    finally:
        engine.close()


def test_prompts_that_can_finish_never_take_two_steps_in_a_row():
    """A short prompt in every step would starve a long one: a step that fed only prompts that
    could finish is followed by a shared one."""
    engine = Engine("m", InvariantHistoryModel(), ByteTokenizer(), Metrics(), sink=lambda events: None,
                    prefill_chunk=CHUNK)
    try:
        long_request = generation(engine, LONG_PROMPT)
        shorts = [generation(engine, SHORT_PROMPT) for _ in range(2)]
        first = engine._prefill_plan([long_request, *shorts])
        assert [(request, size) for request, size in first] == [(shorts[0], 10)]  # two 10s do not fit in 16
        shorts[0].fed, shorts[0].prefill_turn = 10, 1
        second = dict(engine._prefill_plan([long_request, shorts[1]]))
        assert second == {long_request: 8, shorts[1]: 8}  # shared: the long prompt is fed too
    finally:
        engine.close()


def test_rows_that_free_go_first_to_the_owner_holding_fewest():
    """Admission: an owner whose wide requests filled the batch while nobody else waited does not
    also take the rows that free while other owners wait; they go to the owners holding fewest,
    first come first served among them, and its own request follows. A request that does not fit
    yet is not passed over for a narrower one behind it."""
    engine = Engine("m", InvariantHistoryModel(), ByteTokenizer(), Metrics(), sink=lambda events: None,
                    max_batch_size=4)

    def request(owner: str, n: int = 1) -> EngineRequest:
        made = generation(engine, "x", n=n, max_tokens=1)
        made.owner = owner
        return made

    try:
        with engine._condition:  # the worker waits on it: nothing is queued through enqueue
            first, second = request("a", n=2), request("a", n=2)
            engine._waiting.extend([first, second])
            engine._admit()
            assert engine._running == [first, second]  # alone, the owner may fill the batch
            third, other, another = request("a", n=2), request("b"), request("c")
            engine._waiting.extend([third, other, another])
            engine._running.remove(first)  # two rows free
            engine._running_rows -= first.width
            engine._admit()
            assert engine._running == [second, other, another] and list(engine._waiting) == [third]
            wide, narrow = request("d", n=3), request("e")
            engine._waiting.appendleft(wide)
            engine._waiting.append(narrow)
            engine._running.remove(other)  # one row frees: d (no rows, first) is next and needs three
            engine._running_rows -= other.width
            engine._admit()
            assert list(engine._waiting) == [wide, third, narrow]  # e would fit, and waits behind d
            engine._waiting.clear()
            engine._running.clear()
            engine._running_rows = 0
    finally:
        engine.close()


def test_a_step_loop_that_fails_outside_a_step_fails_its_requests_and_refuses_new_ones():
    """A failure outside a step (here admitting waiting requests into the batch raises) used to end
    the worker thread: its requests waited for good while the process's heartbeat beat on. Now
    every request of the engine gets EngineGone, new ones are refused with it, and
    `on_loop_failure` hears of it (the engine process exits there, for a new one)."""
    from xlserve.server.engine.errors import EngineGone

    handed: list = []
    failures: list[BaseException] = []
    engine = Engine("m", HistoryModel(), ByteTokenizer(), Metrics(), sink=handed.extend,
                    on_loop_failure=failures.append)

    def admit():
        raise RuntimeError("a bug in admitting")

    try:
        engine._admit = admit
        requests = [generation(engine, "abc", max_tokens=50), generation(engine, "de", max_tokens=50)]
        with engine._condition:  # both wait before the worker looks (the condition's lock is reentrant)
            for request in requests:
                engine.enqueue(request)
        engine._thread.join(timeout=30)
        assert not engine._thread.is_alive()
        assert [type(error) for error in failures] == [RuntimeError]
        ends = {id(handle): event for handle, event in handed if isinstance(event, BaseException)}
        assert all(isinstance(ends.get(id(request.handle)), EngineGone) for request in requests)
        with pytest.raises(EngineGone):
            engine.enqueue(generation(engine, "again"))
    finally:
        engine.close()


class ScoredApart(InvariantHistoryModel):
    """`forward_scored` within float tolerance of `forward`, as Transformer-XL's adaptive head is,
    made visible: its next-token rows are 1e-3 lower."""

    def forward_scored(self, tokens, state, lengths=None):
        next_rows, scores, state = super().forward_scored(tokens, state, lengths)
        return next_rows - 1e-3, scores, state


def test_a_prompt_prefilled_beside_an_echo_with_top_logprobs_gets_its_numbers_alone():
    """A prompt that needs no whole rows is prefilled through forward_scored alone; batched with
    an echo that asks for top log-probabilities (whole rows, through forward), it used to go
    through forward with it, and its first token's log-probability hung on its batch-mate."""
    engine = Engine("m", ScoredApart(), ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery())
    try:
        # prompts of one length: this toy batches equal chunks only
        alone = asyncio.run(collect(engine, generation(engine, "plain prompt!", max_tokens=2)))
        plain = generation(engine, "plain prompt!", max_tokens=2)
        echo = generation(engine, "echoed prompt", max_tokens=2, echo=True, logprobs=2)

        async def together():
            with engine._condition:  # both wait before the worker looks: one prefill step takes both
                answers = [asyncio.ensure_future(collect(engine, request)) for request in (plain, echo)]
                await asyncio.sleep(0.05)
            return await asyncio.gather(*answers)

        batched, _ = asyncio.run(together())
        assert batched["tokens"] == alone["tokens"]
        assert batched["logprobs"][0][0] == alone["logprobs"][0][0]  # the prefill's row: 1e-3 apart through forward
        assert batched["logprobs"][0] == pytest.approx(alone["logprobs"][0], abs=1e-5)  # then decoded together
    finally:
        engine.close()


def test_events_for_a_closed_event_loop_are_dropped_not_kept():
    """A loop that closed after it was woken but before it took its events: its pending list
    used to keep growing with every later step's events for it (and kept the loop alive)."""
    import types

    delivery = local.SubmissionDelivery()
    loop = asyncio.new_event_loop()
    submission = types.SimpleNamespace(loop=loop)
    delivery([(submission, "first")])  # wakes it: a delivery is scheduled, never run
    loop.close()
    for step in range(5):
        delivery([(submission, step)])
    assert loop not in delivery.pending


def test_one_key_may_hold_at_most_its_share_of_the_queue():
    """XLSERVE_MAX_QUEUED_PER_KEY: past that many waiting requests of one API key, its next is
    429 queue_full, naming the setting, while another key's request still queues."""
    import dataclasses

    from xlserve.server.engine.errors import QueueFull
    from xlserve.server.engine.request import EngineRequest
    from xlserve.server.engine.types import SamplingParams

    engine = Engine("m", xl_model(), ByteTokenizer(), Metrics(), sink=lambda events: None,
                    max_batch_size=1, max_queued=8, max_queued_per_key=2)
    try:
        def queued(owner: str) -> EngineRequest:
            request = EngineRequest("generate", [1, 2], engine.fresh_data(), SamplingParams(max_tokens=1))
            request.owner = owner
            return request

        with engine._condition:  # nothing is admitted while the queue is filled
            engine._running_rows = 1  # the batch is full: every request waits
            for _ in range(2):
                engine.enqueue(queued("a"))
            with pytest.raises(QueueFull) as refused:
                engine.enqueue(queued("a"))
            engine.enqueue(queued("b"))
            engine._waiting.clear()
            engine._running_rows = 0
    finally:
        engine.close()
    assert "XLSERVE_MAX_QUEUED_PER_KEY" in refused.value.message
