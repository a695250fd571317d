"""The engine in process, judged by what it answers: continuous batching gives each request
the tokens and log-probabilities it gets alone, for states that pad (Transformer-XL), states
batched by shape, and states that refuse to batch, while rows join, leave and are cancelled
mid-batch; a session's state survives the batch it ran in; chunked prefill interleaves with
decoding; cancel, queue bound, shutdown and the worker thread's torch threads."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import ArchConfig, LanguageModel, State
from xlserve.models.reformer import Reformer, ReformerConfig
from xlserve.models.tokenizer import ByteTokenizer
from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig
from xlserve.server.engine import local
from xlserve.server.engine.errors import (
    Cancelled,
    ContextLengthExceeded,
    InvalidInput,
    QueueFull,
    RequestFailed,
    ShuttingDown,
)
from xlserve.server.engine.request import EngineRequest
from xlserve.server.engine.scheduler import Engine
from xlserve.server.engine.threads import PARALLEL_MIN_TOKENS, PROMPT_PARALLEL_TOKENS
from xlserve.server.engine.types import ChoiceFinished, Finished, PromptLogprobs, SamplingParams, TokenEvent
from xlserve.server.metrics import Metrics
from tests.server.polling import eventually


def xl_model() -> TransformerXL:
    torch.manual_seed(0)
    config = TransformerXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=24)
    return TransformerXL(config).eval()


@dataclass
class History(State):
    """Every token seen: (B, T) grows, and keeps the default concat (equal shapes only)."""

    tokens: Tensor


@dataclass
class StubbornHistory(History):
    """Claims to batch rows of any length, then refuses when they differ."""

    @classmethod
    def concat(cls, states):
        if len({s.tokens.shape[1] for s in states}) > 1:
            raise ValueError("rows of different lengths")
        return cls(tokens=torch.cat([s.tokens for s in states]))


@dataclass
class UntakeableHistory(History):
    """Batches rows of equal shapes, but cannot take rows out of a batch: a batch that rows
    leave is broken up into rows that each hold their own state."""

    def take(self, rows):
        raise ValueError("this class cannot take rows out of a batch")


class HistoryModel(LanguageModel):
    """A toy whose next-token distribution depends on the whole history (mean of embeddings)."""

    architecture = "history"
    config_class = ArchConfig
    state_class = History
    state_kind = "window"
    state_grows_with_context = True

    def __init__(self, state_class=History):
        super().__init__()
        torch.manual_seed(1)
        self.config = ArchConfig(vocab_size=256)
        self.embedding = nn.Embedding(256, 16)
        self.head = nn.Linear(16, 256)
        self.state_class = state_class

    def init_state(self, batch_size: int) -> History:
        return self.state_class(tokens=torch.zeros(batch_size, 0, dtype=torch.long))

    def forward(self, tokens: Tensor, state: History) -> tuple[Tensor, History]:
        M = state.tokens.shape[1]
        seen = torch.cat([state.tokens, tokens], dim=1)  # (B, M + T)
        counts = torch.arange(1, seen.shape[1] + 1, dtype=torch.float32)[None, :, None]
        means = self.embedding(seen).cumsum(dim=1) / counts  # (B, M + T, 16)
        return F.log_softmax(self.head(means[:, M:]) * 20, dim=-1), self.state_class(tokens=seen)


def make_engine(model, **kwargs) -> Engine:
    return Engine("m", model, ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery(), **kwargs)


def generation(engine, prompt: str, start=None, keep_state=False, **params) -> EngineRequest:
    """A greedy generation unless `params` say otherwise, from a fresh session unless `start`."""
    params.setdefault("temperature", 0)
    return EngineRequest("generate", list(prompt.encode()), start or engine.fresh_data(), SamplingParams(**params),
                         keep_state=keep_state)


async def collect(engine, request: EngineRequest) -> dict:
    """Run a generation to its end: per choice its text, tokens and their log-probabilities."""
    texts, tokens, logprobs, events = {}, {}, {}, []
    async for event in local.generate(engine, request):
        events.append(event)
        if isinstance(event, TokenEvent):
            texts[event.index] = texts.get(event.index, "") + event.text
            tokens.setdefault(event.index, []).append(event.token)
            logprobs.setdefault(event.index, []).append(event.logprob)
        elif isinstance(event, ChoiceFinished):
            texts[event.index] = texts.get(event.index, "") + event.text_tail
    choices = sorted(tokens)
    return {"texts": [texts[i] for i in choices], "tokens": [tokens[i] for i in choices],
            "logprobs": [logprobs[i] for i in choices], "finished": events[-1], "events": events}


def run(coroutine):
    return asyncio.run(coroutine)


def same_answers(batched: list[dict], alone: list[dict]) -> None:
    """Each request got the tokens it gets alone, with the same log-probabilities (up to the
    float error of a batched forward)."""
    assert [answer["tokens"] for answer in batched] == [answer["tokens"] for answer in alone]
    for together, one in zip(batched, alone):
        for choice, expected in zip(together["logprobs"], one["logprobs"]):
            assert choice == pytest.approx(expected, abs=1e-4)


PROMPTS = ["d", "def main():\n", "import os\nimport sys\n\n" * 3, "x = 1\n" * 9, "class A:\n    pass\n",
           "# comment\n" * 5, "for i in range(10):\n", "a" * 70]
SAME_LENGTH = ["def main():\n", "import sys\n\n", "return None\n", "while True:\n"]  # 12 bytes: one shape
MODELS = {
    "padded-concat": xl_model,
    "group-by-shape": HistoryModel,
    "concat-refuses": lambda: HistoryModel(StubbornHistory),
    "take-refuses": lambda: HistoryModel(UntakeableHistory),
}


def every_model(*names):
    """Parametrize a test over the models of `names` (all of them by default)."""
    names = names or tuple(MODELS)
    return pytest.mark.parametrize("make_model", [MODELS[name] for name in names], ids=names)


@every_model()
def test_batched_greedy_equals_alone(make_model):
    engine = make_engine(make_model(), prefill_chunk=16)

    async def main():
        alone = [await collect(engine, generation(engine, p, max_tokens=20)) for p in PROMPTS]
        together = await asyncio.gather(*[collect(engine, generation(engine, p, max_tokens=20)) for p in PROMPTS])
        return alone, together

    try:
        alone, together = run(main())
    finally:
        engine.close()
    same_answers(together, alone)
    assert 'xlserve_batch_size_count{model="m"}' in engine.metrics.render().decode()


@every_model()
def test_rows_join_and_leave_a_running_batch(make_model):
    """Requests of different lengths arriving at different times: each gets its solo answer."""
    engine = make_engine(make_model(), prefill_chunk=8)

    async def staggered():
        tasks = []
        for i, prompt in enumerate(PROMPTS):
            tasks.append(asyncio.create_task(collect(engine, generation(engine, prompt, max_tokens=5 + 7 * i))))
            await asyncio.sleep(0.003 * i)
        return await asyncio.gather(*tasks)

    async def alone():
        return [await collect(engine, generation(engine, p, max_tokens=5 + 7 * i)) for i, p in enumerate(PROMPTS)]

    try:
        expected = run(alone())
        same_answers(run(staggered()), expected)
    finally:
        engine.close()


def test_a_row_that_joins_where_a_finished_row_left_gets_its_answer_alone():
    """A row finishes while the others decode on; a row that joins later, and the rows that
    stayed, all answer as they do alone."""
    engine = make_engine(xl_model(), prefill_chunk=64)
    requests = [(PROMPTS[1], 5), (PROMPTS[2], 60), (PROMPTS[3], 60)]
    late = (PROMPTS[4], 8)

    async def together():
        first = asyncio.create_task(collect(engine, generation(engine, requests[0][0], max_tokens=requests[0][1])))
        others = [asyncio.create_task(collect(engine, generation(engine, p, max_tokens=n))) for p, n in requests[1:]]
        answers = [await first]
        joined = await collect(engine, generation(engine, late[0], max_tokens=late[1]))
        return [*answers, *[await task for task in others], joined]

    try:
        alone = [run(collect(engine, generation(engine, p, max_tokens=n))) for p, n in [*requests, late]]
        batched = run(together())
    finally:
        engine.close()
    same_answers(batched, alone)


@every_model("padded-concat", "group-by-shape", "take-refuses")
def test_a_session_that_finishes_mid_batch_keeps_its_state(make_model):
    """A session finishes while another row decodes on beside it, and a third joins after it
    (where the class allows, into the session's old place): the session's final state does not
    change, and continues exactly like the same text fed in one pass."""
    engine = make_engine(make_model(), prefill_chunk=64)

    async def main():
        session = asyncio.create_task(collect(engine, generation(engine, SAME_LENGTH[0], keep_state=True,
                                                                 max_tokens=5)))
        other = asyncio.create_task(collect(engine, generation(engine, SAME_LENGTH[1], max_tokens=60)))
        first = await session
        data = first["finished"].data
        kept = {name: tensor.clone() for name, tensor in data.state.to_tensors().items()}
        await collect(engine, generation(engine, SAME_LENGTH[2], max_tokens=20))
        await other
        after = data.state.to_tensors()
        assert kept.keys() == after.keys() and all(torch.equal(kept[name], after[name]) for name in kept)
        continued = await collect(engine, generation(engine, "x", start=data, keep_state=True, max_tokens=6))
        tokens = [*SAME_LENGTH[0].encode(), *first["tokens"][0], *b"x"]
        one_pass = await collect(engine, EngineRequest("generate", tokens, engine.fresh_data(),
                                                       SamplingParams(temperature=0, max_tokens=6)))
        return continued, one_pass

    try:
        continued, one_pass = run(main())
    finally:
        engine.close()
    assert continued["tokens"] == one_pass["tokens"]
    assert continued["finished"].data.tokens == len(SAME_LENGTH[0]) + 5 + 1 + 6


@every_model()
def test_rows_that_stay_long_after_others_left_keep_their_answers(make_model):
    """Rows that leave early leave the batch for good (their places idle a while, then dropped);
    the rows that stay decode on for many steps and still answer as they do alone."""
    engine = make_engine(make_model(), prefill_chunk=64)
    requests = [(SAME_LENGTH[0], 3), (SAME_LENGTH[1], 4), (SAME_LENGTH[2], 50), (SAME_LENGTH[3], 50)]

    async def together():
        return await asyncio.gather(*[collect(engine, generation(engine, p, max_tokens=n)) for p, n in requests])

    try:
        alone = [run(collect(engine, generation(engine, p, max_tokens=n))) for p, n in requests]
        batched = run(together())
    finally:
        engine.close()
    same_answers(batched, alone)


@every_model()
def test_a_row_cancelled_mid_batch_leaves_the_others_their_answers(make_model):
    engine = make_engine(make_model(), prefill_chunk=64)
    stayers = [(SAME_LENGTH[1], 30), (SAME_LENGTH[2], 30)]

    async def together():
        cancelled = local.submit(engine, generation(engine, SAME_LENGTH[0], max_tokens=100000))
        others = [asyncio.create_task(collect(engine, generation(engine, p, max_tokens=n))) for p, n in stayers]
        events = cancelled.events()
        for _ in range(5):  # decoding beside the others
            assert isinstance(await events.__anext__(), TokenEvent)
        cancelled.cancel()
        with pytest.raises(Cancelled):
            async for _ in events:
                pass
        return [await task for task in others]

    try:
        alone = [run(collect(engine, generation(engine, p, max_tokens=n))) for p, n in stayers]
        batched = run(together())
        # the worker does not wait for its consumers: it may have run past the others' ends
        # before the cancel landed, and drops the cancelled row at its next step
        assert eventually(lambda: engine.idle, seconds=30)
    finally:
        engine.close()
    same_answers(batched, alone)


def test_seeded_sampling_is_the_same_batched_or_not_and_n_choices():
    engine = make_engine(xl_model())
    params = dict(temperature=1.0, top_p=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                  frequency_penalty=0.3, seed=11, max_tokens=24)

    async def main():
        alone = await collect(engine, generation(engine, "def f(x):\n", **params))
        others = [collect(engine, generation(engine, p, max_tokens=24, temperature=1.0)) for p in PROMPTS]
        crowd = await asyncio.gather(collect(engine, generation(engine, "def f(x):\n", **params)), *others)
        many = await collect(engine, generation(engine, "def f(x):\n", n=3, **params))
        return alone, crowd[0], many

    try:
        alone, batched, many = run(main())
    finally:
        engine.close()
    assert batched["texts"] == alone["texts"]
    same_answers([batched], [alone])
    assert len(many["texts"]) == 3 and many["texts"][0] == alone["texts"][0]
    assert len(set(many["texts"])) > 1  # seed + i per choice
    finished = many["finished"]
    assert isinstance(finished, Finished)
    assert [c.index for c in finished.choices] == [0, 1, 2]
    assert finished.completion_tokens == 3 * 24 and finished.prompt_tokens == len("def f(x):\n")


def test_prompts_of_different_lengths_are_prefilled_in_one_forward():
    """A model that takes ragged chunks (Transformer-XL) gets prompts of different lengths that
    arrive together as one right-padded forward; answers and echoed prompt log-probs are each
    prompt's own."""
    model = xl_model()
    calls, gate = [], threading.Event()
    forward = model.forward

    def recording(tokens, state, lengths=None):
        calls.append((tuple(tokens.shape), None if lengths is None else lengths.tolist()))
        gate.wait(timeout=30)
        return forward(tokens, state, lengths=lengths)

    model.forward = recording
    engine = make_engine(model, prefill_chunk=512)
    prompts = PROMPTS[1:5]  # 12, 75, 54 and 18 bytes

    async def main():
        alone = [await collect(engine, generation(engine, p, max_tokens=6, echo=True, logprobs=1)) for p in prompts]
        gate.clear()
        calls.clear()
        first = asyncio.create_task(collect(engine, generation(engine, "x", max_tokens=3)))
        while not calls:  # the worker is held inside the first forward of "x"
            await asyncio.sleep(0.001)
        together = [asyncio.create_task(collect(engine, generation(engine, p, max_tokens=6, echo=True, logprobs=1)))
                    for p in prompts]
        await asyncio.sleep(0.05)  # all four are queued before the held step ends
        gate.set()
        await first
        return alone, [await t for t in together]

    gate.set()
    try:
        alone, together = run(main())
    finally:
        engine.close()
    lengths = [len(p.encode()) for p in prompts]
    assert ((len(prompts), max(lengths)), lengths) in calls  # one forward for the four prompts
    for one, batched in zip(alone, together):
        assert batched["tokens"] == one["tokens"]
        echoed = [next(e for e in r["events"] if isinstance(e, PromptLogprobs)) for r in (one, batched)]
        assert echoed[0].logprobs[0] is None and echoed[1].logprobs[0] is None
        assert echoed[1].logprobs[1:] == pytest.approx(echoed[0].logprobs[1:], abs=1e-4)
        assert [t[0][0] for t in echoed[1].top[1:]] == [t[0][0] for t in echoed[0].top[1:]]


def adaptive_xl_model() -> TransformerXL:
    """A Transformer-XL with an adaptive softmax over the 256 bytes (clusters at 64 and 128): its
    prompt chunks are scored without whole rows (AdaptiveLogSoftmax.log_prob_of)."""
    torch.manual_seed(0)
    config = TransformerXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=24, adaptive=True,
                                 cutoffs=[64, 128], div_val=2)
    return TransformerXL(config).eval()


