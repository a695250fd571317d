"""A request in the engine: what its caller asks, and how far the scheduler has come with it
(engine process, or any process that runs an `Engine` itself).

`EngineRequest` is the one way into an engine (`Engine.enqueue`): a generation, or an append that
feeds a document chunk into a session. Its caller fills in the first fields; the scheduler fills
in the rest while the request runs, in its worker thread only. A request is queued once.

A generation decodes `params.n` choices, each a `Row` of the running batch: its sampler, its
stop strings, its text and, between steps, its state.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from xlserve.models.interface import State
from xlserve.server.cache.codec import SessionData
from xlserve.server.engine.constraints import ParserDebt, RowConstraint
from xlserve.server.engine.sampling import Sampler, StopChecker, is_plain_greedy, most_likely
from xlserve.server.engine.types import ChoiceFinished, SamplingParams


@dataclass(eq=False)
class EngineRequest:
    kind: str  # "generate" or "append" (feed `prompt` into the session, generate nothing)
    prompt: list[int]
    start: SessionData  # the session as committed; the request never changes it
    params: SamplingParams = field(default_factory=SamplingParams)
    keep_state: bool = False  # a session generation: every generated token goes into the new state
    score: bool = False  # an append that sums the log-probabilities of its tokens
    cancelled: threading.Event = field(default_factory=threading.Event)  # set: drop it at the next step
    handle: object = None  # the caller's name for it, handed back with each of its events
    # whose it is (the API key's owner id; None without keys): each step's prefill budget is
    # shared among owners first, then among one owner's requests (Engine._prefill_plan)
    owner: str | None = None
    # the prefix-state cache (server/cache/prefix_cache.py): the scope its states are offered
    # under (None: a session's request, or one that opted out), and how many prompt tokens a
    # hit already put into `start` (with their log-probs, None for a first token)
    prefix_scope: bytes | None = None
    # whether its state after the completion goes to the cache too (not for a model whose entries
    # hold only where prefill chunks end: Engine.start_from_prefix)
    final_state_offered: bool = True
    reused: int = 0
    reused_logprobs: list[float | None] = field(default_factory=list, repr=False)
    # the bytes of that hit's state, which the request holds until it runs (Engine.start_from_prefix
    # bounds what the waiting requests hold together)
    hit_bytes: int = 0
    # its structured-output constraint, compiled (an llguidance LLMatcher, server/engine/constraints.py),
    # set by Engine.enqueue; each row decodes with a copy of its own
    constraint: object = field(default=None, repr=False)

    # -- the scheduler's bookkeeping (worker thread) --
    state: State = field(init=False, repr=False)  # the state after the prompt tokens fed so far
    tokens: int = field(init=False)  # tokens that state has seen
    next_log_probs: torch.Tensor | None = field(init=False, repr=False)  # predicts the next token; None: no context
    fed: int = field(init=False, default=0)  # prompt tokens run through the model so far
    # the engine's prefill step in which its prompt last got tokens (-1: never): who goes first
    # when the step's prefill budget is shared (Engine._prefill_plan)
    prefill_turn: int = field(init=False, default=-1)
    prompt_top_k: int | None = field(init=False)  # echo with logprobs: alternatives per prompt token
    prompt_logprobs: list[float | None] = field(init=False, default_factory=list)
    prompt_top: list[list[tuple[int, float]]] = field(init=False, default_factory=list)
    rows: list[Row] = field(init=False, default_factory=list)  # its choices, once the prompt is in
    done: list[ChoiceFinished] = field(init=False, default_factory=list)
    failed: bool = field(init=False, default=False)
    # its constrained rows' parser time past the limit, shared by them all (constraints.py ParserDebt)
    parser_debt: ParserDebt = field(init=False, default_factory=ParserDebt, repr=False)
    # time.monotonic() at its phases' starts (the queue, prefill and decode time histograms)
    queued_at: float | None = field(init=False, default=None)  # enqueued
    scheduled_at: float | None = field(init=False, default=None)  # first admitted into the running batch
    first_token_at: float | None = field(init=False, default=None)  # first token (or an append's result)

    def __post_init__(self):
        self.prompt = list(self.prompt)
        self.state, self.tokens, self.next_log_probs = self.start.state, self.start.tokens, self.start.next_log_probs
        echo = self.kind == "generate" and self.params.echo and self.params.logprobs is not None
        self.prompt_top_k = self.params.logprobs if echo else None
        if self.reused:  # a prefix-cache hit: the prompt's first `reused` tokens are in the state
            if self.start.tokens != self.reused or len(self.reused_logprobs) != self.reused or self.prompt_top_k:
                raise ValueError("a prefix hit needs its state, its tokens' log-probs and no prompt alternatives")
            self.fed = self.reused
            self.prompt_logprobs = list(self.reused_logprobs)
            if self.prompt_top_k is not None:
                self.prompt_top = [[] for _ in range(self.reused)]

    @property
    def width(self) -> int:
        """Batch rows it takes."""
        return self.params.n if self.kind == "generate" else 1

    @property
    def share_key(self) -> object:
        """Whose share it counts against (each step's prefill budget, the batch's rows): its owner,
        or the request itself when it has none."""
        return self if self.owner is None else self.owner

    @property
    def cached_tokens(self) -> int:
        """Context that came from memory: the session's, or a prefix-cache hit's."""
        return self.start.tokens

    @property
    def offers_final_state(self) -> bool:
        """Its state after prompt + completion goes to the prefix cache (the next turn of a
        conversation starts there), so its last generated token is fed too, as a session's is."""
        return (self.prefix_scope is not None and self.final_state_offered and self.kind == "generate"
                and self.params.n == 1)

    @property
    def continues_session(self) -> bool:
        """It starts from a session's stored state (a session generation, or an append, on a
        session that has seen tokens), which a client can set (import, PUT): non-finite values
        from it are that state's, not the server's. A session that has seen nothing starts from
        a fresh state, as a stateless request does."""
        return (self.keep_state or self.kind == "append") and self.start.tokens > 0

    @property
    def feeds_every_token(self) -> bool:
        """Every generated token, the last one included, goes through the model."""
        return self.keep_state or self.offers_final_state


