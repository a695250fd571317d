"""The engine: one scheduler per model, continuous batching, tokens streamed back.

Each loaded model gets one `Engine`. Its step loop runs in a worker thread and, at every step:

1. admits waiting requests into the running batch, up to `max_batch_size` rows (a request with
   n choices takes n rows), and drops cancelled ones (client gone, explicit cancel): a cancelled
   request leaves the batch within one step;
2. prefills prompts in chunks of at most `prefill_chunk` tokens, about one chunk's worth per
   step in all, so a long prompt delays running streams by one chunk per step instead of
   stalling them; prompt chunks run as one batch, right-padded, where the model takes rows of
   different lengths (`LanguageModel.ragged_chunks`), else one batch per chunk length;
3. samples one token for every decoding row (each with its own generator, penalties and stop
   strings), sends the tokens out, and then runs all those tokens through the model in one
   batched forward of shape (B, 1): decoding is incremental, each row's state carries its
   context.

Batching goes through the model's `State` interface only: rows are concatenated with
`State.concat` and taken apart with `State.split`, so it works for every architecture. A state
class that overrides `concat` (Transformer-XL pads memories of different lengths and masks the
padding) batches any rows together; one that keeps the default (equal shapes) is batched in
groups of rows whose state shapes agree, and a class whose concat turns out to fail runs row by
row. The batched state is kept between steps: a row that leaves leaves its place idle where the
class can write a row in place (`State.put_row`), and the next row to join is written there;
otherwise, and once idle places have cost about a copy, the rows that stay are taken out in one
`State.take`, and rows that join are concatenated onto it (`Engine._leave`).

A request never touches the session it came from: it starts from the committed `SessionData`
and ends with a new one in `Finished.data`, which the caller commits only when it has the whole
answer. Cancel, disconnect or error -> nothing to commit, the session is as it was.

Where the events go: in the server, the engine lives in the engine process
(server/engine_process.py) and a `sink` given at construction writes each step's events to the
API process in one frame; without a sink (tests, benchmarks, code embedding the engine) they go
to the asyncio loop of each request's `Submission`.

Threads: the worker thread runs the model with up to `threads` intra-op threads of its own (see
`Engine._take_threads`), `prompt_threads` for big prompt batches and one for forwards too small
to gain from more (`_forward`);
the engine process runs every other thread of its own on one (server/engine_process.py,
`load_models`, which says why).

The queue is bounded: beyond `max_batch_size` running rows, at most `max_queued` requests wait;
`submit` refuses more with `QueueFull` (429 + Retry-After). After `stop_admitting` (graceful
shutdown) it refuses everything with `ShuttingDown` (503) while running requests finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from xlserve.models.interface import LanguageModel, State
from xlserve.server.cache import SessionData
from xlserve.server.engine.types import (  # noqa: F401  (importable from here too)
    Appended,
    ChoiceFinished,
    Finished,
    PromptLogprobs,
    SamplingParams,
    Submission,
    TokenEvent,
    appended,
)
from xlserve.server.engine.errors import Cancelled, InvalidInput, QueueFull, ShuttingDown
from xlserve.server.metrics import Metrics
from xlserve.server.engine.sampling import Sampler, StopChecker, top_alternatives


PARALLEL_MIN_TOKENS = 8  # forwards of fewer tokens run on one intra-op thread (Engine._forward)
PROMPT_PARALLEL_TOKENS = 256  # forwards of at least this many tokens run on `prompt_threads` (Engine._forward)
IDLE_PLACE_STEPS = 16  # a batch drops its idle places after they cost this many row-steps (Engine._leave)


def own_torch_threads(count: int) -> int:
    """Make `count` intra-op threads (0: those it has) the calling thread's own, and return its
    count. torch sets a thread's count from the process-wide default on the thread's first
    parallel op, and every torch.set_num_threads moves that default (engines move it as they
    switch, see Engine._forward); so a thread that only called torch.set_num_threads could later
    be reset to whatever the default is by then. Asking for the count first settles it; the value
    set after it stays this thread's."""
    torch.get_num_threads()
    if count > 0:
        torch.set_num_threads(count)
    return torch.get_num_threads()


