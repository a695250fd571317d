"""One request can never hurt another in the engine (in process, server/engine/local.py): a
victim generation runs in the same batch as each poison request (a vanishing temperature or
top_p, a seed at either end of the 64-bit range, a state or next-token row holding NaN, a row
whose forward raises, a logit_bias outside the vocabulary) and gets exactly the tokens and
log-probabilities it gets alone; the poison request gets a defined answer or its own clear
error (a session's own poisoned state: 422 state_not_usable, the client's to replace; the same
in a state the server made: internal), and the engine goes on serving."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import pytest
import torch

from xlserve.models.tokenizer import ByteTokenizer
from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig
from xlserve.server.cache.codec import SessionData
from xlserve.server.engine import local
from xlserve.server.engine.errors import InvalidInput, RequestFailed, StateNotUsable
from xlserve.server.engine.request import EngineRequest
from xlserve.server.engine.scheduler import Engine
from xlserve.server.engine.types import ChoiceFinished, Finished, SamplingParams, TokenEvent
from xlserve.server.metrics import Metrics

MARKER = ord("~")  # the token a FragileModel refuses to run
VICTIM_PROMPT = "def main(argv):\n    "
VICTIM = dict(max_tokens=12, temperature=0.8, seed=7, logprobs=2)  # sampled: its generator must be untouched too


class FragileModel(TransformerXL):
    """A Transformer-XL whose forward raises on a batch holding MARKER, and which records the
    batch size of every forward that raised."""

    def __init__(self, config):
        super().__init__(config)
        self.raised_batches: list[int] = []

    def forward(self, tokens, state, lengths=None):
        if bool((tokens == MARKER).any()):
            self.raised_batches.append(tokens.shape[0])
            raise RuntimeError("this model cannot run '~'")
        return super().forward(tokens, state, lengths=lengths)


def model() -> FragileModel:
    torch.manual_seed(0)
    config = TransformerXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=24)
    return FragileModel(config).eval()


@pytest.fixture
def engine():
    engine = Engine("m", model(), ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery())
    yield engine
    engine.close()


def request(engine: Engine, prompt: str, start: SessionData | None = None, keep_state: bool = False,
            **params) -> EngineRequest:
    return EngineRequest("generate", list(prompt.encode()), start or engine.fresh_data(), SamplingParams(**params),
                         keep_state=keep_state)


async def outcome(submission) -> dict:
    """Tokens and log-probabilities per choice, and how it ended: the Finished event or the error."""
    tokens, logprobs, ended = {}, {}, None
    try:
        async for event in submission.events():
            if isinstance(event, TokenEvent):
                tokens.setdefault(event.index, []).append(event.token)
                logprobs.setdefault(event.index, []).append(event.logprob)
            elif isinstance(event, (Finished, ChoiceFinished)):
                ended = event
    except Exception as error:  # the request's own error event
        ended = error
    return {"tokens": [tokens[i] for i in sorted(tokens)], "logprobs": [logprobs[i] for i in sorted(logprobs)],
            "ended": ended}


async def together(engine: Engine, *requests: EngineRequest) -> list[dict]:
    """Run requests admitted at the same step (the engine admits under its lock, held here while
    they are queued), so they prefill and decode in one batch."""
    with engine._condition:
        submissions = [local.submit(engine, r) for r in requests]
    return list(await asyncio.gather(*(outcome(s) for s in submissions)))


def alone(engine: Engine, r: EngineRequest) -> dict:
    return asyncio.run(together(engine, r))[0]


def assert_unharmed(victim: dict, expected: dict) -> None:
    assert isinstance(victim["ended"], Finished), victim["ended"]
    assert victim["tokens"] == expected["tokens"]
    for got, want in zip(victim["logprobs"], expected["logprobs"]):
        assert got == pytest.approx(want, abs=1e-4)  # a batched forward rounds differently


def run_beside_victim(engine: Engine, poison: EngineRequest) -> dict:
    """The poison's outcome, after checking that the victim beside it was unharmed."""
    expected = alone(engine, request(engine, VICTIM_PROMPT, **VICTIM))
    victim, poisoned = asyncio.run(together(engine, request(engine, VICTIM_PROMPT, **VICTIM), poison))
    assert_unharmed(victim, expected)
    after = alone(engine, request(engine, VICTIM_PROMPT, **VICTIM))  # and the engine serves on
    assert_unharmed(after, expected)
    return poisoned


