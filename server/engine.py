"""The engine: runs one model's requests off the event loop and streams their tokens back.

Each loaded model gets one `Engine` with a worker thread (torch releases the GIL, so the event
loop stays responsive). A request's model work never touches the session it came from: it
starts from the committed `SessionData` and produces a new one, which the caller commits only
when the request completes. Cancelling (client gone, explicit cancel) is checked before every
model step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from models.interface import LanguageModel
from server.cache import SessionData
from server.metrics import Metrics
from server.sampling import Sampler, SamplingParams, StopChecker, top_alternatives


class Cancelled(Exception):
    """The request was cancelled before it completed; nothing is committed."""


@dataclass
class PromptLogprobs:
    """Log-probabilities of the prompt's own tokens (for echo + logprobs)."""

    tokens: list[int]
    logprobs: list[float | None]  # None for a first token that had no context
    top: list[list[tuple[int, float]]]


@dataclass
class TokenEvent:
    token: int
    text: str  # text released by this token ("" while a character or stop string is incomplete)
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Finished:
    finish_reason: str  # "length" or "stop"
    text_tail: str  # text held back until the end of the stream
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    data: SessionData  # the session as it stands after this request


@dataclass
class GenerationJob:
    prompt: list[int]
    params: SamplingParams
    start: SessionData
    keep_state: bool  # a session request: every generated token goes into the memory
    cancelled: threading.Event = field(default_factory=threading.Event)


class Engine:
    def __init__(self, name: str, model: LanguageModel, tokenizer, metrics: Metrics, prefill_chunk: int = 512):
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{name}")

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -- model work (worker thread) ---------------------------------------------------------

    def fresh_data(self) -> SessionData:
        with torch.inference_mode():
            return SessionData(state=self.model.init_state(1), tokens=0, next_log_probs=None)

    def _feed(self, data: SessionData, tokens: list[int], want_rows: bool, cancelled: threading.Event | None = None):
        """Run `tokens` through the model in prefill chunks. Returns the new SessionData and,
        when `want_rows`, the log-prob row that predicted each token (None for a first token
        without context)."""
        state, next_log_probs = data.state, data.next_log_probs
        rows: list[torch.Tensor | None] = []
        device = self.model.device
        for start in range(0, len(tokens), self.prefill_chunk):
            if cancelled is not None and cancelled.is_set():
                raise Cancelled()
            chunk = tokens[start : start + self.prefill_chunk]
            log_probs, state = self.model(torch.tensor([chunk], device=device), state)  # (1, T, V)
            if want_rows:
                rows.append(next_log_probs)
                rows.extend(log_probs[0, :-1])
            next_log_probs = log_probs[0, -1]
        return SessionData(state=state, tokens=data.tokens + len(tokens), next_log_probs=next_log_probs), rows

    def _generate_sync(self, job: GenerationJob, emit: Callable[[object], None]) -> Finished:
        params = job.params
        with torch.inference_mode():
            data, rows = self._feed(job.start, job.prompt, want_rows=params.echo and params.logprobs is not None, cancelled=job.cancelled)
            if rows:
                k = params.logprobs or 0
                emit(PromptLogprobs(
                    tokens=list(job.prompt),
                    logprobs=[None if row is None else float(row[t]) for row, t in zip(rows, job.prompt)],
                    top=[[] if row is None else top_alternatives(row, k) for row in rows],
                ))
            sampler = Sampler(params)
            detokenizer = self.tokenizer.detokenizer()
            stops = StopChecker(params.stop)
            finish_reason, generated = "length", 0
            if params.max_tokens > 0 and data.next_log_probs is None:
                raise ValueError("nothing to continue from: give a prompt")
            for step in range(params.max_tokens):
                if job.cancelled.is_set():
                    raise Cancelled()
                row = data.next_log_probs
                token = sampler.choose(row)
                generated += 1
                text, stopped = stops.push(detokenizer.push(token))
                emit(TokenEvent(token, text, float(row[token]),
                                top_alternatives(row, params.logprobs or 0) if params.logprobs is not None else []))
                last = step == params.max_tokens - 1 or stopped
                if job.keep_state or not last:
                    data, _ = self._feed(data, [token], want_rows=False)
                if stopped:
                    finish_reason = "stop"
                    break
            tail = "" if finish_reason == "stop" else stops.push(detokenizer.flush())[0] + stops.flush()
        return Finished(
            finish_reason=finish_reason, text_tail=tail, prompt_tokens=len(job.prompt),
            completion_tokens=generated, cached_tokens=job.start.tokens, data=data,
        )

    # -- the async face (event loop) --------------------------------------------------------

    async def generate(self, job: GenerationJob) -> AsyncIterator[object]:
        """Yields PromptLogprobs?, TokenEvent*, then Finished; raises on error. Leaving the
        iteration early cancels the job within one model step."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        emit = lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)  # noqa: E731

        def work():
            try:
                emit(self._generate_sync(job, emit))
            except BaseException as error:  # delivered to the consumer, which re-raises
                emit(error)

        started = time.monotonic()
        last_token_at = None
        self.metrics.requests_running.labels(self.name).inc()
        future = loop.run_in_executor(self._executor, work)
        try:
            while True:
                event = await queue.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, TokenEvent):
                    now = time.monotonic()
                    if last_token_at is None:
                        self.metrics.time_to_first_token.labels(self.name).observe(now - started)
                    else:
                        self.metrics.inter_token_latency.labels(self.name).observe(now - last_token_at)
                    last_token_at = now
                yield event
                if isinstance(event, Finished):
                    self.metrics.e2e_latency.labels(self.name).observe(time.monotonic() - started)
                    self.metrics.prompt_tokens.labels(self.name).inc(event.prompt_tokens)
                    self.metrics.generation_tokens.labels(self.name).inc(event.completion_tokens)
                    self.metrics.requests.labels(self.name, event.finish_reason).inc()
                    return
        finally:
            job.cancelled.set()  # no-op when finished; stops the worker when the consumer left
            self.metrics.requests_running.labels(self.name).dec()
            await asyncio.shield(future)

    async def append(self, start: SessionData, tokens: list[int], score: bool) -> tuple[SessionData, float, int]:
        """Feed a document chunk into a session. Returns the new data, the summed natural-log
        probability of the scored tokens, and how many were scored (a first token with no
        context is not)."""

        def work():
            with torch.inference_mode():
                data, rows = self._feed(start, tokens, want_rows=score)
            if not score:
                return data, 0.0, 0
            scored = [(row, t) for row, t in zip(rows, tokens) if row is not None]
            return data, float(sum(row[t] for row, t in scored)), len(scored)

        self.metrics.requests_running.labels(self.name).inc()
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._executor, work)
        finally:
            self.metrics.requests_running.labels(self.name).dec()
        self.metrics.prompt_tokens.labels(self.name).inc(len(tokens))
        return result
