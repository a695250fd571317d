"""What clients send and what they get back: the request bodies of the HTTP API and the
frames of the websocket, and every response body, SSE chunk, server frame and the error body.

Pydantic models, plus `parse_frame`, which turns a websocket text frame into one of them, and
the checks every JSON text gets before it is parsed (`check_json_depth`).
What a request then does is server/api/serving/; the routes are server/api/routers/.

`/v1/completions` takes OpenAI's completion request plus `session_id`, `top_k`, `min_p` and
`repetition_penalty`; `/v1/chat/completions` OpenAI's chat request (for checkpoints with a chat
template). Every body and every websocket frame refuses fields it does not know, naming them
(400), on HTTP and the websocket alike: a misspelt or unsupported parameter (`best_of`,
`suffix`) is an error rather than silently ignored.

Text at the edges: every string a client sends must be text that can become UTF-8. JSON lets a
string carry an unpaired surrogate (`"\\ud800"`), which no UTF-8 encoder takes; such a string is
refused where it is validated (the `Text` type, error type `invalid_text`), so it never reaches
a tokenizer or an error message. JSON texts nested deeper than MAX_JSON_DEPTH are refused
before they are parsed.

Answers: each route declares its body's model (`response_model`, so /openapi.json documents it
for generated clients) and the error body for every error status it answers
(`error_responses`); a streamed answer documents its chunks as the events of a
`text/event-stream` (`event_stream`). JSON bodies are validated against their models as they are
sent; SSE chunks and websocket frames, built on the hot path, are not, and tests check that
they fit (tests/server/test_response_models.py, the fuzz test).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal, Union

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from xlserve.server.api.errors import InvalidRequest, json_syntax_message, validation_error

MAX_CHOICES = 16  # largest n
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARACTERS = 1000  # per stop string: the engine checks stops at every token, beside other requests
MAX_PROMPTS = 16  # prompts in one batched completion request (`prompt` as a list of prompts)
# log-probabilities an `echo` with `logprobs` returns for its prompts: every prompt token's and its
# alternatives', in every choice. The engine keeps them until the prompt is in and sends them in one
# frame, and the answer repeats them per choice: about 20 MB of JSON at this bound
MAX_ECHO_LOGPROBS = 1_000_000
# prompt tokens an `echo` returns as text, over every prompt and choice: the answer is built and
# written on the event loop, and `n` and a list of prompts multiply a body of a few MB into one of
# hundreds (16 prompts x 16 choices of a 100 KB prompt: 25.6 MB, two seconds of the loop). Twice
# the longest prompt (XLSERVE_MAX_PROMPT_BYTES's default) in bytes
MAX_ECHOED_TOKENS = 2_000_000
# log-probabilities an answer that is not streamed may return for its generated tokens, at most:
# prompts x n x max_tokens x (logprobs + 1). The whole answer is built and written at once on the
# event loop (OpenAI's worst case, 16 prompts x 16 choices x 4096 tokens x 21, is 22 million of
# them); a streamed answer sends each token's as it comes and has no such bound
MAX_GENERATED_LOGPROBS = 1_000_000
# seeds: OpenAI's are signed 64-bit integers, and this server took unsigned ones before; the
# engine takes any integer modulo 2**64 (server/engine/sampling.py), so both ranges are accepted
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MAX_LOGIT_BIAS = 300  # entries of `logit_bias` (OpenAI's limit)
MAX_MESSAGES = 1024  # messages of one chat request
# content parts and tool calls across all the messages of one request: each is a small object
# validated field by field, and a body at XLSERVE_MAX_REQUEST_BODY_BYTES could hold 300,000 of
# them (about a second of validation on the event loop)
MAX_CONTENT_PARTS = 4096
MAX_MESSAGE_TOOL_CALLS = 1024
MAX_GUIDED_CHOICES = 10_000  # strings of guided_choice (the constraint's text is bounded too, in bytes)
MAX_JSON_DEPTH = 32  # nesting of any JSON body or frame: ours need 4 levels at most
# an Idempotency-Key (header, or a websocket frame's `idempotency_key`): 1 to 255 visible ASCII characters
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"
INVALID_TEXT = "invalid_text"  # the pydantic error type of text that cannot become UTF-8


# -- text and JSON at the edges ---------------------------------------------------------------------


def utf8_text(value: str) -> str:
    """`value` if it can be encoded as UTF-8; a validation error naming the first unpaired
    surrogate otherwise (JSON's \\ud800 escapes make those, and no tokenizer takes them)."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PydanticCustomError(
            INVALID_TEXT, "text must be valid Unicode that can be encoded as UTF-8; it holds an unpaired "
            f"surrogate (\\u{ord(value[error.start]):04x}) at character {error.start}") from None
    return value


Text = Annotated[str, AfterValidator(utf8_text)]
# a session named in a body or frame: "" names none, and is refused rather than taken as no session
SessionId = Annotated[str, Field(min_length=1), AfterValidator(utf8_text)]


