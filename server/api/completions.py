"""POST /v1/completions: OpenAI's completions API, plus `session_id` and `top_k`.

With `session_id` the prompt continues the session's memory instead of starting from nothing:
the history is not recomputed, and `usage.prompt_tokens_details.cached_tokens` says how many
tokens of context came from memory. The session's memory afterwards holds the prompt and every
generated token (a stop string included, since the model produced it), committed only when the
request completes.
"""

from __future__ import annotations

import json
import secrets
import time
from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from server.api.deps import AppState, app_state, owner_of, session_errors
from server.cache import SessionLocked, SessionNotFound
from server.engine import Finished, GenerationJob, PromptLogprobs, TokenEvent
from server.errors import InvalidRequest, as_api_error
from server.sampling import SamplingParams

router = APIRouter()


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | list[int] = ""
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    n: int = Field(1, ge=1, le=1)
    session_id: str | None = None
    user: str | None = None


def _sampling(body: CompletionRequest) -> SamplingParams:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4:
        raise InvalidRequest("at most 4 stop strings", param="stop")
    return SamplingParams(
        max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=max(body.top_k, 0), seed=body.seed, stop=stops, logprobs=body.logprobs, echo=body.echo,
    )


def prompt_tokens(state: AppState, served, prompt: str | list[int]) -> list[int]:
    limit = state.settings.max_prompt_bytes
    if isinstance(prompt, str):
        tokens = served.tokenizer.encode(prompt)
    else:
        tokens = list(prompt)
        vocab = served.model.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    if len(tokens) > limit:
        raise InvalidRequest(f"prompt is {len(tokens)} tokens; the limit is {limit} (XLSERVE_MAX_PROMPT_BYTES)",
                             param="prompt", code="prompt_too_long")
    return tokens


