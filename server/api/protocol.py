"""What clients send: the request bodies of the HTTP API and the frames of the websocket.

Pydantic models only, plus `parse_frame`, which turns a websocket text frame into one of them.
What a request then does is server/api/serving.py; the routes are server/api/routers/.

`/v1/completions` takes OpenAI's completion request (fields it does not know are ignored, as
OpenAI clients send some we do not serve) plus `session_id`, `top_k`, `min_p` and
`repetition_penalty`. The session bodies and the websocket frames forbid unknown fields, so a
misspelt parameter is an error rather than silently ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from xlserve.server.api.errors import InvalidRequest, validation_error

MAX_CHOICES = 16  # largest n
MAX_STOPS = 4  # as OpenAI


# -- /v1/completions ----------------------------------------------------------------------------


class SamplingFields(BaseModel):
    """What a generation asks for; shared by /v1/completions and the websocket's `generate`."""

    model: str
    prompt: str | list[int] = ""
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    session_id: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="ignore")

    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None


# -- /v1/sessions -------------------------------------------------------------------------------


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str


class AppendRequest(BaseModel):
    """A document chunk for a session's memory; with `score`, its log-probability comes back."""

    model_config = ConfigDict(extra="forbid")
    text: str | list[int]
    score: bool = False


# -- the websocket /v1/stream (docs/websocket.md) -----------------------------------------------


class GenerateFrame(SamplingFields):
    model_config = ConfigDict(extra="forbid")
    type: Literal["generate"]
    id: str | None = None  # echoed in every frame of the answer


class AppendFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["append"]
    id: str | None = None
    session_id: str
    text: str | list[int]
    score: bool = False


class CancelFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["cancel"]
    id: str | None = None  # the request to cancel; None = whatever is running


ClientFrame = Union[GenerateFrame, AppendFrame, CancelFrame]
FRAME_TYPES = ("generate", "append", "cancel")
_client_frame = TypeAdapter(Annotated[ClientFrame, Field(discriminator="type")])


def frame_id(text: str | None) -> str | None:
    """The `id` a frame carries, read even from a frame that turns out to be invalid, so that the
    error frame answering it names the request it refuses."""
    try:
        request_id = json.loads(text).get("id")
    except (TypeError, ValueError, AttributeError):
        return None
    return request_id if isinstance(request_id, str) else None


def parse_frame(text: str | None) -> ClientFrame:
    """A client frame (`text` is None for a binary frame), or an InvalidRequest with code
    `malformed_frame` that says what is wrong with it."""
    if text is None:
        raise InvalidRequest("frames must be JSON text, not binary", code="malformed_frame")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"frame is not valid JSON: {error.msg} at position {error.pos}", code="malformed_frame")
    if not isinstance(raw, dict):
        raise InvalidRequest("frame must be a JSON object with a 'type'", code="malformed_frame")
    if raw.get("type") not in FRAME_TYPES:
        raise InvalidRequest(f"unknown frame type {raw.get('type')!r}; expected 'generate', 'append' or 'cancel'",
                             param="type", code="malformed_frame")
    try:
        return _client_frame.validate_python(raw)
    except ValidationError as error:
        # pydantic locates a field of a tagged union under the tag ("generate", ...): not part of its name
        raise validation_error(error.errors(), containers={raw["type"]}, code="malformed_frame") from None
