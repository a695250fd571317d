"""The framing between the API process and the engine process (server/engine/process.py); used
on both sides, free of torch.

A frame is a 4-byte big-endian length, a JSON header of that length, and, when the header says
`"blob": n`, n raw bytes (a safetensors session state). JSON and raw bytes only: nothing that
crosses the socket is ever unpickled.

A request's events (server/engine/types.py) cross as compact lists (`event_to_wire`), one step's
worth per frame. Errors cross as `error_to_wire` dicts and come back as the same exception
classes (an explicit registry, below), so the one exception -> status table
(server/api/errors.py) works on the API side.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading

import xlserve.server.engine.types as engine_types
from xlserve.server.cache.errors import (
    CacheError,
    CacheFull,
    CommitOutcomeUnknown,
    CorruptState,
    IdempotencyKeyReused,
    SessionConflict,
    SessionLocked,
    SessionNotFound,
    SessionTooLarge,
    SessionUnavailable,
)
from xlserve.server.engine.errors import (
    Cancelled,
    EngineError,
    EngineGone,
    EngineLoading,
    EngineRestarting,
    InvalidInput,
    ModelNotFound,
    QueueFull,
    RequestFailed,
    ShuttingDown,
)

HEADER = struct.Struct(">I")
MAX_HEADER_BYTES = 64 << 20


def encode_frame(header: dict, blob: bytes | None = None) -> bytes:
    if blob is not None:
        header = {**header, "blob": len(blob)}
    body = json.dumps(header, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body + (blob or b"")


class FrameWriter:
    """Writes whole frames to a blocking socket from any thread (one frame at a time)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, header: dict, blob: bytes | None = None) -> None:
        frame = encode_frame(header, blob)
        with self.lock:
            self.sock.sendall(frame)


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


# -- events --------------------------------------------------------------------------------------


def is_last(event: object) -> bool:
    """A request's last event: it finished, its append was fed, or it failed (cancel included)."""
    return isinstance(event, (engine_types.Finished, engine_types.Appended, BaseException))


def event_to_wire(request_id: int, event: object) -> list:
    """[request id, kind, fields...]; a finished request's session state stays behind (data)."""
    if isinstance(event, engine_types.TokenEvent):
        return [request_id, "t", event.token, event.text, event.logprob, event.top, event.index]
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
# Errors cross by name, through this registry only: a class not in it arrives as a RuntimeError
# (an internal error, 500) that names it.

ENGINE_ERRORS: dict[str, type[EngineError]] = {
    cls.__name__: cls for cls in (EngineError, InvalidInput, ModelNotFound, QueueFull, ShuttingDown, EngineGone,
                                  RequestFailed, EngineRestarting, EngineLoading)
}
CACHE_ERRORS: dict[str, type[CacheError]] = {
    cls.__name__: cls for cls in (CacheError, CacheFull, SessionUnavailable, SessionTooLarge, CommitOutcomeUnknown,
                                  IdempotencyKeyReused)
}
SESSION_ERRORS: dict[str, type[CacheError]] = {
    cls.__name__: cls for cls in (SessionNotFound, SessionLocked, SessionConflict)
}


def error_to_wire(error: BaseException) -> dict:
    wire = {"class": type(error).__name__, "message": str(error)}
    if isinstance(error, EngineError):
        wire.update(message=error.message, param=error.param, code=error.code)
    if isinstance(error, CacheError):
        wire["session_id"] = error.session_id
    return wire


def error_from_wire(wire: dict) -> BaseException:
    name, message = wire.get("class", ""), wire.get("message", "")
    if name in ENGINE_ERRORS:
        return ENGINE_ERRORS[name](message, param=wire.get("param"), code=wire.get("code"))
    if name in SESSION_ERRORS:
        return SESSION_ERRORS[name](wire.get("session_id") or message)
    if name in CACHE_ERRORS:
        return CACHE_ERRORS[name](message, wire.get("session_id"))
    if name == "CorruptState":
        return CorruptState(message)
    if name == "Cancelled":
        return Cancelled()
    return RuntimeError(f"{name}: {message}" if message else name)
