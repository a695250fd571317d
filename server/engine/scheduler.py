"""The engine: one scheduler per model, continuous batching, tokens streamed back (engine
process; in tests and benchmarks, any process that builds one).

Each loaded model gets one `Engine`. Requests come in through `Engine.enqueue` (an
`EngineRequest`, server/engine/request.py). Its step loop runs in a worker thread and, at every
step:

1. admits waiting requests into the running batch, up to `max_batch_size` rows (a request with
   n choices takes n rows), and drops cancelled ones (client gone, explicit cancel): a cancelled
   request leaves the batch within one step;
2. prefills prompts in chunks of at most `prefill_chunk` tokens, about one chunk's worth per
   step in all, so a long prompt delays running streams by one chunk per step instead of
   stalling them; prompt chunks run as one batch, right-padded, where the model takes rows of
   different lengths (`LanguageModel.ragged_chunks`), else one batch per chunk length. The
   step's budget is shared fairly among the prompts being prefilled (`_prefill_plan`), so a
   short prompt's first token never waits behind a long prompt's whole prefill;
3. samples one token for every decoding row (each with its own generator, penalties and stop
   strings), sends the tokens out, and then runs all those tokens through the model in batched
   forwards of shape (B, 1): decoding is incremental, each row's state carries its context.
   Which rows share a forward, and how rows join and leave a running batch, is
   server/engine/batch.py; how many threads each forward runs on, server/engine/threads.py.

A request never touches the session it came from: it starts from the committed `SessionData`
and ends with a new one in `Finished.data`, which the caller commits only when it has the whole
answer. Cancel, disconnect or error -> nothing to commit, the session is as it was.

Every request ends with exactly one last event: Finished, Appended, or an exception (Cancelled
included). Each step's events go to the `sink` given at construction, as one list of
(request.handle, event) pairs: the engine process writes them to the API process in one frame;
code that runs an engine in its own process hands them to the asyncio loop of each request's
`Submission` (`SubmissionDelivery`, server/engine/local.py).

One request's trouble is its own. A failure while sampling or computing one request's row
(a row that is no distribution, a sampler that raises, a forward that raises for that row)
ends that request alone with an error event (RequestFailed, or the EngineError raised), and
the batch goes on for everyone else: when a batched forward raises, its rows run again one by
one and only those whose own forward fails are failed. States are values (a forward never
changes its input), so running a row again is safe.

A model that stops at its max_context (`LanguageModel.history_limit`, the Reformer's) bounds
every request's context: `enqueue` refuses one whose history and prompt (and a generation's
first token) would pass it with `ContextLengthExceeded` (a 400), before anything runs, and a
generation that reaches it ends there with finish_reason "length", as at max_tokens.

The queue is bounded: beyond `max_batch_size` running rows, at most `max_queued` requests wait,
and at most `max_queued_per_key` of one API key's where that is set; `enqueue` refuses more with
`QueueFull`. After `stop_admitting` (graceful shutdown) it refuses
everything with `ShuttingDown` while running requests finish.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import numpy as np
import torch

from xlserve.models.allocation import out_of_memory
from xlserve.models.interface import LanguageModel, State, rows_and_scores
from xlserve.models.quantize import weight_bytes_per_step
from xlserve.server.cache.codec import SessionData
from xlserve.server.cache.prefix_cache import PrefixCache, decode_entry
from xlserve.server.engine.batch import BatchLayout, Group
from xlserve.server.engine.constraints import NO_ALLOWED_TOKEN, ConstraintCompiler
from xlserve.server.engine.errors import (
    Cancelled,
    ContextLengthExceeded,
    DeviceOutOfMemory,
    EngineError,
    EngineGone,
    InvalidInput,
    QueueFull,
    RequestFailed,
    ShuttingDown,
)
from xlserve.server.engine.request import EngineRequest, Row
from xlserve.server.engine.sampling import most_likely, top_alternatives, unusable_row
from xlserve.server.engine.threads import ForwardThreads
from xlserve.server.engine.types import Appended, ChoiceFinished, Finished, PromptLogprobs, TokenEvent
from xlserve.server.metrics import Metrics

log = logging.getLogger("xlserve.engine")

# where an engine's events go: called from its worker thread once per step with that step's
# (request.handle, event) pairs, in order; it must not block for long (the step waits for it)
EventSink = Callable[[list[tuple[object, object]]], None]


class _Admission:
    """What the queue's limits read of a request not yet built (`Engine.check_admitted`)."""

    def __init__(self, width: int, owner: str | None):
        self.width, self.owner, self.cancelled = width, owner, threading.Event()