def greedy_tokens(engine: Engine, prompt: str, max_tokens: int) -> list[int]:
    return alone(engine, request(engine, prompt, max_tokens=max_tokens, temperature=0))["tokens"][0]


def session_after(engine: Engine, prompt: str) -> SessionData:
    """The session data after a prompt (an append), to build poisoned states from."""

    async def feed():
        return (await local.append(engine, engine.fresh_data(), list(prompt.encode()))).data

    return asyncio.run(feed())


# -- sampling parameters at the edges: defined answers, nobody hurt -----------------------------


@pytest.mark.parametrize("params", [
    dict(temperature=1e-45), dict(temperature=1e-46),
    dict(temperature=1.0, top_p=1e-45), dict(temperature=1.0, top_p=1e-46),  # 1e-46 is 0 in float32, as the row is
    dict(temperature=5e-6, top_p=0.5), dict(temperature=1.0, top_p=1e-6, top_k=3),
])
def test_vanishing_temperature_or_top_p_is_greedy_and_harms_nobody(engine, params):
    poisoned = run_beside_victim(engine, request(engine, "import os\n", max_tokens=8, **params))
    assert isinstance(poisoned["ended"], Finished)
    assert poisoned["tokens"][0] == greedy_tokens(engine, "import os\n", 8)


@pytest.mark.parametrize("seed", [2**64 - 1, 0])
def test_seeds_at_the_ends_of_the_64_bit_range_work_and_harm_nobody(engine, seed):
    poisoned = run_beside_victim(engine, request(engine, "import os\n", max_tokens=8, temperature=1.0, seed=seed, n=2))
    assert isinstance(poisoned["ended"], Finished)
    again = alone(engine, request(engine, "import os\n", max_tokens=8, temperature=1.0, seed=seed, n=2))
    assert again["tokens"] == poisoned["tokens"]  # reproducible
    # choice i draws from seed + i modulo 2**64: choice 1 of the largest seed is choice 0 of seed 0
    wrapped = alone(engine, request(engine, "import os\n", max_tokens=8, temperature=1.0, seed=(seed + 1) % 2**64))
    assert wrapped["tokens"][0] == poisoned["tokens"][1]


# -- poisoned states: their request fails alone -------------------------------------------------


def nan_in_its_keys(data: SessionData) -> SessionData:
    """`data` with one NaN in its second layer's keys: a state no model makes."""
    keys = [k.clone() for k in data.state.keys]
    keys[1][0, 3] = float("nan")
    return SessionData(dataclasses.replace(data.state, keys=keys), data.tokens, data.next_log_probs)


def test_a_nan_state_fails_its_request_alone(engine):
    session = nan_in_its_keys(session_after(engine, "import sys\n"))
    poisoned = run_beside_victim(engine, request(engine, "x = ", session,
                                                 keep_state=True, max_tokens=6, temperature=0.7, seed=1))
    # a session's state is the client's (import, PUT): its non-finite values are a 4xx, not a 500
    assert isinstance(poisoned["ended"], StateNotUsable) and poisoned["ended"].code == "state_not_usable"
    assert poisoned["ended"].http_status == 422
    assert "NaN" in poisoned["ended"].message
    assert poisoned["tokens"] == []  # it failed before its first token: nothing sampled from NaN


