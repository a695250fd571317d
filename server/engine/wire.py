"""The messages between the API process and the engine process (server/engine/process.py),
and their framing; used on both sides, free of torch.

**Frames.** A frame is a 4-byte big-endian length, a JSON header of that length, and, when the
header says `"blob": n`, n raw bytes (a safetensors session state, or a prompt's or an append's
token ids, 4-byte integers in this machine's order). JSON and raw bytes only:
nothing that crosses the socket is ever unpickled. Every header names its kind in "op": an
`Operation` (a request) or a `FrameKind` (everything else).

**Requests and replies.** What the API process asks is one dataclass per `Operation` (a
`Request` subclass: `Generate`, `Acquire`, `ExportState`, ...), each naming the dataclass of its
reply (`Accepted`, `Acquired`, `ExportedState`, ...), or none for a notice that is never answered
(`Cancel`, `Release`). A request crosses as {"op", "id"?, its fields}, its reply inside an
`answer` frame as {"op": "answer", "id", "ok": its fields} or, when it failed, {"op": "answer",
"id", "error"}. A field typed `bytes` (a session state) or `TokenIds` (`Generate.prompt`,
`Append.tokens`) crosses as the frame's blob. The engine
process answers each request class with one handler (process.py `EngineProcess.handlers`), the
API process sends each from one method of `EngineClient` (client.py);
tests/server/test_wire.py checks that all three agree.

**The other frames** (`FrameKind`): `settings` first from the API process (never on the
command line, which `ps` shows to everyone: a Redis URL may hold a password) and `shutdown`
last; from the engine process `ready` once loaded (or `failed`, why not), `events` once per
engine step, and `closed` after a shutdown.

**Events** of a request (server/engine/types.py) cross as compact lists (`event_to_wire`), every
event of one engine step in one `events` frame, keyed by the `request_id` of the `Generate` or
`Append` that started it. **Errors** cross as `error_to_wire` dicts and come back as the same
exception classes (through the registry of server/errors.py), so the API's status table
(server/api/errors.py) works on them.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import enum
import functools
import json
import socket
import struct
import threading
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import xlserve.server.engine.types as engine_types
# the engine's and the cache's errors modules define (and so register) every class the wire
# rebuilds: imported here so that the registry is whole wherever the wire is used
import xlserve.server.engine.errors  # noqa: F401
from xlserve.server.cache.errors import SessionInfo
from xlserve.server.engine.errors import MessageTooLarge
from xlserve.server.engine.types import SamplingParams
from xlserve.server.errors import ERROR_CLASSES, RegisteredError

HEADER = struct.Struct(">I")
MAX_HEADER_BYTES = 64 << 20


def frame_head(header: dict, blob_bytes: int | None = None, checked: bool = False) -> bytes:
    """A frame's bytes up to its blob (of `blob_bytes`, None: none), which follows them. `checked`
    (what the API process sends the engine process): MessageTooLarge for a header over
    MAX_HEADER_BYTES, which the engine process's `read_frame` refuses, and could not skip without
    losing the stream."""
    if blob_bytes is not None:
        header = {**header, "blob": blob_bytes}
    body = json.dumps(header, separators=(",", ":")).encode()
    if checked and len(body) > MAX_HEADER_BYTES:
        raise MessageTooLarge(f"this request's message to the engine process is {len(body):,} bytes of JSON, over "
                              f"the {MAX_HEADER_BYTES:,} it reads")
    return HEADER.pack(len(body)) + body


def encode_frame(header: dict, blob: bytes | None = None, checked: bool = False) -> bytes:
    """A frame's bytes (`frame_head`, then the blob)."""
    head = frame_head(header, None if blob is None else len(blob), checked)
    # joined, not added: b"".join lets Python's interpreter lock go while it copies bytes past 1
    # MiB, where `+` holds it
    return b"".join((head, blob)) if blob is not None else head


# an answer's blob past this goes in parts (`FrameWriter.send_in_parts`)
PART_BYTES = 1 << 20