class Row:
    """One choice being decoded. `state` is its own state between steps, or None while it lives
    inside a batch (server/engine/batch.py); `pending` is the sampled token still to be fed."""

    def __init__(self, request: EngineRequest, index: int, detokenizer, state: State, next_log_probs: torch.Tensor):
        params = request.params
        self.request, self.index = request, index
        self.sampler = Sampler(params, request.prompt, index)
        self.detokenizer = detokenizer
        self.stops = StopChecker(params.stop)
        self.state: State | None = state
        self.next_log_probs = next_log_probs  # (V,) on the model's device: predicts the next token
        self.host_log_probs = next_log_probs.float().cpu()  # the same on the CPU, for sampling
        # (argmax, its log-prob) of host_log_probs, computed for the whole batch after each step:
        # the token of a plain greedy row, and whether the row can be sampled from at all
        self.greedy: tuple[int, float] = most_likely(self.host_log_probs)
        self.tokens = request.tokens  # tokens the state has seen
        # its own matcher: choices, and the prompts of a batched request, never share parser state
        self.constraint = (None if request.constraint is None else
                           RowConstraint(request.constraint, next_log_probs.shape[-1], request.parser_debt))
        self.plain_greedy = is_plain_greedy(params) and self.constraint is None
        self.generated = 0
        # it ended at the model's end of text, a token neither sent nor fed but counted in the usage
        self.drew_end_of_text = False
        self.generated_tokens: list[int] = []  # with their log-probs: a prefix-cache entry's tail
        self.generated_logprobs: list[float] = []
        self.pending: int | None = None
        self.finish_reason: str | None = None
        # it ended at a stop string: the text held back was that string's start, and goes (any
        # other end, the model's end of text or a constraint's included, sends what is held back)
        self.stopped_by_string = False
        # its final state could not be taken out of its batch (batch.py `_leave`: a copy that ran
        # out of memory): its request fails alone when the row finishes
        self.state_error: BaseException | None = None

    @property
    def keeps_state(self) -> bool:
        """Its final state outlives the batch: a session's new state, or a prefix-cache entry (not
        for a request cancelled or failed: nothing will use it)."""
        return self.request.feeds_every_token and not self.request.failed and not self.request.cancelled.is_set()