def test_the_same_nan_state_outside_a_session_is_the_servers_fault(engine):
    # a stateless request starts from a state the server made (fresh, or the prefix cache's):
    # non-finite values there are a server fault, answered as internal
    session = nan_in_its_keys(session_after(engine, "import sys\n"))
    poisoned = run_beside_victim(engine, request(engine, "x = ", session,
                                                 max_tokens=6, temperature=0.7, seed=1))
    assert isinstance(poisoned["ended"], RequestFailed) and poisoned["ended"].code == "sampling_failed"
    assert poisoned["ended"].internal


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_next_token_row_fails_its_request_alone(engine, bad):
    data = session_after(engine, "import sys\n")
    row = data.next_log_probs.clone()
    row[5] = bad
    poisoned = run_beside_victim(engine, request(engine, "", SessionData(data.state, data.tokens, row),
                                                 keep_state=True, max_tokens=6))
    assert isinstance(poisoned["ended"], StateNotUsable) and poisoned["ended"].code == "state_not_usable"
    assert poisoned["tokens"] == []


def test_a_row_that_allows_no_token_fails_alone(engine):
    data = session_after(engine, "import sys\n")
    everything_banned = {token: float("-inf") for token in range(256)}
    poisoned = run_beside_victim(engine, request(engine, "", data, max_tokens=4, temperature=0.9,
                                                 logit_bias=everything_banned))
    assert isinstance(poisoned["ended"], RequestFailed) and poisoned["ended"].code == "sampling_failed"


def test_a_logit_bias_outside_the_vocabulary_fails_alone(engine):
    poisoned = run_beside_victim(engine, request(engine, "import os\n", max_tokens=4, temperature=0.9,
                                                 logit_bias={256: 5.0}))
    assert isinstance(poisoned["ended"], InvalidInput) and poisoned["ended"].param == "logit_bias"


# -- a forward that raises for one row ---------------------------------------------------------


def test_a_decode_forward_that_raises_fails_only_its_row(engine):
    # logit_bias forces MARKER as the first token: the step that feeds it back raises
    poisoned = run_beside_victim(engine, request(engine, "import os\n", max_tokens=6, temperature=0,
                                                 logit_bias={MARKER: 100.0}))
    assert isinstance(poisoned["ended"], RequestFailed) and poisoned["ended"].code == "forward_failed"
    assert "cannot run" in poisoned["ended"].message
    assert poisoned["tokens"] == [[MARKER]]
    assert 2 in engine.model.raised_batches  # it did raise in a batch beside the victim, which then ran alone


def test_a_prefill_forward_that_raises_fails_only_its_request(engine):
    poisoned = run_beside_victim(engine, request(engine, "a ~ b", max_tokens=6, temperature=0))
    assert isinstance(poisoned["ended"], RequestFailed) and poisoned["ended"].code == "forward_failed"
    assert 2 in engine.model.raised_batches


def test_one_failing_choice_fails_its_request_but_not_the_victim(engine):
    # two choices of one request: the first to draw MARKER takes its whole request down, alone
    bias = {MARKER: 100.0}
    poisoned = run_beside_victim(engine, request(engine, "import os\n", max_tokens=6, temperature=1.0, seed=3, n=2,
                                                 logit_bias=bias))
    assert isinstance(poisoned["ended"], RequestFailed)


# -- logit_bias --------------------------------------------------------------------------------


def test_logit_bias_steers_sampling_and_reports_the_models_own_logprobs(engine):
    plain = alone(engine, request(engine, "import os\n", max_tokens=4, temperature=0, logprobs=1))
    biased = alone(engine, request(engine, "import os\n", max_tokens=4, temperature=0, logprobs=1,
                                   logit_bias={ord("Z"): 100.0}))
    assert biased["tokens"][0] == [ord("Z")] * 4
    assert plain["tokens"][0] != biased["tokens"][0]
    # the reported log-probability is the model's own: far below 0 for a byte it does not expect
    assert all(logprob < -0.5 for logprob in biased["logprobs"][0])
    banned = alone(engine, request(engine, "import os\n", max_tokens=4, temperature=0,
                                   logit_bias={plain["tokens"][0][0]: -100.0}))
    assert banned["tokens"][0][0] != plain["tokens"][0][0]