def at_most(limit: int, what: str, applies=lambda value: True) -> BeforeValidator:
    """For a field that takes a list among other shapes (a union): a list longer than `limit`
    is refused naming the limit, before any item is validated. A union tries each of its shapes
    on every item, so the bound a shape declares would come too late, and `one_of`'s message
    would hide it. `applies(value)` says whether a long list is of the bounded kind."""

    def validate(value: Any) -> Any:
        if isinstance(value, list) and len(value) > limit and applies(value):
            raise PydanticCustomError("too_long", f"at most {limit} {what}; this one has {len(value)}")
        return value

    return BeforeValidator(validate)


def one_of(shapes: str) -> WrapValidator:
    """For a field that takes several shapes (a union): one message that lists them, instead of
    one error per shape; text that cannot become UTF-8 is still reported as such."""

    def validate(value: Any, handler) -> Any:
        try:
            return handler(value)
        except ValidationError as error:
            invalid_text = next((e for e in error.errors() if e["type"] == INVALID_TEXT), None)
            if invalid_text is not None:
                raise PydanticCustomError(INVALID_TEXT, invalid_text["msg"]) from None
            raise PydanticCustomError("invalid_shape", f"must be {shapes}") from None

    return WrapValidator(validate)


# a JSON string, matched whole from its opening quote (an escape, a backslash and the character
# after it, never ends it), or, unterminated, everything from its quote to the end of the text;
# and an escape outside any string (not JSON: the parser stops there), whose character is no quote
# Possessive: a string that does not close is scanned once, not again from every quote inside it
# ('"\\"\\"\\"...'), which would be quadratic in the text's size.
_STRING_BYTES = re.compile(rb'\\.|"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)
_BRACKETS = np.frombuffer(b"[{]}", dtype=np.uint8)


def json_depth_exceeded(document: str | bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `document` nests arrays and objects deeper than `limit`, found
    without parsing it (a parser would recurse once per level). Cheap for what clients send:
    only a text with more than `limit` brackets is looked at, and then its strings are cut out
    by one regular expression and the brackets left are summed by numpy, both at C speed: an
    8 MB body of brackets inside a string takes about 0.1 s, not seconds of the event loop."""
    data = document if isinstance(document, bytes) else document.encode("utf-8", "surrogatepass")
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    outside = np.frombuffer(_STRING_BYTES.sub(b"", data), dtype=np.uint8)
    brackets = outside[np.isin(outside, _BRACKETS)]
    if brackets.size == 0:
        return False
    steps = np.where((brackets == _BRACKETS[0]) | (brackets == _BRACKETS[1]), np.int8(1), np.int8(-1))
    return bool(np.cumsum(steps, dtype=np.int32).max() > limit)  # 5 bytes a bracket, not 16


def too_deep(what: str, code: str | None = None, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                          param=param, code=code or "json_too_deep")


# -- /v1/completions and /v1/chat/completions -----------------------------------------------------

# fail_fast: in a union (a prompt as text, token ids or a list of prompts) the wrong shape stops
# at its first item, instead of collecting an error for every one of a few million items
TokenIds = Annotated[list[int], Field(fail_fast=True)]
TOKEN_ID_KEY_PATTERN = r"^(0|[1-9][0-9]{0,9})$"


def token_id_key(key: str) -> str:
    if re.fullmatch(TOKEN_ID_KEY_PATTERN, key) is None:
        raise PydanticCustomError("token_id_key", "keys must be token ids: non-negative integers, written as strings")
    return key


# logit_bias: OpenAI's {token id as a string: bias in [-100, 100]}
TokenIdKey = Annotated[str, AfterValidator(token_id_key),
                       WithJsonSchema({"type": "string", "pattern": TOKEN_ID_KEY_PATTERN})]
LogitBias = Annotated[dict[TokenIdKey, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS)]


class RequestBody(BaseModel):
    """Every request body and frame: unknown fields are refused, numbers must be finite.

    A body may name fields for which an explicit null means the field's default
    (`null_means_default`): OpenAI's API marks most of its parameters nullable, and its client
    libraries (vLLM takes them too) send `"temperature": null` for a parameter left unset. Null
    for any other field is refused as before."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    null_means_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_that_mean_the_default(cls, data: Any) -> Any:
        if not cls.null_means_default or not isinstance(data, dict):
            return data
        return {name: value for name, value in data.items() if value is not None or name not in cls.null_means_default}


# -- structured output (server/api/structured.py) --

FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # OpenAI's limit
JsonObject = dict[str, Any]


class JsonSchemaFormat(RequestBody):
    """OpenAI's `response_format.json_schema`: the schema the output must validate against."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: Text | None = None
    schema_: JsonObject | None = Field(None, alias="schema")  # `schema` itself is a BaseModel method's name
    # the schema is always enforced; strict: every keyword of it (else those the engine does not
    # implement are ignored), objects without additionalProperties closed (server/api/structured.py)
    strict: bool | None = None


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(RequestBody):
    """vLLM's newer `structured_outputs` object: the same constraints as the guided_* fields, one of them."""

    json_: Annotated[JsonObject | Text | None, one_of("a JSON schema: an object, or its JSON text")] = \
        Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_GUIDED_CHOICES)
    grammar: Text | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: Text | None = None
    parameters: JsonObject | None = None  # a JSON schema for the arguments; none: any object
    strict: bool | None = None  # the arguments always fit `parameters`; strict as response_format's json_schema


class ToolDefinition(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestBody):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(RequestBody):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class MessageToolCall(RequestBody):
    """A call an assistant message made (sent back in the history of the next request)."""

    id: Text
    type: Literal["function"]
    function: CalledFunction


class SamplingOptions(RequestBody):
    """How tokens are drawn; shared by completions, chat completions and the websocket's `generate`.
    The engine reads temperature < 1e-5 as greedy and top_p < 1e-5 as "the most likely token
    only" (server/engine/sampling.py); what it cannot honour is refused here, naming the field."""

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: Annotated[Text | list[Text] | None, one_of("a string or a list of strings"),
                    at_most(MAX_STOPS, "stop strings")] = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    logit_bias: LogitBias | None = None
    # vLLM's: go on past the model's end-of-text token (converted checkpoints name theirs; our
    # byte and word models have none), which is then generated as any other token
    ignore_eos: bool = False
    # the prefix-state cache, for requests without a session_id (README, "Reuse without sessions"):
    # states are shared only by requests of one API key and one cache_salt (vLLM's name); with
    # prefix_cache false a request neither starts from a cached state nor leaves one behind
    cache_salt: Text | None = Field(None, max_length=256)
    prefix_cache: bool = True
    # structured output, at most one of them (server/api/structured.py): OpenAI's response_format,
    # and vLLM's guided_* fields (guided_grammar is a Lark grammar in llguidance's dialect)
    response_format: ResponseFormat | None = None
    guided_json: Annotated[JsonObject | Text | None, one_of("a JSON schema: an object, or its JSON text")] = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_GUIDED_CHOICES)
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputs | None = None