class FrameWriter:
    """Writes whole frames to a blocking socket from any thread (one frame at a time)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, header: dict, blob: bytes | None = None) -> None:
        frame = encode_frame(header, blob)
        with self.lock:
            self.sock.sendall(frame)

    def send_in_parts(self, header: dict, blob: bytes | None = None) -> None:
        """An answer (`answer_frame`) whose blob is past PART_BYTES goes as PART frames of its
        call's id, then the answer's header alone, which says how many parts came before it; the
        reader joins them (client.py `_read`). Each part takes the lock on its own, so the engine's
        step loop sends its events between them: an exported session of 237 MB held the lock for
        its whole write, and every stream of every model waited about a second for it."""
        if blob is None or len(blob) <= PART_BYTES:
            self.send(header, blob)
            return
        view = memoryview(blob)
        parts = range(0, len(blob), PART_BYTES)
        for start in parts:
            self.send({"op": FrameKind.PART.value, "id": header["id"]}, view[start : start + PART_BYTES])
        self.send({**header, "parts": len(parts)})


def read_frame(stream) -> tuple[dict, bytes | None] | None:
    """One frame from a blocking binary file object; None at end of stream."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (length,) = HEADER.unpack(head)
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"frame header of {length} bytes")
    header = json.loads(stream.read(length))
    blob = stream.read(header["blob"]) if "blob" in header else None
    return header, blob