@pytest.mark.parametrize("make_model", [xl_model, adaptive_xl_model], ids=["linear-head", "adaptive-softmax"])
def test_session_continuation_equals_one_pass_and_prompt_logprobs_match_append(make_model):
    """An append's scored tokens (forward_scored) and an echo's prompt log-probabilities (whole
    rows, for their top tokens) agree, across chunk boundaries."""
    model = make_model()
    engine = make_engine(model, prefill_chunk=7)
    history = "import os\nimport sys\n\ndef main(argv):\n    return 0\n"

    async def main():
        first = await collect(engine, generation(engine, history[:20], keep_state=True, max_tokens=0))
        data = first["finished"].data
        assert data.tokens == 20
        fed = await local.append(engine, data, list(history[20:].encode()), score=True)
        data, logprob, scored = fed.data, fed.logprob, fed.scored
        continued = await collect(engine, generation(engine, "if x", start=data, keep_state=True, max_tokens=9))
        one_pass = await collect(engine, generation(engine, history + "if x", max_tokens=9))
        echoed = await collect(engine, generation(engine, history, max_tokens=0, echo=True, logprobs=2))
        # no prompt: the session goes on from where it stands
        resumed = await collect(engine, generation(engine, "", start=data, max_tokens=5))
        history_only = await collect(engine, generation(engine, history, max_tokens=5))
        assert resumed["tokens"] == history_only["tokens"]
        return logprob, scored, continued, one_pass, echoed

    try:
        logprob, scored, continued, one_pass, echoed = run(main())
    finally:
        engine.close()
    assert continued["tokens"] == one_pass["tokens"]
    finished = continued["finished"]
    assert finished.cached_tokens == len(history) and finished.data.tokens == len(history) + 4 + 9
    prompt = next(e for e in echoed["events"] if isinstance(e, PromptLogprobs))
    assert prompt.logprobs[0] is None and len(prompt.logprobs) == len(history)
    assert all(len(top) == 2 for top in prompt.top[1:])
    assert scored == len(history) - 20
    assert logprob == pytest.approx(sum(prompt.logprobs[20:]), rel=1e-4, abs=1e-3)