class SamplingFields(SamplingOptions):
    """What a generation asks for; shared by /v1/completions and the websocket's `generate`."""

    model: Text
    prompt: Annotated[Text | TokenIds, one_of("a string or a list of token ids")] = ""
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    session_id: SessionId | None = None


class StreamOptions(RequestBody):
    include_usage: bool = False


def only_when_streamed(options: StreamOptions | None, info) -> StreamOptions | None:
    """`stream_options` is refused without `stream: true` (as OpenAI and vLLM refuse it): an
    unstreamed answer has no chunks for it to shape, and a client that sends it expects a stream.
    `stream` is declared before `stream_options`, so it is validated by now."""
    if options is not None and not info.data.get("stream", False):
        raise PydanticCustomError("stream_options_without_stream", "only allowed with stream: true")
    return options


def continues_an_assistants_message(value: bool, info) -> bool:
    """vLLM's `continue_final_message`: the prompt ends where the last message, an assistant's,
    ends, so it goes with `add_generation_prompt: false` and messages ending with the assistant's.
    Both are declared before it, so they are validated by now (messages that failed their own
    validation are not there to judge)."""
    if value:
        if info.data.get("add_generation_prompt", True):
            raise PydanticCustomError("continue_final_message", "it goes on from the last message: send "
                                                                "add_generation_prompt false with it")
        if "messages" in info.data and (not info.data["messages"] or info.data["messages"][-1].role != "assistant"):
            raise PydanticCustomError("continue_final_message", "it needs messages whose last is the assistant's")
    return value


# vLLM's `chat_template_kwargs`: more variables for the chat template (Qwen3's `enable_thinking`,
# a persona, a date). The variables the server gives a template itself are not among them: each
# has its own field, or is the checkpoint's (its special tokens) or the renderer's (its helpers)
TEMPLATE_VARIABLES_OF_OUR_OWN = {"messages": "send them as messages", "tools": "send them as tools",
                                 "add_generation_prompt": "send add_generation_prompt",
                                 "continue_final_message": "send continue_final_message",
                                 "bos_token": "the checkpoint's own", "eos_token": "the checkpoint's own",
                                 "raise_exception": "the renderer's own", "strftime_now": "the renderer's own"}
MAX_TEMPLATE_VARIABLES = 32
TemplateVariableName = Annotated[Text, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]  # what a template can name
TemplateVariables = Annotated[dict[TemplateVariableName, Any], Field(max_length=MAX_TEMPLATE_VARIABLES)]


