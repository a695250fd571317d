"""POST /v1/completions and /v1/chat/completions: OpenAI response bodies and SSE chunks."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable

import anyio
from fastapi import Request
from pydantic import ValidationError
from fastapi.responses import StreamingResponse

from xlserve.models.tokenizer import token_string_bytes
from xlserve.server.api.deps import AppState, ServedModel
from xlserve.server.api.chat import ChatTemplateError
from xlserve.server.api.errors import APIError, InvalidRequest, validation_error
from xlserve.server.api.serving.cancellation import Cancellation, cancel_on_disconnect, disconnected
from xlserve.server.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    SamplingOptions,
    ToolDefinition,
)
from xlserve.server.engine.errors import Cancelled, ContextLengthExceeded, InvalidInput
from xlserve.server.engine.types import (
    ChoiceFinished,
    Finished,
    PromptLogprobs,
    Submission,
    TokenEvent,
)
from xlserve.server.api.serving.generation import Generation
from xlserve.server.api.serving.leases import QUEUED, queued
from xlserve.server.api.serving.requests import error_for, replayed_headers, send_within, usage
from xlserve.server.api.structured import (
    CONSTRAINT_FIELDS,
    ToolCallStream,
    called_functions,
    render_message,
    tool_grammar,
    tool_refusal,
)


log = logging.getLogger("xlserve.server")


# -- POST /v1/completions -------------------------------------------------------------------------


class CompletionChoice:
    """The pieces of one choice's answer: its text and OpenAI-style logprobs."""

    def __init__(self, index: int, want_logprobs: bool):
        self.index = index
        self.text: list[str] = []
        self.want_logprobs = want_logprobs
        # the whole answer's logprobs, for its body; a stream that remembers no answer keeps none
        # (each piece's go out in its chunk), so its memory does not grow with max_tokens x logprobs
        self.keep_logprobs = True
        self.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        # characters decoded so far, held back for a stop string or not: a token's text_offset
        # is where its own text starts, not where the text released so far ends
        self.text_length = 0
        self.finish_reason: str | None = None
        # completions' top_logprobs list the chosen token too (OpenAI's and vLLM's: up to
        # logprobs + 1 entries); chat's list exactly the top_logprobs most likely (ChatCompletion)
        self.chosen_in_top = True

    def add(self, token_name, tokens, logprobs, tops, pieces, widths=None) -> dict | None:
        """Record text pieces (one per token) and their logprobs; returns this piece's logprobs.
        `widths`: the characters each token decoded to (TokenEvent.width), where text held back
        for a stop string makes a piece shorter; else each piece's length."""
        self.text.extend(pieces)
        if widths is None:
            widths = [len(text) for text in pieces]
        if not self.want_logprobs:
            self.text_length += sum(widths)
            return None
        piece = {
            "tokens": [token_name(t) for t in tokens],
            "token_logprobs": list(logprobs),
            # the `logprobs` most likely tokens and always the one chosen, as OpenAI and vLLM
            # answer (up to logprobs + 1 entries; logprobs=0: the chosen token's alone)
            "top_logprobs": [None if lp is None else {token_name(t): v for t, v in top}
                             | ({token_name(token): lp} if self.chosen_in_top else {})
                             for token, top, lp in zip(tokens, tops, logprobs)],
            "text_offset": [],
        }
        for width in widths:
            piece["text_offset"].append(self.text_length)
            self.text_length += width
        if self.keep_logprobs:
            for key in self.logprobs:
                self.logprobs[key].extend(piece[key])
        return piece


