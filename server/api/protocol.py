"""What clients send: the request bodies of the HTTP API and the frames of the websocket.

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
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from xlserve.server.api.errors import InvalidRequest, json_syntax_message, validation_error

MAX_CHOICES = 16  # largest n
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARACTERS = 1000  # per stop string: the engine checks stops at every token, beside other requests
MAX_PROMPTS = 16  # prompts in one batched completion request (`prompt` as a list of prompts)
MAX_SEED = 2**64 - 1  # the engine's generators take 64-bit seeds
MAX_LOGIT_BIAS = 300  # entries of `logit_bias` (OpenAI's limit)
MAX_MESSAGES = 1024  # messages of one chat request
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


# a JSON string, with its escapes: what the depth count skips over
# (the unrolled form, which never backtracks much, even on an unterminated string)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_JSON_STRING_BYTES = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_NOT_BRACKETS_BYTES = re.compile(rb"[^\[\]{}]+")


def json_depth_exceeded(document: str | bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `document` nests arrays and objects deeper than `limit`, found
    without parsing it (a parser would recurse once per level). Cheap for what clients send:
    only a text with more than `limit` brackets is scanned, and then only its brackets outside
    strings are walked."""
    is_bytes = isinstance(document, bytes)
    opening = (b"[", b"{") if is_bytes else ("[", "{")
    if document.count(opening[0]) + document.count(opening[1]) <= limit:
        return False
    if is_bytes:
        brackets = _NOT_BRACKETS_BYTES.sub(b"", _JSON_STRING_BYTES.sub(b"", document)).decode("ascii")
    else:
        brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", document))
    depth = 0
    for bracket in brackets:
        depth += 1 if bracket in "[{" else -1
        if depth > limit:
            return True
    return False


def too_deep(what: str, code: str | None = None) -> InvalidRequest:
    return InvalidRequest(f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                          code=code or "json_too_deep")


# -- /v1/completions and /v1/chat/completions -----------------------------------------------------

TokenIds = list[int]
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
    """Every request body and frame: unknown fields are refused, numbers must be finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SamplingOptions(RequestBody):
    """How tokens are drawn; shared by completions, chat completions and the websocket's `generate`.
    The engine reads temperature < 1e-5 as greedy and top_p < 1e-5 as "the most likely token
    only" (server/engine/sampling.py); what it cannot honour is refused here, naming the field."""

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: Annotated[Text | list[Text] | None, one_of("a string or a list of strings")] = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    logit_bias: LogitBias | None = None
    # the prefix-state cache, for requests without a session_id (README, "Reuse without sessions"):
    # states are shared only by requests of one API key and one cache_salt (vLLM's name); with
    # prefix_cache false a request neither starts from a cached state nor leaves one behind
    cache_salt: Text | None = Field(None, max_length=256)
    prefix_cache: bool = True


class SamplingFields(SamplingOptions):
    """What a generation asks for; shared by /v1/completions and the websocket's `generate`."""

    model: Text
    prompt: Annotated[Text | TokenIds, one_of("a string or a list of token ids")] = ""
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    session_id: Text | None = None


class StreamOptions(RequestBody):
    include_usage: bool = False


class CompletionRequest(SamplingFields):
    # OpenAI's batched form too: a list of prompts (strings or token-id lists); choice
    # `prompt_index * n + choice_index` answers prompt `prompt_index`
    prompt: Annotated[Text | TokenIds | list[Text] | list[TokenIds],
                      one_of("a string, a list of token ids, or a list of those (several prompts)")] = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: Text | None = None

    def prompts(self) -> list[str | list[int]] | None:
        """The prompts of a batched request (`prompt` as a list of prompts), or None for one prompt."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
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

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingOptions):
    """OpenAI's chat completion request; the messages become the prompt through the model's chat
    template (server/api/chat.py). Chat keeps no session (the messages are the whole history)."""

    model: Text
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)  # OpenAI's newer name for max_tokens
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    user: Text | None = None


# -- /tokenize and /detokenize (as vLLM) ----------------------------------------------------------


class TokenizeRequest(RequestBody):
    """A prompt's tokens, as the model sees it: `prompt`, or `messages` rendered by the chat template."""

    model: Text
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True  # with messages: end with the assistant's turn, as chat does
    add_special_tokens: bool = True  # accepted for vLLM's clients; these tokenizers add none


class DetokenizeRequest(RequestBody):
    model: Text
    tokens: TokenIds


# -- /v1/sessions -------------------------------------------------------------------------------


class CreateSession(RequestBody):
    model: Text


class AppendRequest(RequestBody):
    """A document chunk for a session's memory; with `score`, its log-probability comes back."""

    text: Annotated[Text | TokenIds, one_of("a string or a list of token ids")]
    score: bool = False


# -- the websocket /v1/stream (docs/websocket.md) -----------------------------------------------


class GenerateFrame(SamplingFields):
    type: Literal["generate"]
    id: Text | None = None  # echoed in every frame of the answer
    idempotency_key: str | None = Field(None, pattern=IDEMPOTENCY_KEY_PATTERN)  # with session_id: at most once


class AppendFrame(RequestBody):
    type: Literal["append"]
    id: Text | None = None
    session_id: Text
    text: Annotated[Text | TokenIds, one_of("a string or a list of token ids")]
    score: bool = False
    idempotency_key: str | None = Field(None, pattern=IDEMPOTENCY_KEY_PATTERN)  # applied at most once


class CancelFrame(RequestBody):
    type: Literal["cancel"]
    id: Text | None = None  # the request to cancel; None = whatever is running


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


def frame_id(text: str | None) -> str | None:
    """The `id` a frame carries, read even from a frame that turns out to be invalid, so that the
    error frame answering it names the request it refuses."""
    raw = _loaded(text)
    request_id = raw.get("id") if isinstance(raw, dict) else None
    if not isinstance(request_id, str):
        return None
    try:
        request_id.encode("utf-8")
    except UnicodeEncodeError:  # an id that cannot be sent back as it came
        return None
    return request_id


def parse_frame(text: str | None, max_bytes: int | None = None) -> ClientFrame:
    """A client frame (`text` is None for a binary frame), or an InvalidRequest with code
    `malformed_frame` that says what is wrong with it: not JSON (where, by line and column),
    larger than `max_bytes`, nested too deeply, not a frame, or a field at fault (by name)."""
    if text is None:
        raise InvalidRequest("frames must be JSON text, not binary", code="malformed_frame")
    if max_bytes is not None and len(text) > max_bytes // 4 and len(text.encode("utf-8", "surrogatepass")) > max_bytes:
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