def test_a_stop_string_ends_its_choice_and_is_held_back():
    """The same seeded text, stopped at a string in its middle: it ends just before it."""
    engine = make_engine(xl_model())
    params = dict(temperature=1.0, seed=5, max_tokens=16)

    async def main():
        text = (await collect(engine, generation(engine, "def main():\n", **params)))["texts"][0]
        stop = next(text[i : i + 2] for i in range(1, len(text) - 1)
                    if text[i : i + 2].isascii() and text[i : i + 2].isprintable())
        stopped = await collect(engine, generation(engine, "def main():\n", stop=[stop], **params))
        return text, stop, stopped

    try:
        text, stop, stopped = run(main())
    finally:
        engine.close()
    assert stopped["texts"] == [text[: text.index(stop)]]
    assert stopped["finished"].finish_reason == "stop"
    assert len(stopped["tokens"][0]) < 16


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps():
    engine = make_engine(xl_model(), prefill_chunk=8)

    async def main():
        order = []

        async def stream(name, prompt, max_tokens):
            async for event in local.generate(engine, generation(engine, prompt, max_tokens=max_tokens)):
                if isinstance(event, TokenEvent):
                    order.append(name)

        running = asyncio.create_task(stream("running", "def f():\n", 150))
        while not order:
            await asyncio.sleep(0.001)
        await stream("long", "y = 2\n" * 60, 1)  # 360 prompt tokens = 45 chunks of 8
        await running
        return order

    try:
        order = run(main())
    finally:
        engine.close()
    long_at = order.index("long")
    assert order[:long_at].count("running") >= 40  # the stream kept going while the prompt was fed


