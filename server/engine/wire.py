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
# the engine's and the cache's errors modules define (and so register) every class the wire
# rebuilds: imported here so that the registry is whole wherever the wire is used
import xlserve.server.cache.errors  # noqa: F401
import xlserve.server.engine.errors  # noqa: F401
from xlserve.server.errors import ERROR_CLASSES, RegisteredError

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