def test_logit_bias_survives_the_wire():
    """SamplingParams cross to the engine process as JSON (server/engine/client.py sends
    dataclasses.asdict, server/engine/process.py rebuilds them), whose object keys are strings."""
    sent = SamplingParams(temperature=0.5, logit_bias={65: 3.0, 7: -1.5})
    received = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(sent))))
    assert received == sent and received.logit_bias == {65: 3.0, 7: -1.5}
    assert SamplingParams(**json.loads(json.dumps(dataclasses.asdict(SamplingParams())))).logit_bias is None


def test_a_failed_request_crosses_the_wire_and_maps_to_its_own_error():
    """The engine process sends the error by name (server/engine/wire.py); the API process maps
    it to one status and body (server/api/errors.py ERROR_KINDS), keeping its code."""
    from xlserve.server.api.errors import as_api_error
    from xlserve.server.engine.wire import error_from_wire, error_to_wire

    sent = RequestFailed("its row holds NaN", code="sampling_failed")
    received = error_from_wire(json.loads(json.dumps(error_to_wire(sent))))
    assert isinstance(received, RequestFailed) and received.code == "sampling_failed"
    api_error = as_api_error(RequestFailed("its forward raised", code="forward_failed"))
    assert api_error.status == 500 and api_error.code == "forward_failed"
    assert api_error.body()["error"]["message"] == "its forward raised"


def test_a_request_whose_choices_fail_in_separate_groups_ends_once():
    """n=2 with one row per batch: each choice's forward raises in its own group, and the request
    was failed once per group, so the sink got two last events for it."""
    events, ended = [], threading.Event()

    def sink(items):
        events.extend(items)
        if any(isinstance(event, BaseException) for _, event in items):
            ended.set()

    engine = Engine("m", model(), ByteTokenizer(), Metrics(), sink=sink, max_batch_size=1)
    try:
        engine.enqueue(EngineRequest("generate", list(b"hello"), engine.fresh_data(),
                                     SamplingParams(max_tokens=4, temperature=0, n=2, logit_bias={MARKER: 100.0}),
                                     handle="R"))
        assert ended.wait(30)
        deadline = time.monotonic() + 5
        while not engine.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.idle
    finally:
        engine.close()
    last = [event for handle, event in events if handle == "R" and isinstance(event, (BaseException, Finished))]
    assert len(last) == 1 and isinstance(last[0], RequestFailed) and last[0].code == "forward_failed", events


# -- a request's own end of step that raises ---------------------------------------------------

CARET = ord("^")  # the token whose detokenizer end raises (FragileEndTokenizer)


class FragileEndTokenizer(ByteTokenizer):
    """Bytes, whose detokenizer raises at the end of a text holding '^' (a detokenizer's flush
    that fails for one request's text)."""

    def detokenizer(self, context=(), continues=False):
        inner = super().detokenizer(context, continues)

        class Fragile:
            seen = False

            def push(self, token: int) -> str:
                self.seen = self.seen or token == CARET
                return inner.push(token)

            def flush(self) -> str:
                if self.seen:
                    raise UnicodeError("this detokenizer cannot end a text holding '^'")
                return inner.flush()

        return Fragile()


def test_a_request_whose_own_end_raises_fails_alone_and_the_batch_goes_on():
    """A failure in one request's work after the forward (here its detokenizer's end, as a state
    copy that runs out of memory would be) fails that request alone with finish_failed; it used
    to reach the step's catch-all and fail every request in the batch."""
    engine = Engine("m", model(), FragileEndTokenizer(), Metrics(), sink=local.SubmissionDelivery())
    try:
        poisoned = run_beside_victim(engine, request(engine, "import os\n", max_tokens=2, temperature=0,
                                                     logit_bias={CARET: 100.0}))
    finally:
        engine.close()
    assert isinstance(poisoned["ended"], RequestFailed) and poisoned["ended"].code == "finish_failed"
    assert "cannot end a text" in poisoned["ended"].message