def test_cancel_frees_the_slot_and_queue_is_bounded():
    engine = make_engine(xl_model(), max_batch_size=1, max_queued=1)

    async def main():
        first = local.submit(engine, generation(engine, "a", max_tokens=4000))
        events = first.events()
        assert isinstance(await events.__anext__(), TokenEvent)  # running
        second = local.submit(engine, generation(engine, "b", max_tokens=3))  # waits for the slot
        with pytest.raises(QueueFull) as refused:
            local.submit(engine, generation(engine, "c", max_tokens=3))
        assert refused.value.code == "queue_full"
        assert "XLSERVE_MAX_QUEUED_REQUESTS" in refused.value.message
        first.cancel()
        with pytest.raises(Cancelled):
            async for _ in events:
                pass
        finished = [e async for e in second.events()][-1]  # got the slot
        assert isinstance(finished, Finished) and finished.completion_tokens == 3
        engine.stop_admitting()
        with pytest.raises(ShuttingDown):
            local.submit(engine, generation(engine, "d", max_tokens=3))
        return engine.idle

    try:
        assert run(main())
    finally:
        engine.close()


def test_a_request_cancelled_behind_the_head_of_the_queue_frees_its_place_at_once():
    """A client that gives up while others wait ahead of it leaves the queue at once: it ends
    with Cancelled while the batch is still held up, and its place, which the queue's bound
    counts, goes to the next client instead of a 429."""
    engine = make_engine(xl_model(), max_batch_size=1, max_queued=2)

    async def main():
        first = local.submit(engine, generation(engine, "a", max_tokens=4000))
        events = first.events()
        assert isinstance(await events.__anext__(), TokenEvent)  # running: the one slot is taken
        second = local.submit(engine, generation(engine, "b", max_tokens=3))  # the head of the queue
        third = local.submit(engine, generation(engine, "c", max_tokens=3))  # behind it
        with pytest.raises(QueueFull):
            local.submit(engine, generation(engine, "d", max_tokens=3))
        third.cancel()
        with pytest.raises(Cancelled):
            async for _ in third.events():
                pass
        fourth = local.submit(engine, generation(engine, "e", max_tokens=3))  # its place is free
        assert not engine.idle  # all this while the first still runs
        first.cancel()
        with pytest.raises(Cancelled):
            async for _ in events:
                pass
        for waiting in (second, fourth):
            finished = [e async for e in waiting.events()][-1]
            assert isinstance(finished, Finished) and finished.completion_tokens == 3

    try:
        run(main())
    finally:
        engine.close()