def none_of_our_own(variables: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs` may not set a variable the server sets itself: refused naming it and
    where its value comes from, rather than one of the two silently winning."""
    for name in variables or {}:
        if name in TEMPLATE_VARIABLES_OF_OUR_OWN:
            raise PydanticCustomError("template_variable_of_our_own",
                                      f"'{name}' is not a template variable a request sets here: "
                                      f"{TEMPLATE_VARIABLES_OF_OUR_OWN[name]}")
    return variables


def is_prompt_list(prompt: list) -> bool:
    """Whether a list `prompt` is several prompts (strings or token-id lists) rather than one
    prompt's token ids."""
    return isinstance(prompt[0], (str, list))


class CompletionRequest(SamplingFields):
    # the parameters OpenAI's completion request marks nullable: null is the default
    null_means_default = frozenset({"prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                                    "echo", "logprobs", "stop", "seed", "logit_bias", "presence_penalty",
                                    "frequency_penalty"})
    # OpenAI's batched form too: a list of prompts (strings or token-id lists); choice
    # `prompt_index * n + choice_index` answers prompt `prompt_index`
    prompt: Annotated[Text | TokenIds | Annotated[list[Text], Field(fail_fast=True)]
                      | Annotated[list[TokenIds], Field(fail_fast=True)],
                      one_of("a string, a list of token ids, or a list of those (several prompts)"),
                      at_most(MAX_PROMPTS, "prompts in one request", applies=is_prompt_list)] = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    _stream_options_only_when_streamed = field_validator("stream_options")(only_when_streamed)
    echo: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: Text | None = None

    def prompts(self) -> list[str | list[int]] | None:
        """The prompts of a batched request (`prompt` as a list of prompts), or None for one prompt."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and is_prompt_list(prompt):
            return list(prompt)
        return None


class TextPart(RequestBody):
    """One part of a chat message's content; text is the only kind a language model here takes."""

    type: Literal["text"]
    text: Text


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # a string, or OpenAI's list of content parts (their texts are joined with newlines)
    content: Annotated[Text | list[TextPart] | None, one_of("a string or a list of {\"type\": \"text\"} parts")] = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls ([] as none, as OpenAI's SDK may send)
    tool_call_id: Text | None = None  # a tool message: the call it answers
    # what an assistant message OpenAI returned carries besides, sent back with the history as the
    # SDK dumps it (`message.model_dump()`): a refusal stands for the text of a message without
    # content; annotations (citations) are read past; audio and function_call only as null
    refusal: Text | None = None
    annotations: list[dict[str, Any]] | None = Field(None, max_length=MAX_CONTENT_PARTS)
    audio: None = None
    function_call: None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_an_assistants(cls, value, info):
        if value is not None and info.data.get("role") != "assistant":
            raise PydanticCustomError("tool_calls_role", "only an assistant message makes tool calls")
        return value or None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or self.refusal or ""


def bounded_message_items(messages: Any) -> Any:
    """`messages` (as sent, before validation) if its content parts and tool calls, counted over
    all of them, are within MAX_CONTENT_PARTS and MAX_MESSAGE_TOOL_CALLS; a validation error
    naming the limit otherwise, before any of them is validated."""
    if not isinstance(messages, list) or len(messages) > MAX_MESSAGES:
        return messages  # not a list of messages, or too many of them: the list's own checks say so
    parts = calls = 0
    for message in messages:  # bounded: MAX_MESSAGES
        if isinstance(message, dict):
            content, tool_calls = message.get("content"), message.get("tool_calls")
            parts += len(content) if isinstance(content, list) else 0
            calls += len(tool_calls) if isinstance(tool_calls, list) else 0
    if parts > MAX_CONTENT_PARTS:
        raise PydanticCustomError("too_long", f"at most {MAX_CONTENT_PARTS} content parts in all the messages of "
                                              f"one request; these have {parts}")
    if calls > MAX_MESSAGE_TOOL_CALLS:
        raise PydanticCustomError("too_long", f"at most {MAX_MESSAGE_TOOL_CALLS} tool_calls in all the messages of "
                                              f"one request; these have {calls}")
    return messages


Messages = Annotated[list[ChatMessage], BeforeValidator(bounded_message_items)]


class ChatCompletionRequest(SamplingOptions):
    """OpenAI's chat completion request; the messages become the prompt through the model's chat
    template (server/api/chat.py). Chat keeps no session (the messages are the whole history)."""

    # the parameters OpenAI's chat completion request marks nullable: null is the default
    null_means_default = frozenset({"temperature", "top_p", "n", "stream", "stream_options", "max_tokens",
                                    "max_completion_tokens", "logprobs", "top_logprobs", "stop", "seed", "logit_bias",
                                    "presence_penalty", "frequency_penalty", "parallel_tool_calls"})
    model: Text
    messages: Messages = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)  # OpenAI's newer name for max_tokens
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    _stream_options_only_when_streamed = field_validator("stream_options")(only_when_streamed)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    user: Text | None = None
    tools: list[ToolDefinition] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None,
                           one_of('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')] = None
    parallel_tool_calls: bool = True
    # OpenAI's: keep the exchange for its dashboards (nothing is kept here, so only false), and a
    # caller's tags for it (16 keys of up to 64 characters, values up to 512), taken and read past
    store: bool | None = None
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
                        Field(max_length=16)] | None = None

    # vLLM's: render the messages without the assistant's turn after them, or (continue_final_message)
    # so that the answer goes on from the last message, an assistant's: a prefilled start
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    _continues_an_assistants_message = field_validator("continue_final_message")(continues_an_assistants_message)
    chat_template_kwargs: TemplateVariables | None = None
    _none_of_our_own = field_validator("chat_template_kwargs")(none_of_our_own)

    @field_validator("store")
    @classmethod
    def _nothing_is_stored(cls, value):
        if value:
            raise PydanticCustomError("store_unsupported", "true is not supported: this server keeps no completions "
                                                          "(send false or leave it out)")
        return value


# -- /tokenize and /detokenize (as vLLM) ----------------------------------------------------------


class TokenizeRequest(RequestBody):
    """A prompt's tokens, as the model sees it: `prompt`, or `messages` (and `tools`) rendered by
    the chat template as a chat request's are."""

    model: Text | None = None  # as vLLM: optional where the server serves one model
    prompt: Text | None = None
    messages: Messages | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    # with messages: the tools a template may describe in the prompt (vLLM's tokenize takes them);
    # chat's type, so what chat refuses is refused here. No tool_choice: the prompt does not depend on it
    tools: list[ToolDefinition] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    add_generation_prompt: bool = True  # with messages: end with the assistant's turn, as chat does
    continue_final_message: bool = False  # with messages: end where the last (an assistant's) does, as chat does
    _continues_an_assistants_message = field_validator("continue_final_message")(continues_an_assistants_message)
    chat_template_kwargs: TemplateVariables | None = None  # with messages: the template's further variables, as chat's
    _none_of_our_own = field_validator("chat_template_kwargs")(none_of_our_own)
    add_special_tokens: bool = True  # accepted for vLLM's clients; these tokenizers add none
    return_token_strs: bool = False  # vLLM's: each token's vocabulary entry too (`token_strs`)


class DetokenizeRequest(RequestBody):
    model: Text | None = None  # as vLLM: optional where the server serves one model
    tokens: TokenIds


# -- /v1/sessions -------------------------------------------------------------------------------


class CreateSession(RequestBody):
    model: Text


class AppendRequest(RequestBody):
    """A document chunk for a session's memory; with `score`, its log-probability comes back."""

    text: Annotated[Text | TokenIds, one_of("a string or a list of token ids")]
    score: bool = False


# -- the websocket /v1/stream (docs/websocket.md) -----------------------------------------------


# a frame's id is echoed in every frame of its answer (a token frame each token): bounded, or a
# frame with an id of megabytes would be sent back that many times over
MAX_FRAME_ID = 256
FrameId = Annotated[Text, Field(max_length=MAX_FRAME_ID)]


class GenerateFrame(SamplingFields):
    type: Literal["generate"]
    id: FrameId | None = None  # echoed in every frame of the answer
    idempotency_key: str | None = Field(None, pattern=IDEMPOTENCY_KEY_PATTERN)  # with session_id: at most once


class AppendFrame(RequestBody):
    type: Literal["append"]
    id: FrameId | None = None
    session_id: SessionId
    text: Annotated[Text | TokenIds, one_of("a string or a list of token ids")]
    score: bool = False
    idempotency_key: str | None = Field(None, pattern=IDEMPOTENCY_KEY_PATTERN)  # applied at most once


class CancelFrame(RequestBody):
    type: Literal["cancel"]
    id: FrameId | None = None  # the request to cancel; None = whatever is running


ClientFrame = Union[GenerateFrame, AppendFrame, CancelFrame]
FRAME_TYPES = ("generate", "append", "cancel")
_client_frame = TypeAdapter(Annotated[ClientFrame, Field(discriminator="type")])


def _loaded(text: str | None) -> Any:
    """The JSON value of a frame's text, or None when it is none (too deep, not JSON)."""
    if text is None or json_depth_exceeded(text):
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def frame_id(text: str | None, max_bytes: int | None = None) -> str | None:
    """The `id` a frame carries, read even from a frame that turns out to be invalid, so that the
    error frame answering it names the request it refuses; None for a frame over `max_bytes`,
    which is refused unread (`parse_frame`), and for an id past MAX_FRAME_ID characters."""
    if _over(text, max_bytes):
        return None
    raw = _loaded(text)
    request_id = raw.get("id") if isinstance(raw, dict) else None
    if not isinstance(request_id, str) or len(request_id) > MAX_FRAME_ID:
        return None
    try:
        request_id.encode("utf-8")
    except UnicodeEncodeError:  # an id that cannot be sent back as it came
        return None
    return request_id


def _over(text: str | None, max_bytes: int | None) -> bool:
    """Whether a frame's text is over `max_bytes` in UTF-8 (a UTF-8 character is at most 4 bytes)."""
    return (text is not None and max_bytes is not None and len(text) > max_bytes // 4
            and len(text.encode("utf-8", "surrogatepass")) > max_bytes)


def parse_frame(text: str | None, max_bytes: int | None = None) -> ClientFrame:
    """A client frame (`text` is None for a binary frame), or an InvalidRequest with code
    `malformed_frame` that says what is wrong with it: not JSON (where, by line and column),
    larger than `max_bytes`, nested too deeply, not a frame, or a field at fault (by name)."""
    if text is None:
        raise InvalidRequest("frames must be JSON text, not binary", code="malformed_frame")
    if _over(text, max_bytes):
        raise InvalidRequest(f"frame is over {max_bytes} bytes (XLSERVE_MAX_REQUEST_BODY_BYTES)",
                             code="malformed_frame")
    if json_depth_exceeded(text):
        raise too_deep("frame", code="malformed_frame")
    try:
        raw = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise InvalidRequest(json_syntax_message("frame", error.msg, error.doc, error.pos),
                             code="malformed_frame") from None
    except ValueError as error:  # NaN or Infinity, which JSON does not have
        raise InvalidRequest(f"frame is not valid JSON: {error}", code="malformed_frame") from None
    except RecursionError:  # the depth check above makes this unlikely; never a 500 in any case
        raise too_deep("frame", code="malformed_frame") from None
    if not isinstance(raw, dict):
        raise InvalidRequest("frame must be a JSON object with a 'type'", code="malformed_frame")
    if raw.get("type") not in FRAME_TYPES:
        kind = raw.get("type")
        shown = repr(kind) if isinstance(kind, (str, int, float, bool, type(None))) else type(kind).__name__
        raise InvalidRequest(f"unknown frame type {shown.encode('ascii', 'backslashreplace').decode()}; "
                             "expected 'generate', 'append' or 'cancel'", param="type", code="malformed_frame")
    try:
        return _client_frame.validate_python(raw)
    except ValidationError as error:
        # pydantic locates a field of a tagged union under the tag ("generate", ...): not part of its name
        raise validation_error(error.errors(), containers={raw["type"]}, code="malformed_frame") from None


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number (numbers must be finite)")


# -- what the server answers: response bodies, SSE chunks, websocket frames, the error body -------


class ResponseBody(BaseModel):
    """Every answer the server sends, field by field. A field every answer carries has no default
    (required in the schema; `X | None` where null is one of its values); a field only some
    answers carry defaults to None and is left out when it was not set (routes send their bodies
    with `response_model_exclude_unset`, so no field appears or vanishes). A field the model does
    not know is refused (extra="forbid"): an undocumented field fails the server's tests instead
    of being filtered out of the answer in silence."""

    model_config = ConfigDict(extra="forbid")


class ErrorDetail(ResponseBody):
    message: str
    type: str  # what happened, as the status would say it: invalid_request_error, not_found_error, ...
    param: str | None  # the field (or header) at fault
    code: str | None  # which case it is: model_not_found, session_busy, queue_full, ...


class ErrorResponse(ResponseBody):
    """The one error body of every endpoint, of an error event in an SSE stream and (with `type`
    and `id` beside it) of a websocket error frame, as OpenAI's API answers errors
    (server/api/errors.py `error_body`)."""

    error: ErrorDetail


class PromptTokensDetails(ResponseBody):
    cached_tokens: int  # context that came from the session's memory (or the prefix cache) instead of being computed


class Usage(ResponseBody):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # present once the request got as far as its context (a websocket generation cancelled before has none)
    prompt_tokens_details: PromptTokensDetails | None = None


# a stop string or a complete structured output; max_tokens (or the model's max_context) reached;
# tool calls (chat); a structured-output constraint that allowed no token (server/engine/constraints.py)
FinishReason = Literal["stop", "length", "tool_calls", "no_allowed_token"]


# -- /v1/completions: the body and its SSE chunks --


class CompletionLogprobs(ResponseBody):
    """OpenAI's completion logprobs, one entry per token of the choice's text (the prompt's too with echo)."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for a first prompt token, which has no context
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where each token's text starts in the choice's text


class CompletionChoice(ResponseBody):
    text: str
    index: int  # with several prompts, prompt_index * n + choice_index
    finish_reason: FinishReason | None  # None in a stream's chunks before the choice's last
    logprobs: CompletionLogprobs | None


class CompletionResponse(ResponseBody):
    """The answer of POST /v1/completions (without `stream`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    session_id: str | None = None  # the session continued, when the request named one


class CompletionStreamResponse(ResponseBody):
    """One SSE chunk of a streamed completion: one piece of one choice's text, or (with
    `stream_options.include_usage`) the last chunk, with no choices and the `usage`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # with include_usage: null in every chunk but the last
    session_id: str | None = None


# -- /v1/chat/completions: the body and its SSE chunks --


class TopLogprob(ResponseBody):
    token: str
    logprob: float
    # the bytes the token adds to the text (a byte token's one byte, named "<0xC3>"), which a
    # client joins to rebuild a character split over tokens (models/tokenizer.py token_string_bytes)
    bytes: list[int] | None


class ChatTokenLogprob(ResponseBody):
    token: str
    logprob: float
    bytes: list[int] | None  # as TopLogprob's
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseBody):
    content: list[ChatTokenLogprob]


class ToolCallFunction(ResponseBody):
    name: str
    arguments: str  # JSON text


class ToolCall(ResponseBody):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatResponseMessage(ResponseBody):
    role: Literal["assistant"]
    content: str | None  # None when the answer is tool calls
    tool_calls: list[ToolCall] | None = None


class ChatChoice(ResponseBody):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionResponse(ResponseBody):
    """The answer of POST /v1/chat/completions (without `stream`)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallFunctionDelta(ResponseBody):
    name: str | None = None  # in a call's first delta
    arguments: str  # more of its arguments' JSON text ("" in the first delta)


class ToolCallDelta(ResponseBody):
    """A piece of a streamed tool call: its first has id, type and name; the rest add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta


class ChatDelta(ResponseBody):
    """What a chunk adds to a choice's message: the role in its first chunk, then text."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(ResponseBody):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionStreamResponse(ResponseBody):
    """One SSE chunk of a streamed chat completion (`chat.completion.chunk`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None  # with include_usage: null in every chunk but the last


# -- /v1/models --


class ModelCard(ResponseBody):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    architecture: str
    state_kind: str  # what a session of the model holds: segment-recurrence, continuous, window, linear, none
    state_grows_with_context: bool
    # what one session counts against the tier budgets once its memory is full: its state (floating
    # tensors in XLSERVE_STATE_DTYPE) and its next-token row; None where the state grows without bound
    state_bytes_per_session: int | None
    max_context: int | None  # None: the context has no bound
    # vLLM's name for the same length, which vLLM-aware clients read (filled in from max_context)
    max_model_len: int | None = None
    parameters: int
    config: dict[str, Any]  # the checkpoint's model configuration
    quantize: Literal["none", "int8"]  # XLSERVE_QUANTIZE for this model: int8 weights of its linear layers
    weight_bytes: int  # its weights in memory (int8 ones with their scales), tied ones once

    @model_validator(mode="after")
    def _vllm_length(self) -> "ModelCard":
        self.max_model_len = self.max_context  # always set: every card carries it
        return self


class ModelList(ResponseBody):
    object: Literal["list"]
    data: list[ModelCard]


# -- /v1/sessions --


class SessionObject(ResponseBody):
    """A session as GET /v1/sessions/{id} describes it (server/cache/errors.py `SessionInfo.public`)."""

    id: str
    object: Literal["session"]
    model: str
    tokens: int  # in its memory
    state_bytes: int
    tier: str  # where its state is now: device, host, disk, redis
    version: int  # commits so far
    in_use: bool
    created_at: float  # Unix time
    last_used_at: float


class ForkedSession(SessionObject):
    forked_from: str


class SessionList(ResponseBody):
    """The caller's sessions, newest first, as OpenAI lists objects (`after=last_id` for the next page)."""

    object: Literal["list"]
    data: list[SessionObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class SessionDeleted(ResponseBody):
    id: str
    object: Literal["session"]
    deleted: Literal[True]


class AppendResponse(ResponseBody):
    """The answer of POST /v1/sessions/{id}/append; the scores only when it asked for them."""

    id: str
    tokens: int  # the chunk's
    session_tokens: int  # the session's after the append
    version: int
    cached_tokens: int  # what the session's memory held before
    logprob: float | None = None  # natural-log probability of the scored tokens, given the memory
    scored_tokens: int | None = None  # a session's very first token has no context and is not scored
    bits_per_byte: float | None = None  # null when no byte was scored


# -- /tokenize, /detokenize, /health, /ready, /version --


class TokenizeResponse(ResponseBody):
    count: int
    max_model_len: int | None  # the model's context length; None for a model whose context has no bound
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: each token's vocabulary entry, as vLLM's


class DetokenizeResponse(ResponseBody):
    prompt: str


class HealthResponse(ResponseBody):
    """/health while the API process lives (200): `engine` is the engine process's state
    (`loading`, `ready`, `restarting`, ...) and, when it is not `ready`, `reason` says why (a
    frozen engine process the watchdog killed, say). /ready is the probe that routes traffic."""

    status: Literal["ok"]
    engine: str
    reason: str | None = None  # only when the engine process is not ready


class ReadyResponse(ResponseBody):
    status: Literal["ready"]
    models: list[str]


class ServerStatus(ResponseBody):
    """/health or /ready when the answer is no (503), with why: /health `failed` (the engine
    process is gone for good); /ready `loading`, `restarting`, `draining`, `failed`, ..."""

    status: str
    reason: str


class VersionResponse(ResponseBody):
    version: str


# -- the websocket's server frames (docs/websocket.md) --


class TokenFrame(ResponseBody):
    """One generated token; `text` is what it released ("" while a character or a possible stop
    string is incomplete)."""

    type: Literal["token"]
    id: str | None
    text: str
    token: int
    logprob: float
    top_logprobs: dict[str, float] | None = None  # when the request asked for logprobs > 0


class DoneFrame(ResponseBody):
    """The end of a request: of a `generate` (`text`: what was held back, and `usage`), of an
    `append` (`finish_reason` null, the counts and, with `score`, the scores), or of either
    after a cancel (`finish_reason` "cancelled"). With a session, its tokens and version after
    the commit; `replayed` when it is the remembered answer of an earlier request with the same
    idempotency_key."""

    type: Literal["done"]
    id: str | None
    finish_reason: Literal["stop", "length", "no_allowed_token", "cancelled"] | None
    session_id: str | None
    text: str | None = None
    usage: Usage | None = None
    session_tokens: int | None = None
    version: int | None = None
    logprob: float | None = None
    scored_tokens: int | None = None
    bits_per_byte: float | None = None
    replayed: Literal[True] | None = None


class ErrorFrame(ResponseBody):
    """A request refused or failed (or a frame the server could not use): the error body, the
    request's id, and `retry_after` (seconds) where an HTTP answer would carry Retry-After."""

    type: Literal["error"]
    id: str | None
    error: ErrorDetail
    retry_after: int | None = None


ServerFrame = Annotated[Union[TokenFrame, DoneFrame, ErrorFrame], Field(discriminator="type")]
server_frame = TypeAdapter(ServerFrame)


# -- how routes document their answers in /openapi.json --

ERROR_MEANINGS = {  # what each error status means, wherever it is answered
    400: "An invalid request: a field at fault (`param` names it), a body that is not JSON or nests too deeply, "
         "text that cannot be UTF-8, an X-Session-Id header naming another session, a prompt or append that would "
         "take the context past the model's max_context (`context_length_exceeded`).",
    401: "No API key, or not one of the server's (`invalid_api_key`).",
    403: "The API key holds as many sessions as XLSERVE_MAX_SESSIONS_PER_KEY allows (`session_quota_exceeded`): "
         "delete one before making another.",
    404: "No such model or session (`model_not_found`, `session_not_found`); another key's session is not found either.",
    408: "A session state's upload (`state_body_too_slow`), or another request's body (`body_too_slow`), came "
         "slower than 256 KiB/s after its first 30 s.",
    409: "The session is busy with another request (`session_busy`) or was changed by another replica since this "
         "request started (`session_version_conflict`).",
    413: "The body is over XLSERVE_MAX_REQUEST_BODY_BYTES, or the session's state is larger than a whole tier of the "
         "server (`session_too_large`).",
    422: "The Idempotency-Key was used on this session for another request (`idempotency_key_reused`).",
    429: "The model's queue is full (`queue_full`), or another of the API key's sessions is being made "
         "(`sessions_being_made`); retry after Retry-After.",
    500: "This request alone could not be computed (`sampling_failed`, `forward_failed`); nothing was committed.",
    503: "Not now: the server is loading, draining or replacing its engine process, or the session store cannot take "
         "the session (`code` says which; Retry-After where a retry soon helps).",
}


def error_responses(*statuses: int, by_reference: bool = False) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=` for its errors: the error body for each status it answers, and for
    any other ("default": whatever else goes wrong is answered in the same body). Listing
    "default" also keeps FastAPI from documenting its own 422 body, which this server never
    sends (invalid requests get 400 and the error body).

    `by_reference`, for a route whose own answer is not JSON (/metrics): FastAPI would file a
    model's schema under the route's media type, so the error body is named by its component
    instead, as JSON (the other routes put it among the components)."""
    if by_reference:
        body = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    else:
        body = {"model": ErrorResponse}
    documented: dict[int | str, dict[str, Any]] = {
        status: {**body, "description": ERROR_MEANINGS[status]} for status in statuses}
    documented["default"] = {**body, "description": "Any other error, in the same error body."}
    return documented


def _inlined(schema: Any, definitions: dict[str, Any]) -> Any:
    """`schema` with every reference to `definitions` replaced by the definition itself."""
    if isinstance(schema, dict):
        reference = schema.get("$ref", "")
        if reference.startswith("#/$defs/"):
            return _inlined(definitions[reference.removeprefix("#/$defs/")], definitions)
        return {key: _inlined(value, definitions) for key, value in schema.items() if key != "$defs"}
    if isinstance(schema, list):
        return [_inlined(item, definitions) for item in schema]
    return schema


def event_stream(chunk: type[ResponseBody], description: str) -> dict[str, Any]:
    """The `text/event-stream` answer of a streamed route, for its 200 entry in `responses=`.
    Each event's `data` is a chunk of type `chunk` or, for a failure after the stream started,
    the error body; the last is `[DONE]`. OpenAPI 3.1 has no word for one event of a stream
    (3.2's `itemSchema`, which FastAPI writes for its own event streams, makes a 3.1 document
    invalid), so the media type's `schema` describes one event, as tools read it for event
    streams before 3.2 (schemathesis among them). The schema is written out whole (no `$ref`):
    a chunk's models are not otherwise in the document's components, and a self-contained
    schema reads the same to every tool."""
    schema = TypeAdapter(Union[chunk, ErrorResponse]).json_schema(mode="serialization")
    data = {"type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json",
                     "contentSchema": _inlined(schema, schema.get("$defs", {}))}}
    event = {"type": "object", "required": ["data"],
             "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer", "minimum": 0}},
             "description": f"One event: its data is a {chunk.__name__} (or, after a failure, the error body) "
                            "as JSON; the last event's data is [DONE]."}
    return {"description": description, "content": {"text/event-stream": {"schema": event}}}