class _Request:
    """One completion in flight: the job, its session lease, and the pieces of the answer."""

    def __init__(self, state: AppState, body: CompletionRequest, owner: str | None):
        self.state, self.body = state, body
        self.served = state.served(body.model)
        params = _sampling(body)
        if body.max_tokens > state.settings.max_tokens_limit:
            raise InvalidRequest(f"max_tokens is {body.max_tokens}; the limit is {state.settings.max_tokens_limit}",
                                 param="max_tokens")
        tokens = prompt_tokens(state, self.served, body.prompt)
        self.lease = None
        if body.session_id:
            try:
                self.lease = state.cache.acquire(body.session_id, owner)
            except (SessionNotFound, SessionLocked) as error:
                raise session_errors(error, body.session_id) from None
            if self.lease.info.model != body.model:
                state.cache.release(self.lease)
                raise InvalidRequest(f"session '{body.session_id}' belongs to model '{self.lease.info.model}'",
                                     param="model")
            start = self.lease.data
        else:
            start = self.served.engine.fresh_data()
        if not tokens and start.next_log_probs is None and (body.max_tokens > 0 or body.echo):
            self.release()
            raise InvalidRequest("prompt is empty and there is no session history to continue", param="prompt")
        self.job = GenerationJob(prompt=tokens, params=params, start=start, keep_state=self.lease is not None)
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.text_length = 0

    def release(self) -> None:
        if self.lease is not None:
            self.state.cache.release(self.lease)

    def commit(self, finished: Finished) -> None:
        if self.lease is not None:
            info = self.state.cache.commit(self.lease, finished.data)
            self.state.metrics.state_bytes_per_session.labels(self.body.model).observe(info.state_bytes)
        self.state.metrics.memory_reused_tokens.labels(self.body.model).inc(finished.cached_tokens)

    def add_logprobs(self, tokens, logprobs, tops, text_pieces) -> dict | None:
        if self.body.logprobs is None:
            self.text_length += sum(len(t) for t in text_pieces)
            return None
        name = self.served.tokenizer.token_text
        piece = {
            "tokens": [name(t) for t in tokens],
            "token_logprobs": list(logprobs),
            "top_logprobs": [None if lp is None else {name(t): v for t, v in top} for top, lp in zip(tops, logprobs)],
            "text_offset": [],
        }
        for text in text_pieces:
            piece["text_offset"].append(self.text_length)
            self.text_length += len(text)
        for key in self.logprobs:
            self.logprobs[key].extend(piece[key])
        return piece

    def echo_event(self, event: PromptLogprobs) -> tuple[str, dict | None]:
        detokenizer = self.served.tokenizer.detokenizer()
        pieces = [detokenizer.push(t) for t in event.tokens]
        pieces[-1] += detokenizer.flush()
        return "".join(pieces), self.add_logprobs(event.tokens, event.logprobs, event.top, pieces)

    def usage(self, finished: Finished) -> dict:
        return {
            "prompt_tokens": finished.prompt_tokens,
            "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
        }

    def envelope(self, choices: list[dict], **extra) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.body.model,
                "choices": choices, **extra}
        if self.lease is not None:
            body["session_id"] = self.lease.session_id
        return body


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, owner: str | None = Depends(owner_of)):
    state = app_state(request)
    call = _Request(state, body, owner)
    if body.stream:
        return StreamingResponse(_stream(call), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text, finished = [], None
    try:
        if body.echo and body.logprobs is None:
            text.append(call.served.tokenizer.decode(call.job.prompt))
        async for event in call.served.engine.generate(call.job):
            if isinstance(event, PromptLogprobs):
                text.append(call.echo_event(event)[0])
            elif isinstance(event, TokenEvent):
                text.append(event.text)
                call.add_logprobs([event.token], [event.logprob], [event.top], [event.text])
            elif isinstance(event, Finished):
                finished = event
                text.append(event.text_tail)
        call.commit(finished)
    except BaseException as error:
        call.release()
        state.metrics.request_errors.labels(body.model, as_api_error(error).type).inc()
        if isinstance(error, ValueError):
            raise InvalidRequest(str(error)) from None
        raise
    choice = {"text": "".join(text), "index": 0, "finish_reason": finished.finish_reason,
              "logprobs": call.logprobs if body.logprobs is not None else None}
    return call.envelope([choice], usage=call.usage(finished))


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _stream(call: _Request):
    """SSE chunks as OpenAI sends them; an error after the stream started is sent in-band."""
    finished = None
    try:
        if call.body.echo and call.body.logprobs is None and call.job.prompt:
            yield sse(call.envelope([{"text": call.served.tokenizer.decode(call.job.prompt), "index": 0,
                                      "logprobs": None, "finish_reason": None}]))
        async for event in call.served.engine.generate(call.job):
            if isinstance(event, PromptLogprobs):
                text, logprobs = call.echo_event(event)
                yield sse(call.envelope([{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": None}]))
            elif isinstance(event, TokenEvent):
                logprobs = call.add_logprobs([event.token], [event.logprob], [event.top], [event.text])
                if event.text or logprobs:
                    yield sse(call.envelope([{"text": event.text, "index": 0, "logprobs": logprobs,
                                              "finish_reason": None}]))
            elif isinstance(event, Finished):
                finished = event
        call.commit(finished)
        yield sse(call.envelope([{"text": finished.text_tail, "index": 0, "logprobs": None,
                                  "finish_reason": finished.finish_reason}]))
        if call.body.stream_options and call.body.stream_options.include_usage:
            yield sse(call.envelope([], usage=call.usage(finished)))
        yield sse("[DONE]")
    except Exception as error:
        call.release()
        api_error = as_api_error(InvalidRequest(str(error)) if isinstance(error, ValueError) else error)
        call.state.metrics.request_errors.labels(call.body.model, api_error.type).inc()
        yield sse(api_error.body())
        yield sse("[DONE]")
    finally:
        call.release()  # a no-op after a commit; on disconnect the session stays as it was