def test_a_cancelled_request_ends_with_one_cancelled_event_at_the_sink():
    """Every request ends with exactly one last event, also when it is cancelled running or
    waiting: the engine process forgets a request (and the API process its submission) only then."""
    received, ended = [], threading.Event()

    def sink(items):
        received.extend(items)
        if sum(isinstance(event, Cancelled) for _, event in received) == 2:
            ended.set()

    engine = Engine("m", xl_model(), ByteTokenizer(), Metrics(), max_batch_size=1, sink=sink)
    running, waiting = threading.Event(), threading.Event()
    try:
        engine.enqueue(EngineRequest("generate", list(b"a"), engine.fresh_data(),
                                     SamplingParams(max_tokens=100000, temperature=0), cancelled=running,
                                     handle="running"))
        engine.enqueue(EngineRequest("generate", list(b"b"), engine.fresh_data(),
                                     SamplingParams(max_tokens=3, temperature=0), cancelled=waiting, handle="waiting"))
        deadline = time.monotonic() + 30
        while not any(handle == "running" and isinstance(e, TokenEvent) for handle, e in list(received)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        waiting.set()  # cancelled while it waits for the slot
        running.set()  # cancelled while it decodes
        engine.wake()
        assert ended.wait(30)
        time.sleep(0.1)  # nothing may follow
        last = {handle: event for handle, event in received}
        assert isinstance(last["running"], Cancelled) and isinstance(last["waiting"], Cancelled)
        assert [handle for handle, event in received if isinstance(event, Cancelled)].count("running") == 1
        assert engine.idle
    finally:
        engine.close()


def test_a_model_error_fails_its_request_and_the_engine_keeps_serving():
    class Fragile(HistoryModel):
        def forward(self, tokens, state):
            if (tokens == ord("!")).any():
                raise RuntimeError("boom")
            return super().forward(tokens, state)

    engine = make_engine(Fragile())

    async def main():
        with pytest.raises(RequestFailed, match="boom") as failed:  # named, as this request's own failure
            await collect(engine, generation(engine, "bad!", max_tokens=3))
        assert failed.value.code == "forward_failed"
        return await collect(engine, generation(engine, "good", max_tokens=3))

    try:
        assert len(run(main())["tokens"][0]) == 3
    finally:
        engine.close()


def test_nothing_to_continue_from_is_refused_at_once():
    engine = make_engine(xl_model())

    async def main():
        with pytest.raises(InvalidInput) as refused:
            local.submit(engine, generation(engine, "", max_tokens=3))
        assert refused.value.param == "prompt"

    try:
        run(main())
        assert engine.idle
    finally:
        engine.close()


def short_reformer() -> Reformer:
    """A Reformer that stops at 256 positions (axial 16 x 16): its max_context."""
    torch.manual_seed(0)
    config = ReformerConfig(attn_layers=["local", "lsh"], d_model=32, n_head=2, d_head=16, d_inner=64, lsh_chunk=8,
                            n_buckets=4, local_chunk=8, axial_pos_shape=[16, 16], axial_pos_dims=[8, 24])
    return Reformer(config).eval()


def test_a_request_past_the_models_context_is_refused_before_it_runs():
    """A model that stops at its max_context (the Reformer): a prompt or append that would take
    the context past it, or a generation with no room for its first token, is refused when it
    is queued (a 400, naming the limit and the length it would reach), nothing runs; up to the
    limit everything runs."""
    engine = make_engine(short_reformer(), prefill_chunk=64)
    assert engine.history_limit == 256

    async def main():
        at_250 = (await local.append(engine, engine.fresh_data(), list(range(250)))).data
        refusals = {
            "append": lambda: local.submit(engine, EngineRequest("append", [1] * 7, at_250)),
            "fresh append": lambda: local.submit(engine, EngineRequest("append", [1] * 257, engine.fresh_data())),
            "session prompt": lambda: local.submit(engine, generation(engine, "x" * 6, start=at_250, max_tokens=4)),
            "prompt": lambda: local.submit(engine, generation(engine, "x" * 256, max_tokens=1)),
        }
        refused = {}
        for name, submit in refusals.items():
            with pytest.raises(ContextLengthExceeded) as error:
                submit()
            refused[name] = error.value
        # exactly at the limit: an append, or a prompt scored without generating
        at_256 = (await local.append(engine, at_250, [1] * 6)).data
        echoed = await collect(engine, generation(engine, "x" * 256, max_tokens=0, echo=True, logprobs=0))
        with pytest.raises(ContextLengthExceeded) as full:  # no room for one more token
            local.submit(engine, generation(engine, "", start=at_256, max_tokens=1))
        return refused, at_256, echoed, full.value

    try:
        refused, at_256, echoed, full = run(main())
        assert engine.idle
    finally:
        engine.close()
    for error in [*refused.values(), full]:
        assert error.code == "context_length_exceeded" and "maximum context length of 256 tokens" in error.message
    assert refused["append"].param == "text" and refused["prompt"].param == "prompt"
    assert "to 257 tokens (250 in the session's history + 7 in the appended text)" in refused["append"].message
    assert "to 257 tokens (257 in the appended text)" in refused["fresh append"].message
    assert "to 257 tokens (250 in the session's history + 6 in the prompt + 1 to generate)" \
        in refused["session prompt"].message
    assert "to 257 tokens (256 in the prompt + 1 to generate)" in refused["prompt"].message
    assert "to 257 tokens (256 in the session's history + 1 to generate)" in full.message
    assert at_256.tokens == 256 and echoed["finished"].prompt_tokens == 256


def test_a_generation_that_reaches_the_models_context_ends_there_with_length():
    """max_tokens past the room left: the generation stops where the context is full, with
    finish_reason "length", every choice alike; a session's new state holds exactly max_context
    tokens, the same as a generation that asked for just that many."""
    engine = make_engine(short_reformer())

    async def main():
        at_250 = (await local.append(engine, engine.fresh_data(), list(range(250)))).data
        session = await collect(engine, generation(engine, "", start=at_250, keep_state=True, max_tokens=16))
        exact = await collect(engine, generation(engine, "", start=at_250, keep_state=True, max_tokens=6))
        plain = await collect(engine, generation(engine, "x" * 250, max_tokens=16, n=2, temperature=1.0, seed=3))
        return session, exact, plain

    try:
        session, exact, plain = run(main())
    finally:
        engine.close()
    assert session["tokens"] == exact["tokens"] and len(session["tokens"][0]) == 6
    assert [c.finish_reason for c in session["finished"].choices] == ["length"]
    assert session["finished"].data.tokens == exact["finished"].data.tokens == 256
    assert [len(t) for t in plain["tokens"]] == [6, 6]
    assert [(c.finish_reason, c.completion_tokens) for c in plain["finished"].choices] == [("length", 6)] * 2


def test_close_fails_what_is_left():
    engine = make_engine(xl_model(), max_batch_size=1)

    async def main():
        running = local.submit(engine, generation(engine, "a", max_tokens=100000))
        events = running.events()
        await events.__anext__()
        await asyncio.to_thread(engine.close)
        with pytest.raises(ShuttingDown):
            async for _ in events:
                pass

    run(main())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_greedy_equals_alone_on_cuda():
    """The same batching on the GPU: one host transfer per step, greedy rows agree with solo runs."""
    engine = make_engine(xl_model().cuda(), prefill_chunk=16)

    async def main():
        alone = [(await collect(engine, generation(engine, p, max_tokens=20)))["tokens"] for p in PROMPTS]
        together = await asyncio.gather(*[collect(engine, generation(engine, p, max_tokens=20)) for p in PROMPTS])
        sampled = await asyncio.gather(*[collect(engine, generation(engine, p, max_tokens=8, temperature=0.8, seed=1,
                                                                    logprobs=2, repetition_penalty=1.1))
                                         for p in PROMPTS])
        return alone, [t["tokens"] for t in together], sampled

    try:
        alone, together, sampled = run(main())
    finally:
        engine.close()
    assert together == alone
    assert all(len(s["tokens"][0]) == 8 for s in sampled)


def thread_counts_seen(model) -> list[tuple[int, int]]:
    """(tokens, intra-op threads) of every forward of `model` from now on, in order."""
    seen = []
    forward = model.forward
    model.forward = lambda tokens, state, lengths=None: (seen.append((tokens.numel(), torch.get_num_threads())),
                                                          forward(tokens, state, lengths=lengths))[1]
    return seen


def test_the_worker_thread_keeps_its_own_torch_threads_and_decodes_few_rows_on_one():
    """torch sets a thread's intra-op count from the process default on first use: the engine's
    worker settles its own, so the default going back to one (as load_models does for every
    other thread) never reaches the model's forward. A forward of fewer than
    PARALLEL_MIN_TOKENS tokens (decoding one row) runs on one thread, a prompt on all."""
    before = torch.get_num_threads()
    model = xl_model()
    seen = thread_counts_seen(model)
    engine = Engine("xl", model, ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery(), threads=2)
    try:
        torch.set_num_threads(1)
        assert engine.threads == 2
        run(collect(engine, generation(engine, "def main():\n", max_tokens=3)))
        assert seen[0] == (12, 2)  # the prompt
        assert seen[1:] and all(call == (1, 1) for call in seen[1:])  # decoding one row
        assert PARALLEL_MIN_TOKENS <= 12
        run(collect(engine, generation(engine, "import os\nimport sys\n", max_tokens=1)))
        assert seen[-1] == (21, 2)  # back to two for the next prompt
    finally:
        engine.close()
        torch.set_num_threads(before)


def test_big_prompt_forwards_run_on_the_prompt_threads():
    """A forward of PROMPT_PARALLEL_TOKENS tokens or more (prompts, batched) runs on
    `prompt_threads`, smaller prompts on `threads`, decode steps of a few rows on one."""
    before = torch.get_num_threads()
    model = xl_model()
    seen = thread_counts_seen(model)
    engine = Engine("xl", model, ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery(), threads=1,
                    prompt_threads=3, prefill_chunk=1024)
    try:
        assert (engine.threads, engine.prompt_threads) == (1, 3)
        run(collect(engine, generation(engine, "x = 1\n" * 50, max_tokens=2)))  # 300 prompt tokens
        run(collect(engine, generation(engine, "def main():\n", max_tokens=1)))
    finally:
        engine.close()
        torch.set_num_threads(before)
    assert PROMPT_PARALLEL_TOKENS <= 300
    assert seen == [(300, 3), (1, 1), (12, 1)]



def test_a_large_model_runs_every_forward_on_the_prompt_threads(monkeypatch):
    """A model of LARGE_MODEL_BYTES of weights or more streams them from memory at every decode
    step, which every core reads faster than one: its decode steps and small prompts run on
    `prompt_threads` too. The threshold is lowered to the test model's size; the shipped-size
    model stays under the real one (the test above decodes it on one thread)."""
    from xlserve.models.quantize import weight_bytes_per_step
    from xlserve.server.engine import threads

    model = xl_model()
    assert 0 < weight_bytes_per_step(model) < threads.LARGE_MODEL_BYTES
    monkeypatch.setattr(threads, "LARGE_MODEL_BYTES", weight_bytes_per_step(model))
    before = torch.get_num_threads()
    seen = thread_counts_seen(model)
    engine = Engine("xl", model, ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery(), threads=1,
                    prompt_threads=3)
    try:
        run(collect(engine, generation(engine, "def main():\n", max_tokens=3)))
    finally:
        engine.close()
        torch.set_num_threads(before)
    assert seen == [(12, 3), (1, 3), (1, 3)]

def test_load_models_shares_the_cores_among_engines_and_keeps_one_for_itself(tmp_path):
    from xlserve.server.engine.process import load_models
    from xlserve.server.settings import EngineSettings
    from tests.e2e.server_process import make_checkpoint

    for name in ("first", "second"):
        make_checkpoint(tmp_path / name)
    before = torch.get_num_threads()
    loaded = load_models(EngineSettings(models=f"{tmp_path / 'first'},{tmp_path / 'second'}", device="cpu",
                                        torch_threads=4, prompt_threads=6), Metrics(), local.SubmissionDelivery())
    try:
        assert [model.engine.threads for model in loaded.values()] == [2, 2]
        assert [model.engine.prompt_threads for model in loaded.values()] == [3, 3]
        assert torch.get_num_threads() == 1  # loading, and every thread that is not an engine's
    finally:
        for model in loaded.values():
            model.engine.close()
        torch.set_num_threads(before)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile over cumulative (le, count) pairs (the lowest bucket's
    lower bound is 0), as the dashboard's batch-size panels compute it."""
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def test_batch_size_quantiles_read_the_true_sizes():
    """Steps of one row read p50 = p99 = 1 (not the 0.5 / 0.99 a bucket starting at 0 gives);
    steps of 3 and 16 rows read between and at their sizes."""
    from xlserve.server.metrics import BATCH_SIZE_BUCKETS

    metrics = Metrics()
    for _ in range(50):
        metrics.batch_size.labels("one").observe(1)
    for size in [16] * 60 + [3] * 40:
        metrics.batch_size.labels("mixed").observe(size)

    def buckets(model):  # the exposition's cumulative (le, count) pairs, +Inf left out
        samples = [sample for family in metrics.registry.collect() for sample in family.samples
                   if sample.name == "xlserve_batch_size_bucket" and sample.labels["model"] == model]
        pairs = sorted((float(s.labels["le"]), s.value) for s in samples if s.labels["le"] != "+Inf")
        assert [bound for bound, _ in pairs] == list(BATCH_SIZE_BUCKETS)
        return pairs

    assert histogram_quantile(0.5, buckets("one")) == pytest.approx(1, abs=1e-3)
    assert histogram_quantile(0.99, buckets("one")) == pytest.approx(1, abs=1e-3)
    assert histogram_quantile(0.99, buckets("mixed")) == pytest.approx(16, abs=1e-3)
    assert 2 < histogram_quantile(0.2, buckets("mixed")) <= 4


def test_a_row_ends_at_the_models_end_of_text_unless_it_ignores_it():
    """A checkpoint's end-of-text token (a converted Mamba's <|endoftext|>) ends a row with
    "stop", as transformers' generate() and vLLM end it: the token is neither sent nor fed, so a
    session holds exactly the text answered, and continues as the one pass over that text. With
    ignore_eos the row goes on through it, as without one. A row of a batch ends alone."""
    model = xl_model()
    drawn = dict(max_tokens=12, temperature=1.0, seed=7)  # a seeded draw: the same tokens in every run
    plain_engine = make_engine(model)
    try:
        plain = run(collect(plain_engine, generation(plain_engine, "hello", **drawn)))
    finally:
        plain_engine.close()
    tokens = plain["tokens"][0]
    # the third distinct token the model draws is its "end of text" here
    end = next(token for token in tokens if tokens.index(token) >= 2 and token not in tokens[:2])
    before = tokens[:tokens.index(end)]

    class EndingBytes(ByteTokenizer):
        stop_token_ids = frozenset({end})

    engine = Engine("m", model, EndingBytes(), Metrics(), sink=local.SubmissionDelivery())

    # a stop string the text before the end of text starts, but never finishes: what the stop
    # checker holds back at the end goes out with the end of text, as at any end but a stop string
    held = bytes(before).decode()[-1] + "\x01"

    async def main():
        ended, other = await asyncio.gather(
            collect(engine, generation(engine, "hello", keep_state=True, **drawn)),
            collect(engine, generation(engine, "other prompt", max_tokens=12, ignore_eos=True)))
        held_back = await collect(engine, generation(engine, "hello", **drawn, stop=[held]))
        going_on = await collect(engine, generation(engine, "hello", **drawn, ignore_eos=True))
        data = ended["finished"].data
        continued = await collect(engine, generation(engine, "x", start=data, max_tokens=4, ignore_eos=True))
        one_pass = await collect(engine, EngineRequest("generate", [*b"hello", *before, *b"x"], engine.fresh_data(),
                                                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
        return ended, other, going_on, continued, one_pass, held_back

    try:
        ended, other, going_on, continued, one_pass, held_back = run(main())
    finally:
        engine.close()
    assert ended["tokens"] == [before] and ended["texts"] == [bytes(before).decode()]
    assert held_back["texts"] == ended["texts"] and held_back["finished"].finish_reason == "stop"
    # the end of text is counted in the usage, as OpenAI and vLLM count it, though neither sent nor fed
    assert ended["finished"].finish_reason == "stop" and ended["finished"].completion_tokens == len(before) + 1
    assert ended["finished"].data.tokens == len(b"hello") + len(before)  # the end of text was not fed
    assert going_on["tokens"] == [tokens] and going_on["finished"].finish_reason == "length"
    assert other["finished"].finish_reason == "length" and len(other["tokens"][0]) == 12
    assert continued["tokens"] == one_pass["tokens"]


def test_an_event_of_one_request_that_does_not_read_ends_that_request_alone():
    """The API process reads each step's events in one frame: an event of one request that does
    not decode (a wire bug, a class this side lacks) ends that request with its own error
    (engine_message_unreadable), and the frame's other events reach their requests; it ended the
    reader, and with it every request, and restarted the engine process."""
    import threading as threading_module

    from xlserve.server.engine.client import EngineClient
    from xlserve.server.engine.errors import RequestFailed
    from xlserve.server.engine.types import Submission
    from xlserve.server.engine.wire import event_to_wire

    async def route():
        client = EngineClient.__new__(EngineClient)  # its routing alone
        good, bad = (Submission("m", Metrics(), threading_module.Event()) for _ in range(2))
        client.submissions = {1: good, 2: bad}
        client.status, sent = "ready", []
        client.writer = type("Writer", (), {"write": lambda self, frame: sent.append(frame)})()
        client.frames_behind = None  # no large frame going out
        token = TokenEvent(104, "h", -0.5, [])
        client._route([event_to_wire(1, token), [2, "no such kind", 1, 2]])
        return good.queue.get_nowait(), bad.queue.get_nowait(), client.submissions, sent

    first, failed, left, sent = asyncio.run(route())
    assert isinstance(first, TokenEvent) and first.text == "h"
    assert isinstance(failed, RequestFailed) and failed.code == "engine_message_unreadable"
    assert list(left) == [1]  # the failed request is no longer waited for
    assert len(sent) == 1  # and the engine is told to stop it (a Cancel frame)