async def read_frame_async(reader) -> tuple[dict, bytes | None] | None:
    """One frame from an asyncio StreamReader; None at end of stream."""
    try:
        (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        header = json.loads(await reader.readexactly(length))
        blob = await reader.readexactly(header["blob"]) if "blob" in header else None
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return header, blob


# -- kinds of frame ------------------------------------------------------------------------------


class Operation(enum.Enum):
    """What the API process asks of the engine process; one `Request` class each."""

    GENERATE = "generate"
    APPEND = "append"
    CANCEL = "cancel"
    ACQUIRE = "acquire"
    COMMIT = "commit"
    RELEASE = "release"
    CREATE_SESSION = "create_session"
    GET_SESSION = "get_session"
    LIST_SESSIONS = "list_sessions"
    DELETE_SESSION = "delete_session"
    FORK_SESSION = "fork_session"
    EXPORT_STATE = "export_state"
    REPLACE_STATE = "replace_state"
    IMPORT_SESSION = "import_session"
    STOP_ADMITTING = "stop_admitting"
    CHECK_IDLE = "check_idle"
    GET_METRICS = "get_metrics"


class FrameKind(enum.Enum):
    """The frames that are not requests."""

    SETTINGS = "settings"  # API -> engine, first: `StartWithSettings`
    SHUTDOWN = "shutdown"  # API -> engine, last: write the sessions down and exit
    READY = "ready"  # engine -> API, once: `Ready`
    FAILED = "failed"  # engine -> API, instead of `ready`: `StartFailed`
    ANSWER = "answer"  # engine -> API: a request's reply, or its error
    EVENTS = "events"  # engine -> API, once per engine step: its events
    CLOSED = "closed"  # engine -> API, after `shutdown`: everything is written
    HEARTBEAT = "heartbeat"  # engine -> API, every HEARTBEAT_SECONDS from its own thread: `Heartbeat`
    PART = "part"  # engine -> API: a part of a large answer's blob (`FrameWriter.send_in_parts`)


# -- the codec shared by every message -------------------------------------------------------------


# Token ids (a prompt, an appended chunk) cross as the frame's blob, 4 bytes each in this
# machine's order (both processes run on it), not as a JSON list: a 1M-token prompt took 0.15 s of
# the API process's event loop to write as JSON, and as long again of the engine process's reader
# thread to read, where every other request's frames (a cancel among them) wait
TokenIds = typing.NewType("TokenIds", list)


def _token_bytes(tokens: list[int]) -> bytes:
    return array.array("i", tokens).tobytes()


def _token_list(blob: bytes) -> list[int]:
    if len(blob) % 4:
        raise ValueError(f"a token blob of {len(blob)} bytes is not whole 4-byte ids")
    return array.array("i", blob).tolist()


@dataclass(frozen=True)
class _FieldCodec:
    name: str
    encode: Callable[[Any], Any] | None  # None: the value is JSON as it is
    decode: Callable[[Any], Any] | None
    is_blob: bool = False  # a `bytes` or `TokenIds` field: it crosses as the frame's blob


def _without_none(kind: Any) -> Any:
    """X for a type `X | None`; any other type as it is."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return next(option for option in typing.get_args(kind) if option is not type(None))
    return kind


@functools.cache
def _field_codecs(message_class: type) -> tuple[_FieldCodec, ...]:
    """How each field of a message class crosses, from its type: a dataclass (SessionInfo,
    SamplingParams) as a JSON object, a list of them as a list of objects, `bytes` as the
    frame's blob, token ids (`TokenIds`) as the blob too, 4 bytes each, anything else (JSON
    already: numbers, strings, lists, dicts) as it is."""
    hints = typing.get_type_hints(message_class)
    codecs = []
    for spec in dataclasses.fields(message_class):
        kind = _without_none(hints[spec.name])
        item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
        if kind is bytes:
            codecs.append(_FieldCodec(spec.name, None, None, is_blob=True))
        elif kind is TokenIds:
            codecs.append(_FieldCodec(spec.name, _token_bytes, _token_list, is_blob=True))
        elif dataclasses.is_dataclass(kind):
            codecs.append(_FieldCodec(spec.name, dataclasses.asdict, lambda value, kind=kind: kind(**value)))
        elif item is not None and dataclasses.is_dataclass(item):
            codecs.append(_FieldCodec(spec.name, lambda values: [dataclasses.asdict(value) for value in values],
                                      lambda values, item=item: [item(**value) for value in values]))
        else:
            codecs.append(_FieldCodec(spec.name, None, None))
    if sum(codec.is_blob for codec in codecs) > 1:
        raise TypeError(f"{message_class.__name__}: a frame carries one blob, not one per bytes field")
    return tuple(codecs)


class Message:
    """A dataclass that crosses the socket: its fields as the JSON header, a `bytes` or
    `TokenIds` field (at most one) as the frame's blob."""

    def to_frame(self) -> tuple[dict[str, Any], bytes | None]:
        fields, blob = {}, None
        for codec in _field_codecs(type(self)):
            value = getattr(self, codec.name)
            if codec.is_blob:
                blob = value if codec.encode is None or value is None else codec.encode(value)
            else:
                fields[codec.name] = value if codec.encode is None or value is None else codec.encode(value)
        return fields, blob

    @classmethod
    def from_frame(cls, fields: dict[str, Any], blob: bytes | None = None):
        """The message back from `to_frame`; a field missing from `fields` takes its default
        (TypeError if it has none)."""
        values = {}
        for codec in _field_codecs(cls):
            if codec.is_blob:
                values[codec.name] = blob if codec.decode is None or blob is None else codec.decode(blob)
            elif codec.name in fields:
                value = fields[codec.name]
                values[codec.name] = value if codec.decode is None or value is None else codec.decode(value)
        return cls(**values)


# -- replies ---------------------------------------------------------------------------------------


class Reply(Message):
    """The answer to a request."""


@dataclass
class Accepted(Reply):
    """The request is queued; its events may already be on their way."""


@dataclass
class Done(Reply):
    """It is done; there is nothing more to say."""


@dataclass
class Acquired(Reply):
    """A request's hold on a session, or, for an Idempotency-Key seen before, that key's
    remembered entry (`replay`) and nothing held."""

    info: SessionInfo  # as of the acquire
    lease: int | None = None  # None with a replay
    has_history: bool = False  # the session has a next-token distribution to continue from
    replay: dict | None = None


@dataclass
class SessionDescription(Reply):
    info: SessionInfo


@dataclass
class SessionChanged(Reply):
    """A change that may carry an Idempotency-Key (create, import, fork, replace, delete): the session after it
    (none after a delete), or, for a key seen before, the entry remembered with it (`replay`,
    whose "result" is what the first request was answered)."""

    info: SessionInfo | None = None
    replay: dict | None = None