@pytest.mark.parametrize("keeps", ["session", "prefix-cache offer"])
def test_a_kept_state_that_cannot_be_copied_out_of_its_batch_fails_its_request_alone(monkeypatch, keeps):
    """A session row of a batch whose state class keeps idle places (a fixed-shape state: Mamba's)
    ends while another row decodes on: its final state is copied out of the batch, and a copy that
    runs out of memory fails that request alone, 503 device_out_of_memory, not the row beside. A
    row whose state only a prefix-cache offer wanted finishes as it would: its answer was sent,
    and only the offer goes."""
    from tests.server.test_cache_architectures import tiny_model
    from xlserve.models.mamba import SelectiveState
    from xlserve.server.engine.errors import DeviceOutOfMemory

    engine = Engine("m", tiny_model("mamba"), ByteTokenizer(), Metrics(), sink=local.SubmissionDelivery())
    clone = SelectiveState.clone

    def out_of_memory_for_batch_rows(state):
        if getattr(state, "_from_batch", False):
            raise torch.OutOfMemoryError("no room for the copy")
        return clone(state)

    split = SelectiveState.split

    def marked_split(state):
        parts = split(state)
        for part in parts:
            object.__setattr__(part, "_from_batch", state.batch_size > 1)
        return parts

    monkeypatch.setattr(SelectiveState, "clone", out_of_memory_for_batch_rows)
    monkeypatch.setattr(SelectiveState, "split", marked_split)
    try:
        victim_params = dict(max_tokens=8, temperature=0.8, seed=7)
        expected = alone(engine, request(engine, VICTIM_PROMPT, **victim_params))
        poison = request(engine, "x = ", engine.fresh_data(), keep_state=keeps == "session", max_tokens=2,
                         temperature=0)
        if keeps != "session":
            poison.prefix_scope = b"scope"  # its final state is offered to the prefix cache
        victim, poisoned = asyncio.run(together(engine, request(engine, VICTIM_PROMPT, **victim_params), poison))
    finally:
        engine.close()
    assert victim["tokens"] == expected["tokens"] and isinstance(victim["ended"], Finished)
    if keeps == "session":
        assert isinstance(poisoned["ended"], DeviceOutOfMemory)
    else:
        assert isinstance(poisoned["ended"], Finished) and len(poisoned["tokens"][0]) == 2


def test_a_choice_streams_the_text_that_follows_its_prompt_or_its_session():
    """A word-level model (transfo-xl-wt103's kind) puts no space before a line's first word, so
    a choice whose detokenizer started from nothing streamed "The cat" + "sat": the engine starts
    each choice's detokenizer after the prompt's last tokens, or after the session's text when
    the prompt is empty. Prompt + streamed text is then one decode of every token."""
    from xlserve.models.tokenizer import WordTokenizer
    from tests.server.test_cache_architectures import tiny_model

    words = WordTokenizer([f"w{i}" for i in range(255)] + ["<eos>"])
    engine = Engine("m", tiny_model("transformer-xl"), words, Metrics(), sink=local.SubmissionDelivery())

    def streamed(prompt: list[int], start: SessionData, keep: bool = False, **params) -> tuple[list[int], str]:
        texts, tokens = [], []

        async def run():
            async for event in local.submit(engine, EngineRequest("generate", prompt, start, SamplingParams(**params),
                                                                  keep_state=keep)).events():
                if isinstance(event, TokenEvent):
                    tokens.append(event.token)
                    texts.append(event.text)
                elif isinstance(event, ChoiceFinished):
                    texts.append(event.text_tail)

        asyncio.run(run())
        return tokens, "".join(texts)

    try:
        prompt = words.encode("w1 w2 w3")
        for seed in range(4):
            tokens, text = streamed(prompt, engine.fresh_data(), max_tokens=6, temperature=1.0, seed=seed)
            assert words.decode(prompt) + text == words.decode(prompt + tokens), (tokens, text)
            if tokens[0] != words.eos_id:
                assert text.startswith(" "), text
        # a session's next turn with an empty prompt: its first word follows the session's text
        session = asyncio.run(local.append(engine, engine.fresh_data(), prompt)).data
        for seed in range(4):
            tokens, text = streamed([], session, max_tokens=3, temperature=1.0, seed=seed, keep=True)
            assert text == words.decode([words.index["w1"], *tokens])[len("w1"):], (tokens, text)
    finally:
        engine.close()