class Engine:
    """One model's scheduler: a queue of `EngineRequest`s and the worker thread that steps them."""

    def __init__(self, name: str, model: LanguageModel, tokenizer, metrics: Metrics, sink: EventSink,
                 prefill_chunk: int = 512, max_batch_size: int = 64, max_queued: int = 256, max_queued_per_key: int = 0,
                 threads: int = 0,
                 prompt_threads: int = 0, prefix_cache: PrefixCache | None = None,
                 constraint_cache_size: int = 256, constraint_compile_seconds: float = 5.0,
                 constraint_token_seconds: float = 0.005,
                 weights_identity: bytes = b"", on_loop_failure: Callable[[BaseException], None] | None = None):
        self.name = name
        # called (on the worker thread) when the step loop itself failed and stopped: every request
        # of this engine has been failed with EngineGone and new ones are refused; the engine
        # process exits there, so that the server starts a new one (process.py)
        self.on_loop_failure = on_loop_failure
        self._broken: BaseException | None = None  # the step loop's own failure, once it stopped
        # mixed into every prefix scope: entries shared through Redis name the weights that made
        # them (process.py `weights_identity`; empty where entries never outlive this process)
        self.weights_identity = weights_identity
        # structured output: constraints compiled once per distinct text, cached with a bound, over
        # the model's vocabulary (the logits' width, which may pass the tokenizer's: padded rows)
        self.constraints = ConstraintCompiler(tokenizer, name, constraint_cache_size, constraint_compile_seconds,
                                              vocab_size=model.vocab_size)
        # the parser time a constrained row may take for one token (0: no limit); past it the row's
        # request ends alone (server/engine/constraints.py, "Cost")
        self.constraint_token_seconds = constraint_token_seconds
        self.prefix_cache = prefix_cache
        self.model = model
        # the longest context a request may reach, where the model stops (None: no such bound):
        # refused past it when queued (check_context), generation ends there (_sample)
        self.history_limit = model.history_limit
        self.tokenizer = tokenizer
        # the checkpoint's end-of-text tokens (models/tokenizer.py): a row that draws one ends there
        self.stop_token_ids = tokenizer.stop_token_ids
        self.metrics = metrics
        self.prefill_chunk = max(1, prefill_chunk)
        self.max_batch_size = max(1, max_batch_size)
        self.max_queued = max(0, max_queued)
        # requests one owner (API key) may have waiting; 0: no bound but max_queued
        self.max_queued_per_key = max(0, max_queued_per_key)
        self._condition = threading.Condition()
        self._waiting: deque[EngineRequest] = deque()  # guarded by _condition
        self._running: list[EngineRequest] = []  # worker thread only
        self._running_rows = 0  # guarded by _condition
        self._admitting = True
        self._closed = False
        self.layout = BatchLayout(self.max_batch_size)  # worker thread only
        # a CPU model's steps stream its weights from memory, which more cores read faster; on a
        # GPU the CPU only launches kernels, and the API process keeps its core
        on_cpu = model.device.type == "cpu"
        self.forward_threads = ForwardThreads(threads, prompt_threads, weight_bytes_per_step(model) if on_cpu else 0)
        self._outbox: list[tuple[object, object]] = []  # (handle, event) of the current step
        self._prefill_steps = 0  # steps that looked for prompts to prefill: EngineRequest.prefill_turn's clock
        self._last_step_finished_only = False  # the last prefill step fed only prompts it could finish
        # when the step under way began (time.monotonic), None between steps: the heartbeat
        # thread reads it (step_seconds) so that a step that never returns is noticed
        self._step_started_at: float | None = None
        self._sink = sink
        self._waiting_metric = metrics.requests_waiting.labels(name)
        self._running_metric = metrics.requests_running.labels(name)
        self._generated_metric = metrics.generation_tokens.labels(name)
        self._prompt_metric = metrics.prompt_tokens.labels(name)
        self._batch_metric = metrics.batch_size.labels(name)
        self._queue_time_metric = metrics.request_queue_time.labels(name)
        self._prefill_time_metric = metrics.request_prefill_time.labels(name)
        self._prefill_tokens_metric = metrics.prefill_tokens.labels(name)
        self._decode_time_metric = metrics.request_decode_time.labels(name)
        self._cancelled_metric = metrics.requests.labels(name, "cancelled")  # outcomes: finish_reason
        self._appended_metric = metrics.requests.labels(name, "appended")  # an append's end
        thread_ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(thread_ready,), name=f"engine-{name}", daemon=True)
        self._thread.start()
        thread_ready.wait()  # its thread count is its own before the caller changes the default

    @property
    def threads(self) -> int:
        """The worker thread's intra-op threads (server/engine/threads.py)."""
        return self.forward_threads.threads

    @property
    def prompt_threads(self) -> int:
        """The worker thread's intra-op threads for big prompt batches."""
        return self.forward_threads.prompt_threads

    @property
    def every_forward_on_prompt_threads(self) -> bool:
        """Whether the model is large enough that every forward runs on the prompt threads."""
        return self.forward_threads.large_model

    # -- admission (any thread) ------------------------------------------------------------

    def fresh_data(self) -> SessionData:
        """An empty session: the state a request without one starts from."""
        with torch.inference_mode():
            return SessionData(state=self.model.init_state(1), tokens=0, next_log_probs=None)

    def start_from_prefix(self, prompt: list[int], scope: bytes, echo_alternatives: bool) -> dict:
        """The EngineRequest fields of a request without a session: it offers its states under
        `scope` and starts from the longest cached prefix of `prompt` (any thread). No lookup
        when the request wants alternatives for its echoed prompt tokens (an entry keeps only
        each token's own log-prob). A model whose results depend on chunking only ever has
        entries where this engine's prefill chunks end (see _prefill_batch)."""
        depends_on = self.weights_identity
        if not self.model.chunking_invariant:
            # its entries hold only where this prefill chunk size breaks a prompt: a replica with
            # another size must not find them
            depends_on += b"prefill_chunk=%d" % self.prefill_chunk
        if depends_on:
            scope = hashlib.blake2b(scope + depends_on, digest_size=16).digest()
        if self.prefix_cache is None:  # nothing to offer to: no scope, so no final state is fed or copied out
            return {"start": self.fresh_data()}
        # a model whose entries hold only where prefill chunks end never offers the state after
        # its completion (`_finish_row`), so its last token is not fed for it, nor its state kept
        fields = {"start": self.fresh_data(), "prefix_scope": scope,
                  "final_state_offered": self.model.chunking_invariant}
        if echo_alternatives or (
                # the requests waiting for a batch slot hold as many bytes of hit states the cache has
                # let go of as its memory caps: one more could be memory no budget counts (a whole state
                # each, 237 MB at real size: 256 queued hits would be 60 GB), so this prompt is computed
                self._hits_waiting_bytes() >= self.prefix_cache.caps["device"] + self.prefix_cache.caps["host"]):
            self.prefix_cache.missed(self.name, len(prompt))
            return fields
        try:
            hit = self.prefix_cache.lookup(self.name, scope, prompt, restore=self._restore_prefix)
        except Exception:  # the cache costs reuse at worst, never the request
            log.exception("prefix cache: a lookup for model %s failed; computing the prompt", self.name)
            hit = None
        if hit is not None:
            fields.update(start=hit.data, reused=hit.tokens, reused_logprobs=hit.logprobs, hit_bytes=hit.data.nbytes())
        return fields

    def _hits_waiting_bytes(self) -> int:
        """The bytes of the prefix-hit states that queued requests hold until they run and the
        cache no longer does (its entry pushed down or dropped), each state once: requests that
        hit one entry the cache still holds share its memory, which its books count (any thread)."""
        with self._condition:
            held = {id(request.start): request.hit_bytes for request in self._waiting if request.hit_bytes}
        if not held:
            return 0
        resident = self.prefix_cache.resident()
        return sum(nbytes for state, nbytes in held.items() if state not in resident)

    @property
    def prefix_lookup_waits(self) -> bool:
        """Whether a prefix lookup may do more than read the device's memory: ask Redis, read
        an entry on disk (a hit there reads and checks its file, tens to hundreds of MB at real
        size), or copy one from host RAM to the device (and push another down to make room):
        hundreds of MB at real size, which must not hold the reader thread that every other
        request's frames wait on."""
        cache = self.prefix_cache
        return cache is not None and (cache.remote is not None or cache.held("disk") > 0 or cache.held("host") > 0)

    def _restore_prefix(self, blob: bytes):
        """A prefix entry from a shared store, on this model's device and checked as an imported
        session is (ValueError or CorruptState when this model could not have made it)."""
        data, logprobs = decode_entry(blob, self.name, self.model.state_class, self.model.device)
        with torch.inference_mode():
            self.model.check_session(data.state, data.tokens, data.next_log_probs)
        if any(lp is None or not lp <= 1e-4 for lp in logprobs[1:]) or (logprobs and logprobs[0] is not None):
            raise ValueError("a prefix entry's token log-probs are not log-probabilities")
        return data, logprobs

    def check_context(self, kind: str, history: int, prompt: int, max_tokens: int) -> None:
        """Raise ContextLengthExceeded when a request would take the context past the model's
        `history_limit`: the `history` tokens its state starts with (a session's; a prefix-cache
        hit's are part of the prompt), its `prompt` tokens (an append's text), and, for a
        generation that asks for any token, its first one. A generation that would pass the limit
        later is not refused: it ends there with finish_reason "length" (`_sample`). Any thread."""
        limit = self.history_limit
        generating = kind == "generate" and max_tokens > 0
        reach = history + prompt + int(generating)
        if limit is None or reach <= limit:
            return
        parts = [f"{history} in the session's history"] if history else []
        if prompt:
            parts.append(f"{prompt} in the {'prompt' if kind == 'generate' else 'appended text'}")
        if generating:
            parts.append("1 to generate")
        raise ContextLengthExceeded(
            f"model '{self.name}' has a maximum context length of {limit} tokens (max_context); this request "
            f"would take the context to {reach} tokens ({' + '.join(parts)})",
            param="prompt" if kind == "generate" else "text", code="context_length_exceeded")

    def enqueue(self, request: EngineRequest) -> None:
        """Queue a request; its events go to the sink as (request.handle, event) pairs. Raises
        ContextLengthExceeded when it cannot fit the model's context (`check_context`),
        ShuttingDown after `stop_admitting`, and QueueFull when too many requests wait."""
        self.check_context(request.kind, request.start.tokens - request.reused, len(request.prompt),
                           request.params.max_tokens)
        params = request.params
        if request.kind == "generate" and params.constraint_kind is not None and request.constraint is None:
            # 400 for a schema or grammar that does not compile, before anything is queued
            request.constraint = self.constraints.matcher(params.constraint_kind, params.constraint or "",
                                                          params.constraint_param)
        with self._condition:
            self._refuse_unless_admitted(request)
            request.queued_at = time.monotonic()
            self._waiting.append(request)
            self._waiting_metric.set(len(self._waiting))
            self._condition.notify()

    def check_admitted(self, width: int, owner: str | None) -> None:
        """Raise what `enqueue` would raise now for a request of `width` rows from `owner`
        (QueueFull, ShuttingDown): asked before the work a request does before it is queued (a
        prefix lookup: a file read, a Redis fetch, a copy to the device), which a request about
        to be refused must neither do nor count as a prefix-cache hit."""
        with self._condition:
            self._refuse_unless_admitted(_Admission(width, owner))

    def _refuse_unless_admitted(self, request: "EngineRequest | _Admission") -> None:
        """(Under the condition.) Raise unless the queue admits `request` now."""
        if self._broken is not None:
            raise self._gone()
        if not self._admitting or self._closed:
            raise ShuttingDown("the server is shutting down and admits no new requests; retry on another replica",
                               code="shutting_down")
        queued, queued_of_owner = self._queued_with(request)
        if queued > self.max_queued:
            raise QueueFull(
                f"model '{self.name}' has {queued - 1} requests waiting, the limit is {self.max_queued} "
                "(XLSERVE_MAX_QUEUED_REQUESTS); retry later",
                code="queue_full",
            )
        if self.max_queued_per_key and request.owner is not None and queued_of_owner > self.max_queued_per_key:
            raise QueueFull(
                f"this API key has {queued_of_owner - 1} requests waiting for model '{self.name}', the limit per "
                f"key is {self.max_queued_per_key} (XLSERVE_MAX_QUEUED_PER_KEY); retry later", code="queue_full")

    def _queued_with(self, request: "EngineRequest | _Admission") -> tuple[int, int]:
        """Requests that would wait for a batch slot, `request` included (counted as if admission
        were first come, first served: `_admit` may take another owner's first), and how many of
        them are `request`'s owner's."""
        free, queued, of_owner = self.max_batch_size - self._running_rows, 0, 0
        for waiting in [*self._waiting, request]:
            if waiting.cancelled.is_set():  # leaves at the next admission, wherever it waits
                continue
            width = min(waiting.width, self.max_batch_size)
            if queued == 0 and width <= free:
                free -= width
            else:
                queued += 1
                of_owner += waiting.owner is not None and waiting.owner == request.owner
        return queued, of_owner

    def wake(self) -> None:
        """Look at the requests now (one was cancelled)."""
        with self._condition:
            self._condition.notify()

    def stop_admitting(self) -> None:
        with self._condition:
            self._admitting = False

    @property
    def idle(self) -> bool:
        with self._condition:
            return not self._waiting and self._running_rows == 0

    def close(self) -> None:
        """Stop the worker; requests still queued or running fail with ShuttingDown."""
        with self._condition:
            self._admitting = False
            self._closed = True
            self._condition.notify()
        self._thread.join(timeout=60)

    # -- the step loop (worker thread) -------------------------------------------------------

    def _loop(self, thread_ready: threading.Event) -> None:
        """The worker thread. A step's own failure fails its requests and the loop goes on
        (`_serve`); a failure outside a step (admitting, handing events to the sink) would end the
        thread and leave every request waiting for good while the process's heartbeat still beats:
        it fails every request with EngineGone, refuses new ones, and calls `on_loop_failure`."""
        try:
            self._serve(thread_ready)
        except BaseException as error:
            log.critical("model %s: the step loop failed and stopped", self.name, exc_info=True)
            with self._condition:
                self._broken = error
                pending = list(self._waiting) + self._running
                self._waiting.clear()
            self._running = []
            self.layout.clear()
            self._running_metric.set(0)
            self._waiting_metric.set(0)
            for request in pending:
                self._emit(request, self._gone())
            try:
                self._flush()
            except BaseException:
                log.exception("model %s: the requests' failure could not be handed over either", self.name)
            if self.on_loop_failure is not None:
                self.on_loop_failure(error)

    def _gone(self) -> EngineGone:
        return EngineGone(f"the engine for model '{self.name}' stopped on an error of its own; a new engine "
                          "process is starting: send the request again shortly", code="engine_gone")

    def _serve(self, thread_ready: threading.Event) -> None:
        self.forward_threads.take()
        thread_ready.set()
        while True:
            with self._condition:
                while not self._closed and not self._waiting and not self._running:
                    self._condition.wait()
                if self._closed:
                    break
                self._admit()
            self._step_started_at = time.monotonic()
            try:
                with torch.inference_mode():
                    self._step()
            except BaseException as error:  # a bug in the loop itself: fail everyone, keep serving
                log.exception("model %s: a step failed outside any one request's work", self.name)
                for request in list(self._running):
                    self._fail(request, request_error(error, "step_failed"))
                self.layout.clear()
                self._running_metric.set(len(self._running))  # set at a step's end, which this one never reached
            finally:
                self._step_started_at = None
            self._flush()
        self._stop_everything()

    def _stop_everything(self) -> None:
        """The engine is closing: everything queued or running fails with ShuttingDown."""
        stop = ShuttingDown("the server shut down before this request finished", code="shutting_down")
        with self._condition:
            pending = list(self._waiting) + self._running
            self._waiting.clear()
        for request in pending:
            self._emit(request, stop)
        self._running = []
        self.layout.clear()
        self._flush()

    def _admit(self) -> None:
        """Drop the cancelled requests wherever they wait (a client gone from the back of a queue
        the running batch holds up must not keep its place, which `max_queued` counts), then move
        waiting requests into the batch while they fit; under the lock.

        Next in is the oldest request of the owner (API key) that holds the fewest rows of the
        batch, so that an owner whose wide requests (n = 16, four prompts) filled it does not also
        take every row that frees while another owner waits; among requests of owners holding as
        many rows, or without keys (each request its own owner), first come, first served. A
        request that does not fit yet is not passed over for a narrower one behind it, so a wide
        request is never starved."""
        for request in [request for request in self._waiting if request.cancelled.is_set()]:
            self._waiting.remove(request)
            self._dropped(request)
        held = Counter()  # owner -> rows of the batch its requests hold
        if self._waiting:  # counted at a step only when someone waits to come in
            for running in self._running:
                held[running.share_key] += running.width
        while self._waiting:
            request = min(self._waiting, key=lambda waiting: held[waiting.share_key])  # the first of the least served
            if self._running_rows + request.width > self.max_batch_size and self._running_rows > 0:
                break
            self._waiting.remove(request)
            self._running.append(request)
            self._running_rows += request.width
            held[request.share_key] += request.width
            request.scheduled_at = time.monotonic()
            if request.queued_at is not None:
                self._queue_time_metric.observe(request.scheduled_at - request.queued_at)
        self._waiting_metric.set(len(self._waiting))

    def _remove(self, request: EngineRequest) -> None:
        if request in self._running:
            self._running.remove(request)
            with self._condition:
                self._running_rows -= request.width

    def step_seconds(self) -> float | None:
        """How long the step under way has run; None between steps. Read from the heartbeat
        thread: one read of an attribute the worker thread sets, no lock needed."""
        started = self._step_started_at
        return None if started is None else time.monotonic() - started

    def _step(self) -> None:
        _hang_if_asked()
        for request in [r for r in self._running if r.cancelled.is_set()]:
            self._remove(request)  # its rows drop out of their group at the next forward
            self._dropped(request)
        self._prefill()
        self._decode()
        if not any(request.rows for request in self._running):
            self.layout.clear()  # nothing decoding: let go of the batched states
        self._running_metric.set(len(self._running))

    def _forward(self, tokens: torch.Tensor, state: State,
                 lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        """The model's forward, on as many threads as its size calls for (ForwardThreads)."""
        self.forward_threads.use_for(tokens.numel())
        if lengths is not None:  # rows of different lengths, right-padded (LanguageModel.ragged_chunks)
            return self.model(tokens, state, lengths=lengths)
        return self.model(tokens, state)

    def _forward_scored(self, tokens: torch.Tensor, state: State,
                        lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, State]:
        """`_forward` without whole rows but each row's last (LanguageModel.forward_scored)."""
        self.forward_threads.use_for(tokens.numel())
        return self.model.forward_scored(tokens, state, lengths)

    # prefill ----------------------------------------------------------------------------------

    def _prefill(self) -> None:
        self._prefill_steps += 1
        pending = []
        for request in list(self._running):
            if request.rows or request.failed:
                continue
            if request.fed == len(request.prompt):
                self._alone(request, self._prefilled, request)
            else:
                pending.append(request)
        chunks = []
        for request, size in self._prefill_plan(pending):
            request.prefill_turn = self._prefill_steps
            chunks.append((request, request.prompt[request.fed : request.fed + size]))
        # one forward per batch key, and per chunk length unless the model takes chunks of
        # different lengths in one batch (LanguageModel.ragged_chunks)
        ragged = getattr(self.model, "ragged_chunks", False)
        by_length: dict[int, list[tuple[EngineRequest, list[int]]]] = {}
        for request, chunk in chunks:
            by_length.setdefault(0 if ragged else len(chunk), []).append((request, chunk))
        for members in by_length.values():
            for batch in self.layout.batches(members, lambda member: member[0].state):
                self._prefill_batch(batch)

    def _prefill_plan(self, pending: list[EngineRequest]) -> list[tuple[EngineRequest, int]]:
        """How many prompt tokens each request still prefilling gets this step, within the step's
        budget of `prefill_chunk` tokens, so that a short prompt that arrives while a long one
        prefills has its first token after the step under way and one short step, not after the
        long one's whole prefill, and the long one loses no more than the share it gives up:

        1. Prompts that can finish now go first, alone. When some prompts' remainders fit in the
           budget together (shortest first) and others do not, the step feeds only those: a step
           costs about what it feeds, so the short prompts' first tokens come after a short step,
           not after one with a long prompt's chunk in it. Such a step is never taken twice in a
           row, so a stream of short prompts slows a long one by at most half.
        2. Otherwise the budget is shared round robin: among owners first (the API key each
           request came with, `EngineRequest.owner`; a request without one is its own owner),
           then among one owner's requests, so a client that sends many long prompts gets one
           share, not one per prompt. Whoever got tokens longest ago (or never) goes first
           (`prefill_turn`), then whoever has been given fewer, then running order: the odd
           tokens of an unequal split go round.

        A model whose results do not depend on the chunking splits the budget equally
        (water-filling: what one needs less than its share of goes to the others). Any other
        model is fed in whole `prefill_chunk` chunks only, as one pass of it would be: owners in
        turn each give one request one chunk while budget is left (the last may pass it by less
        than a chunk, as one request's chunk always could)."""
        # stable: running order among equals
        order = sorted(pending, key=lambda request: (request.prefill_turn, request.fed - request.reused))
        needs = {request: len(request.prompt) - request.fed for request in order}
        budget = self.prefill_chunk
        if not order:
            return []
        finishing = self._finishing_now(order, needs, budget)
        self._last_step_finished_only = bool(finishing)
        if finishing:
            return finishing
        owners: dict[object, list[EngineRequest]] = {}
        for request in order:
            owners.setdefault(request.share_key, []).append(request)
        # an owner's turn is its most recently fed request's: owners served longest ago go first
        groups = sorted(owners.values(), key=lambda members: max(member.prefill_turn for member in members))
        if not self.model.chunking_invariant:
            plan = []
            for round_index in range(max(len(members) for members in groups)):
                for members in groups:
                    if budget <= 0:
                        return plan
                    if round_index < len(members):
                        size = min(needs[members[round_index]], self.prefill_chunk)
                        plan.append((members[round_index], size))
                        budget -= size
            return plan
        group_shares = _water_fill([sum(needs[member] for member in members) for members in groups], budget)
        plan = []
        for members, share in zip(groups, group_shares):
            for member, size in zip(members, _water_fill([needs[member] for member in members], share)):
                if size > 0:
                    plan.append((member, size))
        return plan

    def _finishing_now(self, order: list[EngineRequest], needs: dict[EngineRequest, int],
                       budget: int) -> list[tuple[EngineRequest, int]]:
        """The prompts a step may feed alone (step 1 of `_prefill_plan`): the shortest remainders
        that fit in the budget together, when others do not and the last step was not one of these."""
        if self._last_step_finished_only or len(order) < 2:
            return []
        plan = []
        for request in sorted(order, key=lambda request: needs[request]):
            if needs[request] > budget:
                break
            plan.append((request, needs[request]))
            budget -= needs[request]
        return plan if 0 < len(plan) < len(order) else []

    def _prefill_batch(self, batch: list[tuple[EngineRequest, list[int]]]) -> None:
        whole = [member for member in batch if member[0].prompt_top_k is not None]
        if whole and len(whole) < len(batch):
            # rows that need their whole distributions (echo with top log-probabilities) go through
            # `forward`, the others through `forward_scored`, which may differ within float tolerance
            # (Transformer-XL's adaptive head): a request's numbers must not hang on its batch-mates
            self._prefill_batch(whole)
            self._prefill_batch([member for member in batch if member[0].prompt_top_k is None])
            return
        requests = [request for request, _ in batch]
        state = requests[0].state if len(requests) == 1 else self.layout.concat([r.state for r in requests])
        if state is None:  # this class cannot batch these rows after all: one by one
            for member in batch:
                self._prefill_batch([member])
            return
        try:
            lengths = [len(chunk) for _, chunk in batch]
            longest = max(lengths)
            tokens = torch.tensor([chunk + [0] * (longest - len(chunk)) for _, chunk in batch],
                                  device=self.model.device)  # (B, T), right-padded when lengths differ
            ragged = None if longest == min(lengths) else torch.tensor(lengths, device=self.model.device)
            if any(request.prompt_top_k is not None for request in requests):  # whole rows: their top tokens
                log_probs, state = self._forward(tokens, state, ragged)  # (B, T, V)
                next_rows, scores = rows_and_scores(log_probs, tokens, ragged)
            else:  # each row's last one, and the log-probability of each next prompt token
                log_probs = None
                next_rows, scores, state = self._forward_scored(tokens, state, ragged)  # (B, V), (B, T - 1)
            states = [state] if len(requests) == 1 else state.split()
        except Exception as error:
            if len(batch) > 1:  # find the culprits: each request's chunk alone
                for member in batch:
                    self._prefill_batch([member])
            else:
                self._fail(requests[0], request_error(error, "forward_failed"))
            return
        self._prompt_metric.inc(sum(lengths))
        for i, (request, chunk) in enumerate(batch):
            self._alone(request, self._prefilled_chunk, request, chunk, states[i], next_rows[i], scores[i],
                        None if log_probs is None else log_probs[i])

    def _prefilled_chunk(self, request: EngineRequest, chunk: list[int], state: State, next_row: torch.Tensor,
                         scores: torch.Tensor, log_probs: torch.Tensor | None) -> None:
        """One request's share of a prefill forward: its row of the batch's results."""
        if request.prompt_top_k is not None or request.score or request.prefix_scope is not None:
            self._record_prompt_logprobs(request, chunk, scores[: len(chunk) - 1],
                                         None if log_probs is None else log_probs[: len(chunk)])
        request.state = state
        request.next_log_probs = next_row
        request.tokens += len(chunk)
        request.fed += len(chunk)
        if not self.model.chunking_invariant and request.fed % self.prefill_chunk == 0:
            # resuming reproduces one pass only where a cold request's chunks also end
            self._offer(request, request.prompt[: request.fed], SessionData(
                state=request.state, tokens=request.tokens, next_log_probs=request.next_log_probs))
        if request.fed == len(request.prompt):
            self._prefilled(request)

    def _record_prompt_logprobs(self, request: EngineRequest, chunk: list[int], scores: torch.Tensor,
                                log_probs: torch.Tensor | None) -> None:
        """One chunk's prompt log-probabilities: scores (T - 1,) of its tokens after the first,
        each predicted by the position before it, and for top tokens its whole rows (T, V)."""
        before = request.next_log_probs  # (V,) predicted the chunk's first token; None without context
        predicted = scores.float().tolist()
        request.prompt_logprobs.extend([None if before is None else float(before[chunk[0]]), *predicted])
        if request.prompt_top_k is not None:
            first = [] if before is None else _most_likely(before[None], request.prompt_top_k)[0]
            request.prompt_top.extend([first, *_most_likely(log_probs[:-1], request.prompt_top_k)])

    def _prefilled(self, request: EngineRequest) -> None:
        """The whole prompt is in the state: start decoding (or finish). A request whose
        next-token row is no distribution fails here, before anything of it can be committed."""
        if request.next_log_probs is not None:
            failure = unusable_row(most_likely(request.next_log_probs.float().cpu())[1], request.continues_session)
            if failure is not None:
                self._fail(request, failure)
                return
        self._prefill_tokens_metric.observe(request.fed - request.reused)
        next_log_probs = None if request.next_log_probs is None else request.next_log_probs.clone()
        data = SessionData(state=request.state, tokens=request.tokens, next_log_probs=next_log_probs)
        if self.model.chunking_invariant and request.fed > request.reused:
            self._offer(request, request.prompt, data)  # the next request with this prompt starts here
        if request.kind == "append":
            self._first_output(request)  # an append's result is its only output
            scored = [logprob for logprob in request.prompt_logprobs if logprob is not None]
            self._emit(request, Appended(data=data, logprob=float(sum(scored)), scored=len(scored)))
            self._appended_metric.inc()
            self._remove(request)
            return
        if request.prompt_top_k is not None and request.prompt:
            self._emit(request, PromptLogprobs(tokens=list(request.prompt), logprobs=request.prompt_logprobs,
                                               top=request.prompt_top))
        if request.params.max_tokens == 0:
            # each choice ends as a decoded one does, its own event first (the API's chunks and
            # choices take their finish_reason from it), then the request's
            choices = [ChoiceFinished(i, "length", "", 0) for i in range(request.params.n)]
            for choice in choices:
                self._emit(request, choice)
            self._finish(request, data, choices)
            return
        if request.next_log_probs is None:
            self._fail(request, InvalidInput("nothing to continue from: give a prompt", param="prompt"))
            return
        # choices share the prompt's state: states are values, a forward never changes its input.
        # Each choice's text continues the prompt's (or the session's text before it): its
        # detokenizer starts after them (the last few of the prompt's: models/tokenizer.py), so a
        # first word keeps the space that joins it on
        continues = request.start.tokens > 0
        try:
            request.rows = [Row(request, i, self.tokenizer.detokenizer(request.prompt, continues), request.state,
                                data.next_log_probs) for i in range(request.params.n)]
        except Exception as error:
            request.rows = []
            self._fail(request, request_error(error, "sampling_failed"))

    # decode -----------------------------------------------------------------------------------

    def _decode(self) -> None:
        rows = [row for request in self._running for row in request.rows if row.finish_reason is None]
        if not rows:
            return
        forward = []
        generated_before = sum(row.generated for row in rows)
        for row in rows:
            if row.request.failed:  # another of its choices failed this step
                continue
            try:
                if self._sample(row):
                    forward.append(row)
            except Exception as error:  # this request alone: the others sample on
                self._fail(row.request, request_error(error, "sampling_failed"))
        forward = [row for row in forward if not row.request.failed]
        self._flush()  # tokens leave before the forward that follows them
        # the tokens this step gave out (not its rows: one whose sampling failed, or that ended by
        # its constraint without a token, gave none)
        self._generated_metric.inc(sum(row.generated for row in rows) - generated_before)
        if forward:
            self._batch_metric.observe(len(forward))
            self._forward_rows(forward)
        elif any(row.finish_reason is not None and row.keeps_state for row in rows):
            # rows that ended without a token (a constraint's end) and keep their state take it
            # out of their groups; with nothing left to decode every group is let go
            self.layout.arrange([])
        for row in rows:
            if row.finish_reason is not None and not row.request.failed:
                self._alone(row.request, self._finish_row, row)

    def _sample(self, row: Row) -> bool:
        """Choose the row's next token and send it out; True when it is to be fed to the model
        (the row goes on, or it is a session's and the state keeps every token generated).
        Raises RequestFailed when the row is no distribution (NaN, +inf, no possible token)."""
        params = row.request.params
        failure = unusable_row(row.greedy[1], row.request.continues_session)
        if failure is not None:
            raise failure
        constraint = row.constraint
        if row.plain_greedy:  # argmax taken once for the whole batch
            token, logprob = row.greedy
        elif constraint is not None:
            constraint.start_token()
            token = self._draw_constrained(row)
            if isinstance(token, str):  # it ends here, with this finish reason
                return self._ends_without_token(row, token)
            failure = constraint.too_slow(self.constraint_token_seconds, params.constraint_param)
            if failure is not None:  # going on, it would hold every other row of the model
                log.warning("model %s: a constrained row stopped after %d tokens: %s", self.name, row.generated,
                            failure.message)
                raise failure
            logprob = float(row.host_log_probs[token])
        else:
            token = row.sampler.choose(row.host_log_probs)
            logprob = float(row.host_log_probs[token])
        if token in self.stop_token_ids and constraint is None and not params.ignore_eos:
            # the model ended its text: the row ends, as at a stop string, without the token (no
            # text, not fed: a session's state holds exactly the text sent). A constrained row
            # ends where its constraint lets it (the matcher's own end of text). The token is
            # counted in the usage's completion tokens all the same, as OpenAI and vLLM count it
            row.drew_end_of_text = True
            return self._ends_without_token(row, "stop")
        row.generated += 1
        row.generated_tokens.append(token)
        row.generated_logprobs.append(float(row.host_log_probs[token]))
        decoded = row.detokenizer.push(token)
        text, stopped = row.stops.push(decoded)
        top = top_alternatives(row.host_log_probs, params.logprobs) if params.logprobs else []
        self._emit(row.request, TokenEvent(token, text, logprob, top, row.index, len(decoded)))
        if row.request.first_token_at is None:
            self._first_output(row.request)
        if stopped:
            row.finish_reason, row.stopped_by_string = "stop", True
        elif constraint is not None and constraint.complete:  # nothing may follow: the output is complete
            row.finish_reason = "stop"
        elif row.generated >= params.max_tokens or self._context_full(row):
            row.finish_reason = "length"
        if row.finish_reason is None or row.request.feeds_every_token:
            row.pending = token
            return True
        return False

    def _draw_constrained(self, row: Row) -> int | str:
        """The next token of a row with a constraint, taken by its matcher; or the finish
        reason of a row that ends here ("stop": the output may end and the model drew a token
        the constraint forbids; "no_allowed_token"). Draw first, mask only when the draw is
        forbidden (server/engine/constraints.py, "Drawing")."""
        sampler, constraint = row.sampler, row.constraint
        if not sampler.truncates:
            scores = sampler.perturbed(row.host_log_probs)  # (V,) NumPy: its argmax is a draw
            token = int(scores.argmax())
            failure = unusable_row(float(scores[token]))
            if failure is not None:
                raise failure
            if not constraint.accept(token):
                if constraint.may_end():
                    row.drew_end_of_text = token in self.stop_token_ids  # counted in the usage, as unconstrained
                    return "stop"
                allowed = constraint.allowed_bits()
                if not allowed.any():
                    return self._no_allowed_token(row)
                masked = np.where(allowed, scores, -np.inf)
                token = int(masked.argmax())  # the same draw, from the allowed tokens
                if masked[token] == -np.inf:  # the model gives every allowed token no chance
                    return self._no_allowed_token(row)
                constraint.consume(token)
            sampler.record(token)
            return token
        allowed, may_end = constraint.allowed()
        if not may_end and not bool(allowed.any()):  # nothing may follow and it may not end: that row alone ends
            return self._no_allowed_token(row)
        if not may_end and self._rules_out(row.host_log_probs, allowed):
            return self._no_allowed_token(row)
        token = sampler.choose(row.host_log_probs, allowed, may_end)
        if token >= allowed.numel():  # "end here" (server/engine/sampling.py): the end of text, counted
            row.drew_end_of_text = True
            return "stop"
        constraint.consume(token)
        return token

    @staticmethod
    def _rules_out(log_probs: torch.Tensor, allowed: torch.Tensor) -> bool:
        """Whether a row that is otherwise a distribution (some token has a finite value) gives
        every allowed token no chance (-inf): the constraint then leaves nothing to draw, as when
        it allows nothing. logit_bias and the penalties keep a finite value finite."""
        return bool((log_probs[allowed] == float("-inf")).all()) and bool(torch.isfinite(log_probs).any())

    def _no_allowed_token(self, row: Row) -> str:
        """The finish reason of a row its constraint leaves no token to draw; but a matcher that
        stopped with an error of its own (one of llguidance's limits, reached mid-output) is no
        end of its language: its request fails alone, telling the client llguidance's reason."""
        failure = row.constraint.failure(row.request.params.constraint_param, row.generated)
        if failure is not None:
            log.warning("model %s: a constrained row stopped: %s", self.name, failure.message)
            raise failure
        return NO_ALLOWED_TOKEN

    def _ends_without_token(self, row: Row, reason: str) -> bool:
        """The row ends without a token of this step: the model drew its end of text ("stop"), or
        its constraint is complete ("stop") or allows nothing ("no_allowed_token"). Every token
        it drew went through the model already, so a session's state holds exactly the text
        sent. Nothing to feed."""
        row.finish_reason = reason
        if row.request.first_token_at is None:
            self._first_output(row.request)
        return False

    def _context_full(self, row: Row) -> bool:
        """The token just sampled takes the row's context to the model's history_limit: no
        token can follow it (check_context let the request in with room for its first)."""
        return self.history_limit is not None and row.tokens + 1 >= self.history_limit

    def _forward_rows(self, rows: list[Row]) -> None:
        """Run each row's pending token through the model, one forward per group of rows that
        batch together (server/engine/batch.py)."""
        for group in self.layout.arrange(rows):
            try:
                log_probs, state = self._forward(group.pending_tokens(self.model.device), group.state)  # (B, 1, V)
            except Exception as error:
                self._forward_one_by_one(group, error)
                continue
            self._advance(group, log_probs[:, -1])
            self.layout.stepped(group, state)

    def _forward_one_by_one(self, group: Group, error: Exception) -> None:
        """The group's batched forward raised: each of its rows runs alone, and only the
        requests of rows whose own forward raises fail. The group is let go (it never goes back
        through `stepped`); each row that went on holds its own state, and the layout groups
        those afresh at the next step."""
        if len(group.rows) == 1:
            self._fail(group.rows[0].request, request_error(error, "forward_failed"))
            return
        for row, state in zip(group.rows, group.split()):
            if row is None or row.request.failed:
                continue
            alone = Group(rows=[row], state=state, key=())
            try:
                log_probs, new_state = self._forward(alone.pending_tokens(self.model.device), state)
            except Exception as row_error:
                self._fail(row.request, request_error(row_error, "forward_failed"))
                continue
            self._advance(alone, log_probs[:, -1])
            row.state = new_state

    def _advance(self, group: Group, last: torch.Tensor) -> None:
        """The group's rows have seen their pending tokens; `last` (B, V) predicts their next."""
        host = last.float().cpu()  # one transfer for the batch (a no-op on the CPU)
        # (B,) each: greedy rows need nothing else. max's indices are argmax's, NaN and ties
        # included (the first), at a third of argmax's time on this CPU (sampling.most_likely)
        value, best = host.max(dim=-1)
        greedy = zip(best.tolist(), value.tolist())
        for i, (row, choice) in enumerate(zip(group.rows, greedy)):
            if row is None:  # an idle place
                continue
            row.next_log_probs, row.host_log_probs, row.greedy = last[i], host[i], choice
            row.tokens += 1
            row.pending = None

    # endings ----------------------------------------------------------------------------------

    def _alone(self, request: EngineRequest, work, *args) -> None:
        """`work(*args)`, a step's work for `request` alone (its prefill's results, its end): what
        it raises fails that request alone (as RequestFailed `finish_failed`, or 503
        DeviceOutOfMemory), never the step's other requests."""
        try:
            work(*args)
        except Exception as error:
            self._fail(request, request_error(error))

    def _finish_row(self, row: Row) -> None:
        request = row.request
        if row.state_error is not None:  # its state could not be taken out of its batch
            if request.keep_state:  # a session's new state: nothing to commit
                self._fail(request, request_error(row.state_error))
                return
            # only a prefix-cache offer wanted it: the answer stands (its tokens are sent), the offer goes
            log.warning("model %s: a finished row's state could not be kept for the prefix cache (%s)", self.name,
                        row.state_error)
        if row.stopped_by_string:
            tail = ""  # the text held back was the stop string's start
        else:
            tail = row.stops.push(row.detokenizer.flush())[0] + row.stops.flush()
        choice = ChoiceFinished(row.index, row.finish_reason, tail, row.generated + row.drew_end_of_text)
        request.done.append(choice)
        self._emit(request, choice)
        if len(request.done) < len(request.rows):
            return
        first = request.rows[0]
        # (a row cancelled during its last step left its batch without its state: nothing to offer)
        if (request.offers_final_state and first.state is not None and first.state_error is None
                and unusable_row(first.greedy[1]) is None):
            # the next turn of a conversation resends exactly prompt + completion
            self._offer(request, request.prompt + first.generated_tokens,
                        SessionData(state=first.state, tokens=first.tokens, next_log_probs=first.next_log_probs),
                        request.prompt_logprobs + first.generated_logprobs, finished=True)
        if request.keep_state:
            failure = unusable_row(first.greedy[1], request.continues_session)  # never commit a state that predicts nothing
            if failure is not None:
                self._fail(request, failure)
                return
            data = SessionData(state=first.state, tokens=first.tokens, next_log_probs=first.next_log_probs.clone())
        else:  # nothing to commit; the state after the prompt
            data = SessionData(state=request.state, tokens=request.tokens, next_log_probs=request.next_log_probs)
        self._finish(request, data, sorted(request.done, key=lambda c: c.index))

    def _first_output(self, request: EngineRequest) -> None:
        """The request's first token (or an append's result): its prefill phase is over."""
        request.first_token_at = time.monotonic()
        if request.scheduled_at is not None:
            self._prefill_time_metric.observe(request.first_token_at - request.scheduled_at)

    def _finish(self, request: EngineRequest, data: SessionData, choices: list[ChoiceFinished]) -> None:
        if request.first_token_at is None:  # max_tokens=0: the prompt was all there was to do
            self._first_output(request)
        else:
            self._decode_time_metric.observe(time.monotonic() - request.first_token_at)
        completion = sum(c.completion_tokens for c in choices)
        self._emit(request, Finished(choices=choices, prompt_tokens=len(request.prompt), completion_tokens=completion,
                                     cached_tokens=request.cached_tokens, data=data))
        # once per request (the error ratio's denominator counts requests, not choices): the first
        # choice's reason, which is every choice's but where n > 1 end differently
        self.metrics.requests.labels(self.name, choices[0].finish_reason).inc()
        self._remove(request)

    def _offer(self, request: EngineRequest, tokens: list[int], data: SessionData,
               logprobs: list[float | None] | None = None, finished: bool = False) -> None:
        """Give the state after `tokens` (the request's prompt, or more) to the prefix cache, as
        a copy of its own: the request's state may be a view into a batch that is written over.
        `finished`: the state of a row that has left its batch, which nothing else uses. A cache
        that cannot take it changes nothing for the request."""
        if self.prefix_cache is None or request.prefix_scope is None or request.failed:
            return
        logprobs = request.prompt_logprobs[: len(tokens)] if logprobs is None else logprobs
        try:
            # copied only when the prefix is new to the cache (a copy of 237 MB at real size holds
            # up every stream of the model for a step or two), and a finished row's state, which
            # nothing writes any more, only where it is a view that keeps a batch's memory alive
            self.prefix_cache.offer(self.name, request.prefix_scope, list(tokens), data, logprobs,
                                    copy=SessionData.compact if finished else SessionData.clone)
        except Exception:  # a bookkeeping bug must not fail a request that has its answer
            log.exception("prefix cache: an offer from model %s failed", self.name)

    def _dropped(self, request: EngineRequest) -> None:
        """A cancelled request leaves: like every request it ends with one last event
        (Cancelled), so whoever tracks it (the engine process, its sink) can forget it. One
        dropped during its prefill counts the prompt tokens it did compute (xlserve_prefill_tokens):
        a cancel stops a long prompt between two chunks, and the metric shows where."""
        self._cancelled_metric.inc()
        if request.scheduled_at is not None and not request.rows:  # still prefilling: not observed yet
            self._prefill_tokens_metric.observe(request.fed - request.reused)
        self._emit(request, Cancelled())

    def _fail(self, request: EngineRequest, error: BaseException) -> None:
        """End `request` with `error`, its last event; once (its choices may fail in separate
        groups of one step, a request wider than a batch)."""
        if request.failed:
            return
        request.failed = True
        for row in request.rows:
            row.finish_reason = row.finish_reason or "error"
        self._emit(request, error)
        self._remove(request)

    def _emit(self, request: EngineRequest, event: object) -> None:
        self._outbox.append((request.handle, event))

    def _flush(self) -> None:
        """Hand the step's events so far to the sink, in one call."""
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            self._sink(outbox)


# The hung-step test (tests/e2e/test_engine_restarts.py) makes one step never return, as a hung
# GPU kernel would: XLSERVE_TEST_HANG_STEP_FILE names a file, and the first step to find it there
# removes it (so that the engine process started next serves) and blocks for good. Never set in
# production.
_HANG_STEP_FILE = os.environ.get("XLSERVE_TEST_HANG_STEP_FILE", "")


def _hang_if_asked() -> None:
    if not _HANG_STEP_FILE:
        return
    try:
        os.unlink(_HANG_STEP_FILE)
    except FileNotFoundError:
        return
    threading.Event().wait()


def _water_fill(needs: list[int], budget: int) -> list[int]:
    """Split `budget` tokens equally among `needs` (in order), what one needs less than its share
    of going to the others; the first ones get the odd tokens."""
    shares = [0] * len(needs)
    open_indexes = [index for index, need in enumerate(needs) if need > 0]
    # each round either gives some entry all it needs (at most len(needs) such rounds) or leaves
    # less budget than there are open entries, which the next round spends (one token each):
    # len(needs) + 2 rounds always suffice
    for _ in range(len(needs) + 2):
        if budget <= 0 or not open_indexes:
            break
        share = max(1, budget // len(open_indexes))
        for index in list(open_indexes):
            take = min(share, needs[index] - shares[index], budget)
            shares[index] += take
            budget -= take
            if shares[index] == needs[index]:
                open_indexes.remove(index)
            if budget <= 0:
                break
    return shares


def request_error(error: BaseException, code: str = "finish_failed") -> EngineError:
    """What a request that failed alone is told: the engine's own refusals as they are; the
    machine out of memory (the device's, or host RAM on the CPU: `out_of_memory`) as the server's
    passing trouble, 503 DeviceOutOfMemory that a client retries; anything else as RequestFailed
    with `code`, naming what went wrong."""
    if isinstance(error, EngineError):
        return error
    where = {"sampling_failed": "sampling its next token", "forward_failed": "running the model on its tokens",
             "finish_failed": "finishing its answer or its state"}.get(code)
    if out_of_memory(error):
        return DeviceOutOfMemory(f"the model's device ran out of memory while {where or 'stepping'} ({error}); "
                                 "nothing was committed; retry shortly")
    if where is None:  # step_failed: the step's own bookkeeping, which every request of the step shared
        return RequestFailed(f"this request failed with the engine step it was in ({type(error).__name__}: {error}); "
                             "nothing was committed; the engine serves on", code=code)
    return RequestFailed(f"this request failed while {where} ({type(error).__name__}: {error}); "
                         "the other requests were not affected and nothing was committed", code=code)


def _most_likely(rows: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """rows (R, V) -> per row the k most likely (token, log-prob)."""
    if k <= 0 or rows.shape[0] == 0:
        return [[] for _ in range(rows.shape[0])]
    values, indices = torch.topk(rows.float(), k, dim=-1)
    return [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