@dataclass
class SessionPage(Reply):
    """Some of an owner's sessions, newest first, and whether more follow."""

    sessions: list[SessionInfo]
    has_more: bool


@dataclass
class ExportedState(Reply):
    info: SessionInfo
    state: bytes  # safetensors (server/cache/codec.py)


@dataclass
class Idleness(Reply):
    idle: bool  # no engine has a request queued or running


@dataclass
class MetricsText(Reply):
    text: str  # the engine process's series, in the Prometheus text format


# -- requests --------------------------------------------------------------------------------------

# every request class, by its operation (filled as the classes below are defined)
REQUESTS: dict[Operation, type[Request]] = {}


class Request(Message):
    """What the API process asks. A subclass names its operation and its reply's class:
    `class Acquire(Request, operation=Operation.ACQUIRE, reply=Acquired)`; reply None: a notice,
    which is never answered."""

    operation: ClassVar[Operation]
    reply: ClassVar[type[Reply] | None]

    def __init_subclass__(cls, operation: Operation, reply: type[Reply] | None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        known = REQUESTS.get(operation)
        # one class per operation (the same class defined again, as a reloaded module does, replaces itself)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"two request classes for {operation}: {known.__name__} and {cls.__name__}")
        cls.operation, cls.reply = operation, reply
        REQUESTS[operation] = cls


@dataclass
class Generate(Request, operation=Operation.GENERATE, reply=Accepted):
    """Queue a generation; its events follow, keyed by `request_id`. With a `lease` it continues
    that session (its new state waits for `Commit`); without one, `prefix_scope` (hex,
    server/cache/prefix_cache.py `scope_key`) lets it start from the longest cached prefix of
    its prompt. `owner` (the caller's API key identity, None without keys) is who it shares
    each step's prefill budget as (Engine._prefill_plan); a session's request is its session's."""

    request_id: int
    model: str
    prompt: TokenIds
    params: SamplingParams
    lease: int | None = None
    prefix_scope: str | None = None
    owner: str | None = None


@dataclass
class Append(Request, operation=Operation.APPEND, reply=Accepted):
    """Feed a document chunk into a leased session (its new state waits for `Commit`); the
    last event is an Appended. `score`: sum the log-probabilities of the tokens."""

    request_id: int
    lease: int
    tokens: TokenIds
    score: bool = False


@dataclass
class Cancel(Request, operation=Operation.CANCEL, reply=None):
    """Drop a generation or append at the engine's next step (it ends with Cancelled)."""

    request_id: int


@dataclass
class Acquire(Request, operation=Operation.ACQUIRE, reply=Acquired):
    """Hold a session for a request. `idempotency` ({key, fingerprint}): a key seen before on
    the session answers with its remembered entry instead."""

    session_id: str
    owner: str | None
    idempotency: dict | None = None


@dataclass
class Commit(Request, operation=Operation.COMMIT, reply=SessionDescription):
    """Make the state the leased request ended with the session's; `remember` ({key,
    fingerprint, result}): the request's Idempotency-Key, written with it."""

    lease: int
    remember: dict | None = None


@dataclass
class Release(Request, operation=Operation.RELEASE, reply=None):
    """Let go of a lease (without a commit, its request's state is dropped)."""

    lease: int


@dataclass
class CreateSession(Request, operation=Operation.CREATE_SESSION, reply=SessionChanged):
    model: str
    owner: str | None
    idempotency: dict | None = None


@dataclass
class GetSession(Request, operation=Operation.GET_SESSION, reply=SessionDescription):
    session_id: str
    owner: str | None


@dataclass
class ListSessions(Request, operation=Operation.LIST_SESSIONS, reply=SessionPage):
    owner: str | None
    limit: int
    after: str | None = None  # the last session of the previous page


@dataclass
class DeleteSession(Request, operation=Operation.DELETE_SESSION, reply=SessionChanged):
    session_id: str
    owner: str | None
    idempotency: dict | None = None


@dataclass
class ForkSession(Request, operation=Operation.FORK_SESSION, reply=SessionChanged):
    """A new session starting from this one's committed state."""

    session_id: str
    owner: str | None
    idempotency: dict | None = None


@dataclass
class ExportState(Request, operation=Operation.EXPORT_STATE, reply=ExportedState):
    session_id: str
    owner: str | None


@dataclass
class ReplaceState(Request, operation=Operation.REPLACE_STATE, reply=SessionChanged):
    """Make `state` (safetensors, checked against the session's model) the session's, as one commit."""

    session_id: str
    owner: str | None
    state: bytes
    idempotency: dict | None = None


@dataclass
class ImportSession(Request, operation=Operation.IMPORT_SESSION, reply=SessionChanged):
    """A new session from `state` (safetensors), for `model` or the model the state names."""

    model: str | None
    owner: str | None
    state: bytes
    idempotency: dict | None = None


@dataclass
class StopAdmitting(Request, operation=Operation.STOP_ADMITTING, reply=Done):
    """Graceful shutdown: refuse new requests (ShuttingDown), let running ones finish."""


@dataclass
class CheckIdle(Request, operation=Operation.CHECK_IDLE, reply=Idleness):
    pass


@dataclass
class GetMetrics(Request, operation=Operation.GET_METRICS, reply=MetricsText):
    pass


# the calls that change a session in the engine process: one whose answer is lost (the engine
# process died, or its reply could not be sent) may have landed (its write was durable before the
# answer), so it is not "nothing committed, send it again", which without an Idempotency-Key would
# apply it twice (client.py, process.py)
CHANGES_A_SESSION = (Commit, CreateSession, ForkSession, ImportSession, ReplaceState, DeleteSession)


# -- the other frames ------------------------------------------------------------------------------


class ControlMessage(Message):
    """A frame that is neither a request nor an answer: its kind is its class's."""

    kind: ClassVar[FrameKind]

    def frame(self) -> tuple[dict, bytes | None]:
        fields, blob = self.to_frame()
        return {"op": self.kind.value, **fields}, blob


@dataclass
class StartWithSettings(ControlMessage):
    """The first frame: the server's settings (server/settings.py, as JSON, without the API keys)."""

    kind: ClassVar[FrameKind] = FrameKind.SETTINGS
    settings: dict


@dataclass
class Shutdown(ControlMessage):
    """The last frame: write the sessions down and exit (after `Closed`)."""

    kind: ClassVar[FrameKind] = FrameKind.SHUTDOWN


@dataclass
class Ready(ControlMessage):
    """The engine process has loaded its models and opened the session cache."""

    kind: ClassVar[FrameKind] = FrameKind.READY
    # per model: name, directory, vocab_size, checkpoint_config, card (what /v1/models says),
    # device, dtype, load_seconds, every_forward_on_prompt_threads
    models: list[dict]
    pid: int
    threads: dict = field(default_factory=dict)  # forward, prompt (per model) and cores
    session_store: dict = field(default_factory=dict)  # where sessions live, and how many were found


@dataclass
class StartFailed(ControlMessage):
    """The engine process cannot start: why, in one line, and the traceback for a debug log."""

    kind: ClassVar[FrameKind] = FrameKind.FAILED
    error: str
    traceback: str = ""


@dataclass
class Closed(ControlMessage):
    """The engine process has shut down: every session is written."""

    kind: ClassVar[FrameKind] = FrameKind.CLOSED


def request_frame(request: Request, call_id: int | None = None) -> tuple[dict, bytes | None]:
    """A request's frame (header, blob); `call_id` for a request that is answered."""
    fields, blob = request.to_frame()
    header = {"op": request.operation.value, **fields}
    if call_id is not None:
        header["id"] = call_id
    return header, blob


def decode_request(header: dict, blob: bytes | None) -> Request:
    """The request a frame carries; ValueError for an operation nobody defined."""
    try:
        request_class = REQUESTS[Operation(header["op"])]
    except ValueError:
        raise ValueError(f"unknown operation {header['op']!r}") from None
    return request_class.from_frame(header, blob)


def answer_frame(call_id: int, reply: Reply) -> tuple[dict, bytes | None]:
    fields, blob = reply.to_frame()
    return {"op": FrameKind.ANSWER.value, "id": call_id, "ok": fields}, blob


def error_answer_frame(call_id: int, error: BaseException) -> tuple[dict, None]:
    return {"op": FrameKind.ANSWER.value, "id": call_id, "error": error_to_wire(error)}, None


# how often the engine process says it is not frozen; far below any XLSERVE_ENGINE_STALL_SECONDS
HEARTBEAT_SECONDS = 0.5


@dataclass
class Heartbeat(ControlMessage):
    """The engine process is not frozen, and how long each model's step under way has run: the
    API process kills one whose step has run past XLSERVE_ENGINE_STEP_SECONDS (a forward that
    never returns, such as a hung GPU kernel, while this thread beats on)."""

    kind: ClassVar[FrameKind] = FrameKind.HEARTBEAT
    # model name -> seconds its step under way has run; a model between steps is absent
    steps_running: dict[str, float] = field(default_factory=dict)


def events_frame(events: list[list]) -> tuple[dict, None]:
    """One engine step's events, each already `event_to_wire`d."""
    return {"op": FrameKind.EVENTS.value, "events": events}, None


# -- events --------------------------------------------------------------------------------------


def is_last(event: object) -> bool:
    """A request's last event: it finished, its append was fed, or it failed (cancel included)."""
    return isinstance(event, (engine_types.Finished, engine_types.Appended, BaseException))


def event_to_wire(request_id: int, event: object) -> list:
    """[request id, kind, fields...]; a finished request's session state stays behind (data)."""
    if isinstance(event, engine_types.TokenEvent):
        return [request_id, "t", event.token, event.text, event.logprob, event.top, event.index, event.width]
    if isinstance(event, engine_types.ChoiceFinished):
        return [request_id, "c", event.index, event.finish_reason, event.text_tail, event.completion_tokens]
    if isinstance(event, engine_types.PromptLogprobs):
        return [request_id, "p", event.tokens, event.logprobs, event.top]
    if isinstance(event, engine_types.Finished):
        choices = [[c.index, c.finish_reason, c.text_tail, c.completion_tokens] for c in event.choices]
        return [request_id, "f", choices, event.prompt_tokens, event.completion_tokens, event.cached_tokens]
    if isinstance(event, engine_types.Appended):
        return [request_id, "a", event.logprob, event.scored]
    if isinstance(event, BaseException):
        return [request_id, "e", error_to_wire(event)]
    raise TypeError(f"not an engine event: {type(event).__name__}")


def event_from_wire(item: list) -> tuple[int, object]:
    """(request id, event) back from `event_to_wire`; Finished and Appended carry data=None."""
    request_id, kind, fields = item[0], item[1], item[2:]
    if kind == "t":
        return request_id, engine_types.TokenEvent(*fields)
    if kind == "c":
        return request_id, engine_types.ChoiceFinished(*fields)
    if kind == "p":
        return request_id, engine_types.PromptLogprobs(*fields)
    if kind == "f":
        choices, prompt_tokens, completion_tokens, cached_tokens = fields
        return request_id, engine_types.Finished([engine_types.ChoiceFinished(*c) for c in choices], prompt_tokens,
                                                 completion_tokens, cached_tokens, data=None)
    if kind == "a":
        return request_id, engine_types.Appended(data=None, logprob=fields[0], scored=fields[1])
    return request_id, error_from_wire(fields[0])


# -- exceptions --------------------------------------------------------------------------------
# Errors cross by class name, through the registry every error class joins as it is defined
# (server/errors.py): a class outside it arrives as a RuntimeError (an internal error, 500) that
# names it.


def error_to_wire(error: BaseException) -> dict:
    if isinstance(error, RegisteredError):
        return {"class": type(error).__name__, **error.wire_fields()}
    return {"class": type(error).__name__, "message": str(error)}


def error_from_wire(wire: dict) -> BaseException:
    name = wire.get("class", "")
    registered = ERROR_CLASSES.get(name)
    if registered is not None:
        return registered.from_wire_fields(wire)
    message = wire.get("message", "")
    return RuntimeError(f"{name}: {message}" if message else name)