@dataclass
class GenerationJob:
    prompt: list[int]
    params: SamplingParams
    start: SessionData
    keep_state: bool  # a session request: every generated token goes into the memory
    cancelled: threading.Event = field(default_factory=threading.Event)


# -- the engine's own bookkeeping (worker thread) -------------------------------------------


class _Row:
    """One choice being decoded: its sampler, its text and, between steps, its state (None
    while the state lives inside a batched group)."""

    def __init__(self, job: "_Job", index: int, state: State, next_log_probs: torch.Tensor):
        params = job.params
        self.job, self.index = job, index
        self.sampler = Sampler(params, job.prompt, index)
        self.detokenizer = job.tokenizer.detokenizer()
        self.stops = StopChecker(params.stop)
        self.state: State | None = state
        self.next_log_probs = next_log_probs  # (V,) on the model's device: predicts the next token
        self.host_log_probs = next_log_probs.float().cpu()  # the same on the CPU, for sampling
        self.greedy: tuple[int, float] | None = None  # (argmax, its log-prob) when computed for the batch
        self.tokens = job.tokens  # tokens the state has seen
        self.plain_greedy = params.temperature == 0 and not params.penalised
        self.generated = 0
        self.pending: int | None = None  # sampled token still to be fed to the model
        self.finish_reason: str | None = None


class _Job:
    def __init__(self, kind: str, prompt: list[int], start: SessionData, params: SamplingParams,
                 keep_state: bool, score: bool, cancelled: threading.Event, tokenizer, submission: object):
        self.kind = kind  # "generate" or "append"
        self.prompt = prompt
        self.params = params
        self.keep_state = keep_state
        self.cancelled = cancelled
        self.tokenizer = tokenizer
        self.submission = submission
        self.state = start.state
        self.tokens = start.tokens
        self.next_log_probs = start.next_log_probs
        self.cached_tokens = start.tokens
        self.fed = 0  # prompt tokens run through the model so far
        # prompt log-probs: echo with logprobs (tokens + top alternatives) or append with score
        self.echo_k = params.logprobs if kind == "generate" and params.echo and params.logprobs is not None else None
        self.score = score
        self.prompt_logprobs: list[float | None] = []
        self.prompt_top: list[list[tuple[int, float]]] = []
        self.rows: list[_Row] = []
        self.done: list[ChoiceFinished] = []
        self.failed = False

    @property
    def width(self) -> int:
        """Batch rows this job takes."""
        return self.params.n if self.kind == "generate" else 1


@dataclass
class _Group:
    """Rows decoded together, with their concatenated state (row i of the state is rows[i]).
    None in rows is an idle place: a row left it and, where the state class can write a row in
    place (State.put_row), the place is kept for the next row to join (see Engine._leave)."""

    rows: list[_Row | None]
    state: State
    key: tuple
    idle_steps: int = 0  # row-steps spent decoding idle places since the group last dropped them

    @property
    def live(self) -> list[_Row]:
        return [row for row in self.rows if row is not None]


def _state_tensors(state: State) -> list[torch.Tensor]:
    tensors = []
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        tensors.extend([value] if isinstance(value, torch.Tensor) else value)
    return tensors