class Completion(Generation):
    """A generation asked for through /v1/completions: its id, and the answer of each choice."""

    body: CompletionRequest

    def __init__(self, state: AppState, body: CompletionRequest, owner: str | None, idempotency_key: str | None = None,
                 field_names: dict[str, str] | None = None):
        super().__init__(state, body, owner, echo=body.echo, n=body.n, idempotency_key=idempotency_key,
                         kind="completion", field_names=field_names)
        self.replayed = False  # the answer is the remembered one of an earlier request with the same key
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        # with several prompts, choice prompt_index * n + choice_index answers prompt prompt_index (as OpenAI)
        self.choices = [CompletionChoice(i, body.logprobs is not None) for i in range(len(self.prompts) * body.n)]
        self.token_name = self.served.tokenizer.token_string  # the text each token adds

    def echo_text(self, index: int = 0) -> str:
        """The prompt of choice `index`, as text."""
        return self.served.tokenizer.decode(self.prompts[index // self.body.n])

    def choices_for(self, event: PromptLogprobs) -> list[CompletionChoice]:
        """The choices that answer the prompt `event` scores (PromptBatch says which)."""
        prompt = getattr(event, "prompt", 0)
        return self.choices[prompt * self.body.n:(prompt + 1) * self.body.n]

    def chunk_format(self, extra: dict) -> Callable[..., bytes]:
        """The SSE event of one chunk of one choice (see `_chunk_format`)."""
        return _chunk_format(self, extra)

    def echo_pieces(self, event: PromptLogprobs) -> list[str]:
        detokenizer = self.served.tokenizer.detokenizer()
        pieces = [detokenizer.push(t) for t in event.tokens]
        pieces[-1] += detokenizer.flush()
        return pieces

    def add_token(self, event: TokenEvent) -> dict | None:
        return self.choices[event.index].add(self.token_name, [event.token], [event.logprob], [event.top],
                                             [event.text], None if event.width is None else [event.width])

    def response(self, finished: Finished) -> dict:
        """The whole answer, as OpenAI's non-streamed body (also what an Idempotency-Key remembers)."""
        choices = [{"text": "".join(c.text), "index": c.index, "finish_reason": c.finish_reason,
                    "logprobs": c.logprobs if self.body.logprobs is not None else None} for c in self.choices]
        return self.envelope(choices, usage=usage(finished.prompt_tokens, finished.completion_tokens,
                                                  finished.cached_tokens))

    def envelope(self, choices: list[dict], **extra) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.body.model,
                "choices": choices, **extra}
        if self.lease is not None:
            body["session_id"] = self.lease.session_id
        return body


async def complete(completion: Completion, request: Request) -> dict:
    """The whole answer of a non-streamed completion, as OpenAI's body. A client that hangs up
    stops the generation at the engine's next step; nothing is committed unless the commit had
    begun (server/api/serving/cancellation.py)."""
    body = completion.body
    finished = None
    async with completion.leased(), cancel_on_disconnect(request, Cancellation()) as cancellation:
        if completion.replay is not None:
            completion.replayed = True
            return completion.replay["result"]
        cancellation.check()  # the client left while the session was being fetched
        submission = cancellation.track(await completion.submit())  # 429 / 503 here
        try:
            if body.echo and body.logprobs is None:
                for choice in completion.choices:
                    choice.text.append(completion.echo_text(choice.index))
            async for event in submission.events():
                if isinstance(event, TokenEvent):
                    completion.add_token(event)
                elif isinstance(event, ChoiceFinished):
                    completion.choices[event.index].text.append(event.text_tail)
                    completion.choices[event.index].finish_reason = event.finish_reason
                elif isinstance(event, PromptLogprobs):
                    pieces = completion.echo_pieces(event)
                    for choice in completion.choices_for(event):
                        choice.add(completion.token_name, event.tokens, event.logprobs, event.top, pieces)
                elif isinstance(event, Finished):
                    finished = event
            answer = completion.response(finished)
            cancellation.begin_commit()  # a disconnect before this point wins: nothing is committed
            await completion.commit(finished, answer if completion.remembering else None)
        except ValueError as error:  # answered (and counted) by the app's error handlers
            raise error_for(error) from None
    return answer


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


# SSE chunks joined into one write at most (_completion_chunks): about 100 bytes to 2 KB each
WRITE_CHUNKS = 256


class EventStream(StreamingResponse):
    """A streaming response that notices a client disconnect at once (not only at the next
    write) and closes the stream, so the generation is cancelled within one engine step. A client
    that stops reading is gone too, once one write has waited `send_timeout` seconds for its full
    socket (XLSERVE_STREAM_SEND_TIMEOUT_SECONDS): it would otherwise hold its session and its
    request for as long as it keeps the connection open."""

    def __init__(self, *args, send_timeout: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.send_timeout = send_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            try:
                await self.stream_response(send_within(send, self.send_timeout))
            except TimeoutError:  # first: TimeoutError is an OSError
                log.warning("a streamed answer's client took no write for %gs (XLSERVE_STREAM_SEND_TIMEOUT_SECONDS): "
                            "its stream is ended and its request cancelled", self.send_timeout)
            except OSError:  # the client went away mid-write
                pass
            finally:
                task_group.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                task_group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


async def stream_completion(completion: Completion, request: Request | None = None) -> EventStream:
    """A streamed completion's response, once the generation is queued (a refusal before then
    is an HTTP error). With the `request`, a client that hangs up before then cancels it."""
    answer = _completion_chunks(completion)
    chunks = await (queued(answer) if request is None else _queued_while_connected(request, answer))
    return EventStream(chunks, send_timeout=completion.state.settings.server.stream_send_timeout_seconds,
                       media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                **replayed_headers(completion.replayed)})


async def _queued_while_connected(request: Request, answer: AsyncGenerator) -> AsyncGenerator:
    """`queued(answer)`, watching the connection meanwhile: queuing can take seconds (the first
    compile of a constraint, up to XLSERVE_STRUCTURED_COMPILE_SECONDS and a wait for a compile
    thread; a prefix lookup in Redis), and nothing else notices a client that hangs up then. Its
    request is cancelled (the engine drops it: client.py `_queue` sends Cancel), nothing is
    committed, and it is answered 499 (Cancelled), as a plain request that loses its client is."""
    queuing, watcher = asyncio.ensure_future(queued(answer)), asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({queuing, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if queuing.done():
        return queuing.result()
    queuing.cancel()
    await asyncio.gather(queuing, return_exceptions=True)
    await answer.aclose()
    raise Cancelled()


def _replayed_chunks(answer: dict, include_usage: bool) -> bytes:
    """A remembered completion (Idempotency-Key) as its stream: one chunk per choice with its whole
    text, the usage chunk when asked for, [DONE]."""
    envelope = {name: value for name, value in answer.items() if name not in ("choices", "usage")}
    extra = {"usage": None} if include_usage else {}
    events = [sse({**envelope, "choices": [choice], **extra}) for choice in answer["choices"]]
    if include_usage:
        events.append(sse({**envelope, "choices": [], "usage": answer["usage"]}))
    return b"".join(events) + sse("[DONE]")


def _chunk_format(completion: Completion, extra: dict) -> Callable[..., bytes]:
    """The SSE event of one chunk of one choice."""
    # a text-only chunk is the same JSON every time but for its text: format it from a template
    templates = [json.dumps(completion.envelope([{"text": "\x00", "index": i, "logprobs": None, "finish_reason": None}],
                                                **extra)).split('"\\u0000"') for i in range(len(completion.choices))]

    def chunk(index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> bytes:
        if logprobs is None and finish_reason is None:
            head, tail = templates[index]
            return f"data: {head}{json.dumps(text)}{tail}\n\n".encode()
        return sse(completion.envelope([{"text": text, "index": index, "logprobs": logprobs,
                                         "finish_reason": finish_reason}], **extra))

    return chunk


async def _completion_chunks(completion: Completion) -> AsyncGenerator:
    """SSE chunks as OpenAI sends them: one per released piece of text per choice, a last one per
    choice with its `finish_reason`, with `stream_options.include_usage` a final one with empty
    `choices` and the `usage`, then `data: [DONE]`. An error after the stream started is sent in
    the stream. Chunks that are ready together (the client or the loop fell behind) go out in
    one write."""
    body = completion.body
    extra = {"usage": None} if body.stream_options and body.stream_options.include_usage else {}
    pending: list[bytes] = []
    failure: APIError | None = None
    async with completion.leased():
        if completion.replay is not None:
            completion.replayed = True
            yield QUEUED
            yield _replayed_chunks(completion.replay["result"], bool(extra))
            return
        submission = await completion.submit()
        yield QUEUED
        if not completion.remembering:  # no body is built from the whole answer (see CompletionChoice)
            for choice in completion.choices:
                choice.keep_logprobs = False
        chunk = completion.chunk_format(extra)  # now that the lease is held: chunks name its session
        try:
            if body.echo and body.logprobs is None and completion.tokens:
                for choice in completion.choices:
                    echoed = completion.echo_text(choice.index)
                    choice.text.append(echoed)  # the whole answer, for an Idempotency-Key
                    pending.append(chunk(choice.index, echoed))
            async for event in submission.events():
                if isinstance(event, TokenEvent):
                    logprobs = completion.add_token(event)
                    if event.text or logprobs:
                        pending.append(chunk(event.index, event.text, logprobs))
                elif isinstance(event, ChoiceFinished):
                    completion.choices[event.index].text.append(event.text_tail)
                    completion.choices[event.index].finish_reason = event.finish_reason
                    pending.append(chunk(event.index, event.text_tail, None, event.finish_reason))
                elif isinstance(event, PromptLogprobs):
                    pieces = completion.echo_pieces(event)
                    for choice in completion.choices_for(event):
                        logprobs = choice.add(completion.token_name, event.tokens, event.logprobs, event.top, pieces)
                        pending.append(chunk(choice.index, "".join(pieces), logprobs))
                elif isinstance(event, Finished):
                    await completion.commit(event, completion.response(event) if completion.remembering else None)
                    if extra:
                        pending.append(sse(completion.envelope([], usage=usage(
                            event.prompt_tokens, event.completion_tokens, event.cached_tokens))))
                # chunks ready together go out in one write, at most WRITE_CHUNKS of them: a
                # backlog (a client that read slowly, then again) is written in turns, each
                # giving the event loop back to the other requests while the socket takes it
                if pending and (submission.queue.empty() or len(pending) >= WRITE_CHUNKS):
                    yield b"".join(pending)
                    pending = []
            pending.append(sse("[DONE]"))
        except Exception as error:  # not a client that left: that ends the stream with GeneratorExit or CancelledError
            completion.count_error(error)
            failure = error_for(error)
    if failure is not None:  # after the release: the session is free again when the client reads this
        pending += [sse(failure.body()), sse("[DONE]")]
    yield b"".join(pending)


# -- POST /v1/chat/completions ----------------------------------------------------------------------

def chat_prompt(served: ServedModel, messages: list[ChatMessage], add_generation_prompt: bool = True,
                tools: list[ToolDefinition] | None = None, continue_final_message: bool = False,
                template_variables: dict | None = None) -> str:
    """The prompt text the model's chat template makes of `messages` and `tools` (server/api/chat.py),
    with a request's further `template_variables` (its `chat_template_kwargs`); 400 when the model
    has no template or its template refuses them. Chat and /tokenize both render
    through here, so /tokenize counts the prompt a chat request with the same fields runs. With
    `continue_final_message` the text ends where the last message's content does (what the
    template writes after it, an end-of-turn marker, is cut off, as vLLM cuts it), so that the
    answer goes on from it."""
    template = served.chat_template
    if template is None:
        raise InvalidRequest(f"model '{served.name}' has no chat template, so it cannot take chat messages: use "
                             "/v1/completions with a prompt, or give the checkpoint a chat template "
                             "(chat_template.jinja, or chat_template in tokenizer_config.json or config.json) "
                             "or start the server with --chat-template FILE",
                             param="model", code="no_chat_template")
    rendered = [render_message(message, template.renders_tool_calls) for message in messages]
    # as OpenAI sends them: a field left out is absent, not null, which a template would test as defined
    described = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
    try:
        text = template.render(rendered, add_generation_prompt, described, template_variables)
    except ChatTemplateError as error:
        raise InvalidRequest(f"the chat template of model '{served.name}' cannot render these messages: {error}",
                             param="messages", code="chat_template_error") from None
    if continue_final_message:
        final = messages[-1].text()
        end = text.rfind(final) if final else -1
        if end < 0 and final.strip():
            # templates that trim each message's content (Llama 3's `| trim`) drop a prefill's
            # trailing space: the text goes on from the trimmed content, as transformers (and so
            # vLLM) cut it
            final = final.strip()
            end = text.rfind(final)
        if end < 0:
            raise InvalidRequest(f"the chat template of model '{served.name}' does not write the last message's "
                                 "content as it is, so the answer cannot go on from it", param="messages",
                                 code="chat_template_error")
        text = text[: end + len(final)]
    return text


class ChatCompletion(Completion):
    """A chat completion: the messages rendered by the model's chat template into a prompt, run as
    a completion, answered in OpenAI's chat shapes (`chat.completion`, streamed as
    `chat.completion.chunk`s whose first delta per choice carries the role)."""

    def __init__(self, state: AppState, body: ChatCompletionRequest, owner: str | None):
        self.chat = body
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        # tools: the functions it may call, enforced as a grammar (server/api/structured.py)
        functions = called_functions(body.tools, body.tool_choice)
        if functions is not None:
            other = next((name for name in CONSTRAINT_FIELDS if getattr(body, name) is not None
                          and not (name == "response_format" and body.response_format.type == "text")), None)
            if other is not None:
                raise InvalidRequest(f"{other} cannot be combined with tools: the answer is text or tool calls",
                                     param=other, code="invalid_response_format")
        fields = {name: getattr(body, name) for name in SamplingOptions.model_fields}
        fields.update(model=body.model, prompt=chat_prompt(state.served(body.model), body.messages,
                                                           body.add_generation_prompt, body.tools,
                                                           body.continue_final_message, body.chat_template_kwargs),
                      n=body.n,
                      stream=body.stream, stream_options=body.stream_options,
                      logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # neither given: as OpenAI's chat and vLLM's, the answer may run until it stops (a stop
        # string, the end of the model's context) or reaches the server's XLSERVE_MAX_TOKENS_LIMIT,
        # not the 16 tokens a completion defaults to
        fields["max_tokens"] = state.settings.server.max_tokens_limit if max_tokens is None else max_tokens
        try:
            request = CompletionRequest.model_validate(fields)
        except ValidationError as error:
            raise validation_error(error.errors()) from None
        # errors name the fields the chat request was sent with, not the completion's they became
        max_tokens_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        field_names = {"prompt": "messages", "max_tokens": max_tokens_name,
                       "logprobs": "top_logprobs" if body.top_logprobs is not None else "logprobs"}
        super().__init__(state, request, owner, field_names=field_names)
        for choice in self.choices:  # exactly top_logprobs alternatives per token, as OpenAI's and vLLM's chat
            choice.chosen_in_top = False
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.calls_tools = functions is not None
        self.names_function = isinstance(body.tool_choice, NamedToolChoice)
        self.functions, self.tool_grammar = functions, None
        if functions is not None:
            # a named function is called once, as OpenAI and vLLM answer it, whatever parallel_tool_calls says
            named = body.tool_choice not in (None, "auto", "required")
            self.tool_grammar = tool_grammar(functions, auto=body.tool_choice in (None, "auto"),
                                             parallel=body.parallel_tool_calls and not named)
            limit = state.settings.engine.structured_max_bytes
            size = len(self.tool_grammar.encode("utf-8"))
            if size > limit:
                raise InvalidRequest(f"the tools make a grammar of {size} bytes; the limit is {limit} "
                                     "(XLSERVE_STRUCTURED_MAX_BYTES)", param="tools", code="grammar_too_large")
            self.set_constraint(("grammar", self.tool_grammar, "tools"))

    async def submit(self) -> Submission:
        try:
            return await super().submit()
        except ContextLengthExceeded as error:  # the prompt the engine measured is the rendered messages
            error.param = "messages"
            raise
        except InvalidInput as error:  # the tools' grammar refused: said of the function, not of the grammar
            if error.param != "tools" or self.tool_grammar is None:
                raise
            raise type(error)(tool_refusal(error.message, self.tool_grammar, self.functions), param=error.param,
                              code=error.code) from None

    def envelope(self, choices: list[dict], **extra) -> dict:
        kind = "chat.completion.chunk" if self.body.stream else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.body.model,
                "choices": choices, **extra}

    def chat_logprobs(self, piece: dict | None) -> dict | None:
        """Completion-style logprobs (tokens, token_logprobs, top_logprobs) in chat's shape."""
        if piece is None or not self.chat.logprobs:
            return None
        return {"content": [
            {"token": token, "logprob": logprob, "bytes": token_string_bytes(token),
             "top_logprobs": [{"token": name, "logprob": value, "bytes": token_string_bytes(name)}
                              for name, value in (top or {}).items()]}
            for token, logprob, top in zip(piece["tokens"], piece["token_logprobs"], piece["top_logprobs"])]}

    def response(self, finished: Finished) -> dict:
        choices = []
        for choice in self.choices:
            message = {"role": "assistant", "content": "".join(choice.text)}
            finish_reason = choice.finish_reason
            if self.calls_tools:  # the message a client rebuilds from the stream of the same text
                calls = ToolCallStream(self.names_function)
                calls.push(message["content"])
                _, finish_reason = calls.finish(finish_reason)
                if calls.mode == "tools":  # calls, the last one perhaps cut short; a call's markup is no content
                    message = {"role": "assistant", "content": calls.content or None}
                    if calls.calls:
                        message["tool_calls"] = calls.calls
            choices.append({"index": choice.index, "message": message, "logprobs": self.chat_logprobs(choice.logprobs),
                            "finish_reason": finish_reason})
        return self.envelope(choices, usage=usage(finished.prompt_tokens, finished.completion_tokens,
                                                  finished.cached_tokens))

    def chunk_format(self, extra: dict) -> Callable[..., bytes]:
        started: set[int] = set()  # choices whose role went out
        # with tools, each choice's text is read for tool calls as it comes (server/api/structured.py)
        calls = [ToolCallStream(self.names_function) for _ in self.choices] if self.calls_tools else None

        def event(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> bytes:
            if index not in started:
                started.add(index)
                delta = {"role": "assistant", **delta}
            return sse(self.envelope([{"index": index, "delta": delta, "logprobs": self.chat_logprobs(logprobs),
                                       "finish_reason": finish_reason}], **extra))

        def chunk(index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> bytes:
            if calls is None:
                return event(index, {"content": text} if text or finish_reason is None else {}, logprobs,
                             finish_reason)
            stream = calls[index]
            deltas = stream.push(text)
            if finish_reason is not None:
                held, finish_reason = stream.finish(finish_reason)  # cut short (max_tokens): what is held back
                deltas += held
            # every token's logprobs go out once, in order, as the unstreamed answer lists them: with
            # the step's first delta (content or a tool call's piece), or, for a token whose text is
            # held back (a call's head or end not yet whole), in a chunk of their own with an empty delta
            events = []
            for delta in deltas:
                events.append(event(index, delta, logprobs, None))
                logprobs = None
            if logprobs is not None:
                events.append(event(index, {}, logprobs, None))
            if finish_reason is not None:
                events.append(event(index, {}, None, finish_reason))
            return b"".join(events)

        return chunk
