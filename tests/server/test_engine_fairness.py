"""Fair prefill, judged by the order of service: while a long prompt is prefilled, a short
prompt that arrives gets its first token within a step or two, long before the long prompt's
prefill ends, and both get the answers they get alone (a prompt fed in more, smaller pieces
gives the same log-probabilities where the model is chunking invariant; any other model is
fed whole prefill chunks only). Each request's prefilled tokens are counted in
xlserve_prefill_tokens."""

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
    # the short prompt was served in the step after the held one, or the one after that: the
    # long prompt had at most three steps' chunks in, of its 110
    assert 0 < fed_then <= 3 * CHUNK < long_tokens
    assert watcher.fed_at_first_token[id(long_request.handle)] == long_tokens
    same_answers(together, alone)  # the long prompt in other pieces: the same log-probabilities


def test_the_step_budget_is_shared_and_every_request_counts_its_prefill_tokens():
    """Chunking-invariant model: the long prompt gives up only what the short one needs, so the
    step budget is spent in full; each request's prefilled tokens land in the histogram."""
    model = InvariantHistoryModel()
    pieces: list[tuple[int, ...]] = []
    forward = model.forward

    def recording(tokens, state, **kwargs):
        pieces.append(tuple(tokens.shape))
        return forward(tokens, state, **kwargs)

    model.forward = recording
    alone, together, watcher, long_request, short_request = serve_long_then_short(lambda: model)
    engine = watcher.engine
    prefill_pieces = [shape for shape in pieces if shape[1] > 1]
    # alone, each prompt goes in whole chunks (and a tail: the long prompt's 1,760 = 110 x 16,
    # the short one's 10), never 8, 2 or 14 tokens. Together the budget is split equally: the
    # short prompt's first 8 tokens beside 8 of the long one's, then its last 2 beside 14 (each
    # in its own forward: HistoryModel takes no ragged chunks), every step 16 tokens in all
    lengths = [shape[1] for shape in prefill_pieces]
    assert lengths.count(8) == 2 and lengths.count(2) == 1 and lengths.count(14) == 1
    assert all(length <= CHUNK for length in lengths)
    registry = engine.metrics.registry
    long_tokens, short_tokens = len(LONG_PROMPT.encode()), len(SHORT_PROMPT)
    assert registry.get_sample_value("xlserve_prefill_tokens_count", {"model": "m"}) == 4
    assert registry.get_sample_value("xlserve_prefill_tokens_sum", {"model": "m"}) == 2 * (long_tokens + short_tokens)
    assert registry.get_sample_value("xlserve_prefill_tokens_bucket", {"model": "m", "le": "16.0"}) == 2