class Engine:
    def __init__(self, name: str, model: LanguageModel, tokenizer, metrics: Metrics, prefill_chunk: int = 512,
                 max_batch_size: int = 64, max_queued: int = 256, sink=None, threads: int = 0,
                 prompt_threads: int = 0):
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.prefill_chunk = max(1, prefill_chunk)
        self.max_batch_size = max(1, max_batch_size)
        self.max_queued = max(0, max_queued)
        self._cond = threading.Condition()
        self._waiting: deque[_Job] = deque()  # guarded by _cond
        self._running: list[_Job] = []  # worker thread only
        self._running_rows = 0  # guarded by _cond
        self._admitting = True
        self._closed = False
        self._groups: list[_Group] = []
        self._ragged_ok: dict[type, bool] = {}  # state class -> its concat handles rows of different shapes
        self._outbox: list[tuple[object, object]] = []  # (handle, event) of the current step
        # where events go: by default to the asyncio loop of each request's Submission; the engine
        # process (server/engine_process.py) passes a sink that writes them to the API process
        self._sink = sink
        self.threads = threads  # the worker thread's intra-op threads; 0 = the process's current setting
        self.prompt_threads = prompt_threads  # for forwards of PROMPT_PARALLEL_TOKENS or more; 0 = `threads`
        self._thread_ready = threading.Event()
        self._pending: dict[asyncio.AbstractEventLoop, list] = {}  # handed over, not yet delivered
        self._delivery_lock = threading.Lock()
        self._m_waiting = metrics.requests_waiting.labels(name)
        self._m_running = metrics.requests_running.labels(name)
        self._m_generated = metrics.generation_tokens.labels(name)
        self._m_prompt = metrics.prompt_tokens.labels(name)
        self._m_batch = metrics.batch_size.labels(name)
        self._m_cancelled = metrics.requests.labels(name, "cancelled")  # outcomes: finish_reason
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()
        self._thread_ready.wait()  # its thread count is its own before the caller changes the default

    # -- admission (event loop) --------------------------------------------------------------

    def fresh_data(self) -> SessionData:
        with torch.inference_mode():
            return SessionData(state=self.model.init_state(1), tokens=0, next_log_probs=None)

    def submit(self, job: GenerationJob) -> "Submission":
        """Queue a generation; raises QueueFull or ShuttingDown at once, before any response
        has started. Iterate `Submission.events()` for the answer."""
        if job.params.max_tokens > 0 and not job.prompt and job.start.next_log_probs is None:
            raise InvalidInput("nothing to continue from: give a prompt", param="prompt")
        submission = Submission(self.name, self.metrics, job.cancelled, self.wake)
        self.enqueue("generate", job.prompt, job.start, job.params, job.keep_state, False, job.cancelled, submission)
        return submission

    def enqueue(self, kind: str, prompt: list[int], start: SessionData, params: SamplingParams, keep_state: bool,
                score: bool, cancelled: threading.Event, handle: object) -> None:
        """Queue a "generate" or "append" job whose events go, as (handle, event) pairs, to the
        sink (or, without one, to `handle`, a Submission). Raises QueueFull or ShuttingDown."""
        self._enqueue(_Job(kind, list(prompt), start, params, keep_state, score, cancelled, self.tokenizer, handle))

    def _enqueue(self, job: _Job) -> None:
        with self._cond:
            if not self._admitting or self._closed:
                raise ShuttingDown("the server is shutting down and admits no new requests; retry on another replica",
                                   code="shutting_down")
            # requests that would wait for a batch slot, this one included (admission is FIFO)
            free, queued = self.max_batch_size - self._running_rows, 0
            for waiting in [*self._waiting, job]:
                width = min(waiting.width, self.max_batch_size)
                if queued == 0 and width <= free:
                    free -= width
                else:
                    queued += 1
            if queued > self.max_queued:
                raise QueueFull(
                    f"model '{self.name}' has {queued - 1} requests waiting, the limit is {self.max_queued} "
                    "(XLSERVE_MAX_QUEUED_REQUESTS); retry later",
                    code="queue_full",
                )
            self._waiting.append(job)
            self._m_waiting.set(len(self._waiting))
            self._cond.notify()

    async def generate(self, job: GenerationJob) -> AsyncIterator[object]:
        """submit + events: yields PromptLogprobs?, (TokenEvent | ChoiceFinished)*, then
        Finished; raises on error. Leaving the iteration early cancels the job within one
        model step."""
        events = self.submit(job).events()
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def append(self, start: SessionData, tokens: list[int], score: bool,
                     cancelled: threading.Event | None = None) -> tuple[SessionData, float, int]:
        """Feed a document chunk into a session (batched with everything else). Returns the
        new data, the summed natural-log probability of the scored tokens, and how many were
        scored (a first token with no context is not)."""
        cancelled = cancelled or threading.Event()
        submission = Submission(self.name, self.metrics, cancelled, self.wake)
        self.enqueue("append", tokens, start, SamplingParams(max_tokens=0), False, score, cancelled, submission)
        event = await appended(submission)
        return event.data, event.logprob, event.scored

    def stop_admitting(self) -> None:
        with self._cond:
            self._admitting = False

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._waiting and self._running_rows == 0

    def close(self) -> None:
        """Stop the worker; requests still queued or running fail with ShuttingDown."""
        with self._cond:
            self._admitting = False
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=60)

    # -- the step loop (worker thread) -------------------------------------------------------

    def _take_threads(self) -> None:
        """Give this worker thread its own intra-op thread count (`own_torch_threads`)."""
        self.threads = self._threads_now = own_torch_threads(self.threads)
        self.prompt_threads = self.prompt_threads or self.threads
        self._thread_ready.set()

    def _forward(self, tokens: torch.Tensor, state: State,
                 lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        """The model's forward: on one thread when it feeds fewer than PARALLEL_MIN_TOKENS tokens
        (a decode step of a few rows), on `prompt_threads` when it feeds PROMPT_PARALLEL_TOKENS
        or more (prompts, batched), else on `threads`, like llama.cpp's --threads-batch and
        --threads. A second thread barely speeds up a small step (shipped model, median per step:
        batch 1 1.40 against 1.47 ms on one, batch 4 1.86 against 2.06; batch 8 2.09 against
        2.83, batch 16 2.94 against 4.32), while between its parallel ops it spins on the core the
        API process needs for the step's tokens. A big forward is mostly matrix products that two
        threads nearly halve (16 prompts of 45 tokens: 25 against 45 ms), and it comes when
        prompts arrive, not while the API process streams every step's tokens."""
        size = tokens.numel()
        want = 1 if size < PARALLEL_MIN_TOKENS else self.threads if size < PROMPT_PARALLEL_TOKENS else self.prompt_threads
        if want != self._threads_now:  # about 0.1 us
            torch.set_num_threads(want)
            self._threads_now = want
        if lengths is not None:  # rows of different lengths, right-padded (LanguageModel.ragged_chunks)
            return self.model(tokens, state, lengths=lengths)
        return self.model(tokens, state)

    def _loop(self) -> None:
        self._take_threads()
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._running:
                    self._cond.wait()
                if self._closed:
                    break
                self._admit()
            try:
                with torch.inference_mode():
                    self._step()
            except BaseException as error:  # a bug in the loop itself: fail everyone, keep serving
                for job in list(self._running):
                    self._fail(job, error)
                self._groups = []
            self._flush()
        stop = ShuttingDown("the server shut down before this request finished", code="shutting_down")
        with self._cond:
            pending = list(self._waiting) + self._running
            self._waiting.clear()
        for job in pending:
            self._emit(job, stop)
        self._running = []
        self._groups = []
        self._flush()

    def _admit(self) -> None:
        """Move waiting requests into the batch while they fit (FIFO); under the lock."""
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled.is_set():
                self._waiting.popleft()
                self._dropped(job)
                continue
            if self._running_rows + job.width > self.max_batch_size and self._running_rows > 0:
                break
            self._waiting.popleft()
            self._running.append(job)
            self._running_rows += job.width
        self._m_waiting.set(len(self._waiting))

    def _remove(self, job: _Job) -> None:
        if job in self._running:
            self._running.remove(job)
            with self._cond:
                self._running_rows -= job.width

    def _step(self) -> None:
        for job in [j for j in self._running if j.cancelled.is_set()]:
            self._remove(job)  # its rows drop out of their group at the next forward
            self._dropped(job)
        self._prefill()
        self._decode()
        if not any(job.rows for job in self._running):
            self._groups = []  # nothing decoding: let go of the batched states
        self._m_running.set(len(self._running))

    # prefill ----------------------------------------------------------------------------------

    def _prefill(self) -> None:
        budget, chunks = self.prefill_chunk, []
        for job in list(self._running):
            if job.rows or job.failed:
                continue
            remaining = len(job.prompt) - job.fed
            if remaining == 0:
                self._prefilled(job)
                continue
            if budget <= 0:
                continue
            size = min(remaining, self.prefill_chunk)
            budget -= size
            chunks.append((job, job.prompt[job.fed : job.fed + size]))
        # one forward per batch key, and per chunk length unless the model takes chunks of
        # different lengths in one batch (LanguageModel.ragged_chunks)
        ragged = getattr(self.model, "ragged_chunks", False)
        by_length: dict[int, list[tuple[_Job, list[int]]]] = {}
        for job, chunk in chunks:
            by_length.setdefault(0 if ragged else len(chunk), []).append((job, chunk))
        for members in by_length.values():
            for batch in self._batches(members, lambda m: m[0].state):
                self._prefill_batch(batch)

    def _prefill_batch(self, batch: list[tuple["_Job", list[int]]]) -> None:
        jobs = [job for job, _ in batch]
        state = jobs[0].state if len(jobs) == 1 else self._concat([job.state for job in jobs])
        if state is None:  # this class cannot batch these rows after all: one by one
            for member in batch:
                self._prefill_batch([member])
            return
        try:
            lengths = [len(chunk) for _, chunk in batch]
            longest = max(lengths)
            tokens = torch.tensor([chunk + [0] * (longest - len(chunk)) for _, chunk in batch],
                                  device=self.model.device)  # (B, T), right-padded when lengths differ
            if longest == min(lengths):
                log_probs, state = self._forward(tokens, state)  # (B, T, V)
            else:
                log_probs, state = self._forward(tokens, state, torch.tensor(lengths, device=self.model.device))
            states = [state] if len(jobs) == 1 else state.split()
        except Exception as error:
            for job in jobs:
                self._fail(job, error)
            return
        self._m_prompt.inc(sum(lengths))
        for i, (job, chunk) in enumerate(batch):
            if job.echo_k is not None or job.score:
                self._record_prompt_logprobs(job, chunk, log_probs[i, : len(chunk)])
            job.state = states[i]
            job.next_log_probs = log_probs[i, len(chunk) - 1]
            job.tokens += len(chunk)
            job.fed += len(chunk)
            if job.fed == len(job.prompt):
                self._prefilled(job)

    def _record_prompt_logprobs(self, job: _Job, chunk: list[int], log_probs: torch.Tensor) -> None:
        """log_probs (T, V) of one chunk: the row before each chunk token predicted it."""
        before = job.next_log_probs  # (V,) predicted the chunk's first token; None without context
        chunk_tensor = torch.tensor(chunk, device=log_probs.device)
        predicted = log_probs[:-1].gather(1, chunk_tensor[1:, None])[:, 0].float().tolist()
        job.prompt_logprobs.extend([None if before is None else float(before[chunk[0]]), *predicted])
        if job.echo_k is not None:
            first = [] if before is None else self._tops(before[None], job.echo_k)[0]
            job.prompt_top.extend([first, *self._tops(log_probs[:-1], job.echo_k)])

    @staticmethod
    def _tops(rows: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
        """rows (R, V) -> per row the k most likely (token, log-prob)."""
        if k <= 0 or rows.shape[0] == 0:
            return [[] for _ in range(rows.shape[0])]
        values, indices = torch.topk(rows.float(), k, dim=-1)
        return [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]

    def _prefilled(self, job: _Job) -> None:
        """The whole prompt is in the state: start decoding (or finish)."""
        data = SessionData(state=job.state, tokens=job.tokens,
                           next_log_probs=None if job.next_log_probs is None else job.next_log_probs.clone())
        if job.kind == "append":
            scored = [lp for lp in job.prompt_logprobs if lp is not None]
            self._emit(job, Appended(data=data, logprob=float(sum(scored)), scored=len(scored)))
            self._remove(job)
            return
        if job.echo_k is not None and job.prompt:
            self._emit(job, PromptLogprobs(tokens=list(job.prompt), logprobs=job.prompt_logprobs, top=job.prompt_top))
        if job.params.max_tokens == 0:
            self._finish(job, data, [ChoiceFinished(i, "length", "", 0) for i in range(job.params.n)])
            return
        if job.next_log_probs is None:
            self._fail(job, InvalidInput("nothing to continue from: give a prompt", param="prompt"))
            return
        # choices share the prompt's state: states are values, a forward never changes its input
        job.rows = [_Row(job, i, job.state, data.next_log_probs) for i in range(job.params.n)]

    # decode -----------------------------------------------------------------------------------

    def _decode(self) -> None:
        rows = [row for job in self._running for row in job.rows if row.finish_reason is None]
        if not rows:
            return
        forward = []
        for row in rows:
            params = row.job.params
            if row.plain_greedy and row.greedy is not None:  # argmax taken once for the whole batch
                token, logprob = row.greedy
            else:
                token = row.sampler.choose(row.host_log_probs)
                logprob = float(row.host_log_probs[token])
            row.generated += 1
            text, stopped = row.stops.push(row.detokenizer.push(token))
            top = top_alternatives(row.host_log_probs, params.logprobs) if params.logprobs else []
            self._emit(row.job, TokenEvent(token, text, logprob, top, row.index))
            if stopped:
                row.finish_reason = "stop"
            elif row.generated >= params.max_tokens:
                row.finish_reason = "length"
            if row.finish_reason is None or row.job.keep_state:  # a session keeps every token it generated
                row.pending = token
                forward.append(row)
        self._flush()  # tokens leave before the forward that follows them
        self._m_generated.inc(len(rows))
        if forward:
            self._m_batch.observe(len(forward))
            self._forward_rows(forward)
        for row in rows:
            if row.finish_reason is not None and not row.job.failed:
                self._finish_row(row)

    def _forward_rows(self, rows: list[_Row]) -> None:
        """Run each row's pending token through the model, in as few batched calls as the
        state class allows. Groups survive between steps: rows leave them (`_leave`) and join
        them (an idle place, else a concatenation) without re-forming the others."""
        wanted = {id(row) for row in rows}
        groups, loose = [], []
        for group in self._groups:
            leaving = [row for row in group.live if id(row) not in wanted]  # cancelled, failed, finished unforwarded
            if leaving and not self._leave(group, leaving):
                loose += [row for row in group.live if id(row) in wanted]  # broken up: each holds its state
                continue
            if group.live:
                groups.append(group)
        grouped = {id(row) for group in groups for row in group.live}
        loose_ids = {id(row) for row in loose}
        loose += [row for row in rows if id(row) not in grouped and id(row) not in loose_ids]
        for batch in self._batches(loose, lambda row: row.state):
            key = self._key(batch[0].state)
            target = next((g for g in groups if g.key == key and len(g.live) + len(batch) <= self.max_batch_size), None)
            if target is not None:
                batch = self._join_idle_places(target, batch)
                if not batch:
                    continue
                merged = self._concat([target.state, *(row.state for row in batch)]) if self._compact(target) else None
                if merged is not None:
                    target.state, target.rows = merged, target.rows + batch
                    for row in batch:
                        row.state = None
                    continue
            state = batch[0].state if len(batch) == 1 else self._concat([row.state for row in batch])
            if state is None:  # concat refused: these rows run one by one
                groups.extend(_Group(rows=[row], state=row.state, key=self._key(row.state)) for row in batch)
            else:
                groups.append(_Group(rows=list(batch), state=state, key=key))
            for row in batch:
                row.state = None
        self._groups = []
        for group in groups:
            if group.idle_steps >= IDLE_PLACE_STEPS:
                self._compact(group)
            try:
                pending = [[0 if row is None else row.pending] for row in group.rows]  # an idle place decodes a 0
                tokens = torch.tensor(pending, device=self.model.device)  # (B, 1)
                log_probs, group.state = self._forward(tokens, group.state)  # (B, 1, V)
            except Exception as error:
                for job in {id(row.job): row.job for row in group.live}.values():
                    self._fail(job, error)
                continue
            group.key = self._key(group.state)  # shapes may have grown
            group.idle_steps += len(group.rows) - len(group.live)
            last = log_probs[:, -1]  # (B, V)
            host = last.float().cpu()  # one transfer for the batch (a no-op on the CPU)
            best = host.argmax(dim=-1, keepdim=True)  # (B, 1): greedy rows need nothing else
            greedy = zip(best[:, 0].tolist(), host.gather(1, best)[:, 0].tolist())
            for i, (row, choice) in enumerate(zip(group.rows, greedy)):
                if row is None:
                    continue
                row.next_log_probs, row.host_log_probs, row.greedy = last[i], host[i], choice
                row.tokens += 1
                row.pending = None
            finished = [row for row in group.live if row.finish_reason is not None]
            if (not finished or self._leave(group, finished)) and group.live:
                self._groups.append(group)
            # else: empty, or broken up with every row holding its own state (those still
            # decoding batch afresh next step)

    def _leave(self, group: _Group, leaving: list[_Row]) -> bool:
        """`leaving` rows leave `group`, each with its own state (a session keeps its final one).

        Where the state class writes a row in place (State.put_row) and the group has places to
        spare, a row's place stays in the batch, idle: it decodes a dummy token (a row's share of
        a step, about 0.2 ms in a batch of 16 of the shipped model) until a joining row takes it
        (`_join_idle_places`, one row's copy) or the idle places have cost IDLE_PLACE_STEPS
        row-steps, about one copy of the batch, and are dropped (`_compact`). Joining and leaving
        otherwise cost a copy of the whole batch each: over HTTP at 16 streams those copies were
        7.8% of the engine's time, as requests end and begin at different steps. A leaving row
        then gets a copy of its state, and only where a session keeps it, for its place may be
        written over. Otherwise the rows that stay are taken out at once (State.take), and the
        rows that leave keep views into the old state, which the group no longer writes.
        False when the class cannot take rows out either: the group is broken up and every
        row holds its own state."""
        going = {id(row) for row in leaving}
        places = type(group.state).put_row is not State.put_row and len(group.rows) > 1
        kept = [row for row in leaving if row.job.keep_state and not row.job.failed]
        states = self._split(group) if kept or not places else None  # views, one per place
        for i, row in enumerate(group.rows):
            if row is not None and id(row) in going:
                if places:
                    row.state = states[i].clone() if row in kept else None
                else:
                    row.state = states[i]
                group.rows[i] = None
        if places or self._compact(group):
            return True
        for row, state in zip(group.rows, states):
            if row is not None:
                row.state = state
        return False

    def _join_idle_places(self, group: _Group, batch: list[_Row]) -> list[_Row]:
        """Write joining rows into the group's idle places (State.put_row); returns the rows
        that found none, or did not fit one."""
        remaining = []
        for row in batch:
            place = next((i for i, other in enumerate(group.rows) if other is None), None)
            try:
                fits = place is not None and group.state.put_row(place, row.state)
            except (RuntimeError, ValueError):
                fits = False
            if fits:
                group.rows[place], row.state = row, None
            else:
                remaining.append(row)
        if None not in group.rows:
            group.idle_steps = 0
        return remaining

    def _compact(self, group: _Group) -> bool:
        """Drop the group's idle places: its live rows, taken out in one State.take. False, with
        the group unchanged, when the class cannot."""
        indices = [i for i, row in enumerate(group.rows) if row is not None]
        if len(indices) == len(group.rows):
            return True
        if not indices:  # nobody left: the caller drops the group
            group.rows, group.idle_steps = [], 0
            return True
        try:
            state = self._split(group)[indices[0]] if len(indices) == 1 else group.state.take(indices)
        except (RuntimeError, ValueError):
            return False
        group.rows, group.state, group.idle_steps = [group.rows[i] for i in indices], state, 0
        group.key = self._key(state)
        return True

    def _split(self, group: _Group) -> list[State]:
        return [group.state] if len(group.rows) == 1 else group.state.split()

    def _key(self, state: State) -> tuple:
        """Rows with equal keys may be concatenated: any two rows of a class whose concat
        pads (it overrides State.concat), else rows whose tensors have equal shapes."""
        cls = type(state)
        ragged = self._ragged_ok.get(cls)
        if ragged is None:
            ragged = self._ragged_ok[cls] = cls.concat.__func__ is not State.concat.__func__
        if ragged:
            return (cls,)
        return (cls, tuple(tuple(t.shape[1:]) for t in _state_tensors(state)))

    def _concat(self, states: list[State]) -> State | None:
        try:
            return type(states[0]).concat(states)
        except (RuntimeError, ValueError):
            self._ragged_ok[type(states[0])] = False  # from now on: group by shape
            return None

    def _batches(self, items: list, state_of) -> list[list]:
        """Split items into lists whose states may be concatenated (up to max_batch_size)."""
        by_key: dict[tuple, list] = {}
        for item in items:
            by_key.setdefault(self._key(state_of(item)), []).append(item)
        return [members[start : start + self.max_batch_size]
                for members in by_key.values() for start in range(0, len(members), self.max_batch_size)]

    # endings ----------------------------------------------------------------------------------

    def _finish_row(self, row: _Row) -> None:
        job = row.job
        if row.finish_reason == "stop":
            tail = ""
        else:
            tail = row.stops.push(row.detokenizer.flush())[0] + row.stops.flush()
        choice = ChoiceFinished(row.index, row.finish_reason, tail, row.generated)
        job.done.append(choice)
        self._emit(job, choice)
        if len(job.done) < len(job.rows):
            return
        first = job.rows[0]
        if job.keep_state:
            data = SessionData(state=first.state, tokens=first.tokens, next_log_probs=first.next_log_probs.clone())
        else:  # nothing to commit; the state after the prompt
            data = SessionData(state=job.state, tokens=job.tokens, next_log_probs=job.next_log_probs)
        self._finish(job, data, sorted(job.done, key=lambda c: c.index))

    def _finish(self, job: _Job, data: SessionData, choices: list[ChoiceFinished]) -> None:
        completion = sum(c.completion_tokens for c in choices)
        self._emit(job, Finished(choices=choices, prompt_tokens=len(job.prompt), completion_tokens=completion,
                                 cached_tokens=job.cached_tokens, data=data))
        for choice in choices:
            self.metrics.requests.labels(self.name, choice.finish_reason).inc()
        self._remove(job)

    def _dropped(self, job: _Job) -> None:
        """A cancelled job leaves: like every job it ends with one last event (Cancelled), so
        whoever tracks it (the engine process, its sink) can forget it."""
        self._m_cancelled.inc()
        self._emit(job, Cancelled())

    def _fail(self, job: _Job, error: BaseException) -> None:
        job.failed = True
        for row in job.rows:
            row.finish_reason = row.finish_reason or "error"
        self._emit(job, error)
        self._remove(job)

    def _emit(self, job: _Job, event: object) -> None:
        self._outbox.append((job.submission, event))

    def _flush(self) -> None:
        """Hand the step's events to the event loop(s). A loop is woken (a write to its self-pipe)
        only when it has nothing pending from us: while it is busy, events just pile up and it
        takes them all in one go, so a loaded loop costs the worker no system calls."""
        if not self._outbox:
            return
        if self._sink is not None:
            outbox, self._outbox = self._outbox, []
            self._sink(outbox)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for submission, event in self._outbox:
            by_loop.setdefault(submission.loop, []).append((submission, event))
        self._outbox = []
        for loop, items in by_loop.items():
            with self._delivery_lock:
                pending = self._pending.setdefault(loop, [])
                wake = not pending
                pending.extend(items)
            if wake:
                try:
                    loop.call_soon_threadsafe(self._deliver, loop)
                except RuntimeError:  # that loop is closed: nobody is listening
                    with self._delivery_lock:
                        self._pending.pop(loop, None)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:  # on the event loop
        with self._delivery_lock:
            items = self._pending.pop(loop, [])
        for submission, event in items:
            submission.queue.put_nowait(event)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()
