"""A session as bytes: one safetensors blob holding the state, the next-token distribution and
the session's metadata, with a checksum.

The same encoding is used for disk files, Redis values and the export/import API, so a session
moves between all of them unchanged. Layout:

    tensors   "state.<name>" for every tensor of `State.to_tensors()`,
              "next_log_probs" (V,) when the session has seen at least one token
    metadata  format="xlserve-session", format_version="1", session_id, model, architecture,
              state_class, owner, tokens, version, created_at, last_used_at, nbytes,
              state_dtype (the floating state tensors' dtype, e.g. "bfloat16"),
              checksum="sha256:<hex>"

The checksum is a SHA-256 over the metadata (every key but `checksum`, sorted) and every tensor
(name, dtype, shape and raw bytes, in name order), so it does not depend on how the safetensors
writer lays out the file. `decode` verifies it; a blob without one is refused unless the caller
allows it (an import written by someone else's tool). Parsing never unpickles: the header is
JSON and the tensors are read by safetensors.

State dtype (XLSERVE_STATE_DTYPE): the session cache keeps every floating state tensor in one
storage dtype (`SessionData.cast_state`), on every tier; a request computes in the model's own
dtype (`floating_dtypes` of its fresh state). Only floating tensors are converted: masks and
positions keep their integer or bool dtype, and `next_log_probs` stays float32 (one row of the
vocabulary, small next to a state, and the exact distribution the next token is sampled from).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from dataclasses import dataclass

import numpy
import torch

from xlserve.models.allocation import out_of_memory
from xlserve.models.interface import State, TensorChange
from xlserve.server.cache.errors import CorruptState

FORMAT = "xlserve-session"
FORMAT_VERSION = "1"
STATE_PREFIX = "state."
MAX_HEADER_BYTES = 64 << 20  # a sanity bound while parsing an untrusted header
MAX_TOKENS = 2**62  # the most tokens a session's history may claim (far past any history, within int64)

# The dtypes the cache may store states in (XLSERVE_STATE_DTYPE), by the name the setting and an
# export's `state_dtype` metadata use. bfloat16 keeps float32's range with 8 bits of mantissa;
# float16 keeps 11 bits but saturates at 65,504 (`SessionData.cast_state`; a running sum such as
# the Performer's reaches that after some 6,000 tokens), so bfloat16 is the safe choice.
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the floating dtypes an imported state's tensors may come in: each is converted; any other
# (float8 variants, complex) is refused by name
IMPORTABLE_DTYPES = {**STATE_DTYPES, "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the name used by the setting and the metadata."""
    return str(dtype).removeprefix("torch.")


def _map_named(state: State, convert) -> State:
    """`state` with each tensor replaced by `convert(name, tensor)`, names as in `to_tensors`."""
    changes = {}
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if isinstance(value, torch.Tensor):
            changes[field.name] = convert(field.name, value)
        else:
            changes[field.name] = [convert(f"{field.name}.{i}", t) for i, t in enumerate(value)]
    return dataclasses.replace(state, **changes)


def floating_dtypes(state: State) -> dict[str, torch.dtype]:
    """Name -> dtype of each floating tensor of `state`: given a model's fresh state, the dtypes
    its forward computes in, which a stored state is converted back to (`cast_state`)."""
    return {name: t.dtype for name, t in state._named_tensors() if t.is_floating_point()}


def state_dtype_of(state: State) -> str:
    """The metadata's `state_dtype`: the floating tensors' dtype name (several, comma-separated
    and sorted, should a state mix them; "none" when it has no floating tensor)."""
    names = sorted({dtype_name(t.dtype) for _, t in state._named_tensors() if t.is_floating_point()})
    return ",".join(names) or "none"


def conform_import(tensors: dict[str, torch.Tensor], expected: dict[str, torch.dtype],
                   recorded: str | None) -> dict[str, torch.Tensor]:
    """An imported state's tensors with each floating one converted to `expected[name]` (the
    model's compute dtype for that tensor). ValueError naming the dtype when the recorded
    `state_dtype` metadata or a tensor's dtype is not one a state may be stored in (IMPORTABLE_DTYPES).
    Tensors that are not floating are left for the model's check, which names a wrong dtype."""
    if recorded is not None:
        unknown = [name for name in recorded.split(",") if name not in IMPORTABLE_DTYPES and name != "none"]
        if unknown:
            raise ValueError(f"metadata 'state_dtype' names {', '.join(unknown)}, not one of "
                             f"{', '.join(IMPORTABLE_DTYPES)}")
    converted = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and name in expected:
            if dtype_name(tensor.dtype) not in IMPORTABLE_DTYPES:
                raise ValueError(f"state tensor '{name}' is {dtype_name(tensor.dtype)}, not one of "
                                 f"{', '.join(IMPORTABLE_DTYPES)}")
            tensor = tensor.to(expected[name])
        converted[name] = tensor
    return converted


@dataclass
class SessionData:
    """What a session remembers: the model's state, how many tokens it has seen, and the
    distribution of the next token (needed to continue generating without a prompt)."""

    state: State
    tokens: int
    next_log_probs: torch.Tensor | None  # (V,) float, None before the first token

    def nbytes(self) -> int:
        extra = 0 if self.next_log_probs is None else self.next_log_probs.numel() * self.next_log_probs.element_size()
        return self.state.nbytes() + extra

    def to(self, device: torch.device | str) -> "SessionData":
        logits = None if self.next_log_probs is None else self.next_log_probs.to(device)
        return SessionData(state=self.state.to(device), tokens=self.tokens, next_log_probs=logits)

    def compact(self) -> "SessionData":
        """The same values, owning exactly `nbytes()` of memory: a state split out of a batch holds
        views that keep the whole batch alive, which budgets would not see. Only the tensors that
        are such views are copied (a row's next-token log-probs are a row of its batch's, where
        its state may be its own already)."""
        def owned(t: torch.Tensor) -> torch.Tensor:
            return t if t.untyped_storage().nbytes() <= t.numel() * t.element_size() else t.clone()

        logits = None if self.next_log_probs is None else owned(self.next_log_probs)
        state = self.state._map(owned)
        return SessionData(state=state, tokens=self.tokens, next_log_probs=logits)

    def clone(self) -> "SessionData":
        logits = None if self.next_log_probs is None else self.next_log_probs.clone()
        return SessionData(state=self.state.clone(), tokens=self.tokens, next_log_probs=logits)

    def cast_state(self, dtype: torch.dtype | dict[str, torch.dtype]) -> "SessionData":
        """The same session with its floating state tensors in `dtype` (one for all, or by tensor
        name as `floating_dtypes` gives them: a name missing keeps its dtype). Integer and bool
        tensors and `next_log_probs` are kept as they are. A tensor already in its dtype is
        shared, not copied, so a cast to the dtype a state is in costs nothing. A cast to a dtype of
        narrower range (float16) saturates at its largest finite value rather than overflow to
        infinity: a session whose running sums pass 65,504 goes on, less exactly, instead of
        holding infinities that no request could continue from. A field the state keeps in
        float32 (`State.kept_in_float32`) is stored in float32 whatever one `dtype` says."""

        def convert(name: str, tensor: torch.Tensor) -> torch.Tensor:
            if not tensor.is_floating_point():
                return tensor
            if isinstance(dtype, dict):
                wanted = dtype.get(name, tensor.dtype)
            else:
                wanted = self.state.stored_dtype(name, dtype)
            if wanted == torch.float16 and tensor.dtype != torch.float16:  # the one dtype of narrower range
                largest = torch.finfo(torch.float16).max
                tensor = tensor.clamp(-largest, largest)
            return tensor.to(wanted)

        return SessionData(state=_map_named(self.state, convert), tokens=self.tokens,
                           next_log_probs=self.next_log_probs)


def _raw(t: torch.Tensor):
    """The tensor's bytes as a uint8 NumPy array: a view of its memory when it is a contiguous CPU
    tensor (no copy), readable by anything that takes a buffer (hashlib, bytes.join)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def checksum(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    fields = {k: v for k, v in metadata.items() if k != "checksum"}
    digest.update(json.dumps(fields, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        digest.update(_raw(t))
    return "sha256:" + digest.hexdigest()


# safetensors' names of the dtypes a session's tensors come in, in the order its writer lays
# tensors out (widest first: every tensor stays aligned to its element size)
SAFETENSORS_DTYPES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32",
                      torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
_LAYOUT_RANK = {dtype: rank for rank, dtype in enumerate(SAFETENSORS_DTYPES)}


def save_tensor_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list:
    """`tensors` and `metadata` as the parts of one safetensors file, in order: its header's bytes,
    then each tensor's memory read in place (a buffer; valid while the tensors are unchanged). A
    file takes them one after the other without ever holding the whole (`DiskStore.write`).

    safetensors.torch.save copies every tensor to bytes, then into its own buffer, then into the
    bytes it returns: at transfo-xl-wt103's size, 237 MB of state four times over into fresh
    memory, with `encode`'s snapshot and the checksum's, took 3-4 s of a compaction. Here the
    tensors are read in place, and a blob joins them once (`joined`). The layout is safetensors' own: an
    8-byte little-endian header length, the JSON header (`__metadata__`, then each tensor's dtype,
    shape and data_offsets), padded with spaces so that the data starts 8-byte aligned, then the
    tensors back to back in its writer's order (by dtype, widest first, then by name), so that
    every tensor lies aligned to its element size. tests/server/test_codec.py checks that the
    header and the data are the ones safetensors' own writer makes."""
    unknown = sorted(name for name, t in tensors.items() if t.dtype not in SAFETENSORS_DTYPES)
    if unknown:
        raise ValueError(f"tensor '{unknown[0]}' is {dtype_name(tensors[unknown[0]].dtype)}, which a session "
                         "cannot hold")
    order = sorted(tensors, key=lambda name: (_LAYOUT_RANK[tensors[name].dtype], name))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    raws, offset = [], 0
    for name in order:
        t = tensors[name]
        raw = _raw(t)
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + raw.nbytes]}
        raws.append(raw)
        offset += raw.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data begins at 8 + len(text), a multiple of 8
    return [struct.pack("<Q", len(text)) + text, *raws]


# A session's encoding as the stores take it: bytes, or the parts of those bytes in order
# (`encode_parts`), which a file writes without joining them
Blob = bytes | list


def blob_parts(blob: Blob) -> list:
    """`blob`'s parts in order: bytes are one part."""
    return [blob] if isinstance(blob, (bytes, bytearray)) else blob


def blob_bytes(blob: Blob) -> int:
    """How many bytes `blob` holds, whole or in parts."""
    return sum(memoryview(part).nbytes for part in blob_parts(blob))


# a blob in parts past this is joined by NumPy (`joined`)
JOIN_WITHOUT_THE_LOCK_BYTES = 1 << 20


def joined(blob: Blob) -> bytes | memoryview:
    """`blob` as one bytes-like object (a Redis value, an export; bytes given whole come back as
    they are). b"".join holds Python's interpreter lock while it copies parts that are not bytes
    (the state's tensors, read in place): at transfo-xl-wt103's size 120 ms, while every other
    thread of the engine process, the decode loop's included, waits. Past
    JOIN_WITHOUT_THE_LOCK_BYTES the parts are copied by NumPy into one buffer instead, which lets
    the lock go while it copies; a read-only memoryview of it comes back."""
    parts = blob_parts(blob)
    if len(parts) == 1 and isinstance(parts[0], bytes):
        return parts[0]
    total = blob_bytes(blob)
    if total <= JOIN_WITHOUT_THE_LOCK_BYTES:
        return b"".join(parts)
    buffer, offset = unlocked_buffer(total), 0
    for part in parts:
        values = numpy.frombuffer(part, numpy.uint8)
        buffer[offset : offset + values.size] = values
        offset += values.size
    return memoryview(buffer).toreadonly()


def unlocked_buffer(nbytes: int):
    """An uninitialised byte array of `nbytes` for NumPy to copy into without Python's interpreter
    lock (`joined`, a prefix entry read in slices): torch's memory, not NumPy's, which asks for huge
    pages for an array this large, and a first touch of them took 0.6 s where torch's pages took
    0.12 (the copy itself 0.03-0.09 s)."""
    return torch.empty(nbytes, dtype=torch.uint8).numpy()


def encode(data: SessionData, metadata: dict[str, str]) -> bytes | memoryview:
    """SessionData + string metadata -> safetensors bytes (format, nbytes and checksum added). The
    tensors are read in place (`save_tensor_parts`): the bytes are the state's snapshot."""
    return joined(encode_parts(data, metadata))


def encode_parts(data: SessionData, metadata: dict[str, str]) -> list:
    """`encode`'s bytes in parts (`save_tensor_parts`): the state's tensors read in place, for a
    file written at once. At transfo-xl-wt103's size joining them into one 237 MB bytes object
    took 2 s of a compaction on this machine, where fresh memory costs more than the copy."""
    tensors = {STATE_PREFIX + name: t for name, t in data.state.to_tensors().items()}
    if data.next_log_probs is not None:
        tensors["next_log_probs"] = data.next_log_probs
    meta = {k: str(v) for k, v in metadata.items()}
    meta.update(format=FORMAT, format_version=FORMAT_VERSION, tokens=str(data.tokens), nbytes=str(data.nbytes()),
                state_class=type(data.state).__name__, state_dtype=state_dtype_of(data.state))
    return _sealed_parts(tensors, meta)


def _sealed_parts(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> list:
    """`save_tensor_parts` of `tensors` with `meta` and its checksum over them. Each tensor is made
    a contiguous CPU tensor once, here: the checksum and the parts then read it in place (a
    slice of a memory, a delta's usual values, would otherwise be copied by each)."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    meta = {k: v for k, v in meta.items() if k != "checksum"}
    meta["checksum"] = checksum(meta, tensors)
    return save_tensor_parts(tensors, meta)


def parse_header(head: bytes) -> tuple[int, dict]:
    """The first bytes of a safetensors blob -> (header length, header JSON object)."""
    if len(head) < 8:
        raise CorruptState("too short to be a safetensors file")
    (length,) = struct.unpack("<Q", head[:8])
    if length > MAX_HEADER_BYTES or len(head) < 8 + length:
        raise CorruptState("safetensors header length is out of range")
    try:
        header = json.loads(bytes(head[8 : 8 + length]))  # a memoryview too (`joined`)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CorruptState("safetensors header is not JSON") from None
    except (RecursionError, ValueError) as error:  # nested past the parser's depth, an integer past its digits
        raise CorruptState(f"safetensors header cannot be read ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise CorruptState("safetensors header is not an object")
    return length, header


# every dtype safetensors' torch reader reads, by its name in a header: an import in one no session
# holds (float8, complex) is read, and refused by the engine naming the dtype (`conform_import`)
_DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()} | {
    name: getattr(torch, attribute) for name, attribute in (
        ("F8_E4M3", "float8_e4m3fn"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2", "float8_e5m2"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("C64", "complex64"), ("U64", "uint64"), ("U32", "uint32"),
        ("U16", "uint16")) if hasattr(torch, attribute)}


def load_tensors(blob) -> dict[str, torch.Tensor]:
    """A safetensors blob's tensors, each a copy of its bytes: what safetensors.torch.load gives,
    refusing what it refuses (CorruptState). safetensors' reader holds Python's interpreter lock
    for the whole copy: at transfo-xl-wt103's size, 237 MB read back from a store or imported held
    every other thread of the engine process, the decode loop's included, for 120-170 ms. Here each
    tensor is copied by NumPy, which lets the lock go while it copies (4 ms at most, as fast). Its
    checks are safetensors' own: string metadata, every tensor's dtype one its torch reader reads,
    a shape of non-negative integers, and offsets that tile the data exactly, each tensor's span
    its shape's bytes."""
    length, header = parse_header(blob)
    start, size = 8 + length, len(blob) - 8 - length
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptState("unreadable safetensors payload: its metadata is not a map of strings")
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = _DTYPES_BY_NAME[entry["dtype"]], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CorruptState(f"unreadable safetensors payload: tensor {name[:64]!r} has no dtype safetensors "
                               "reads, shape and data offsets") from None
        if not (isinstance(shape, list) and all(type(d) is int and 0 <= d < 1 << 63 for d in shape)
                and type(begin) is int and type(end) is int and 0 <= begin <= end):
            raise CorruptState(f"unreadable safetensors payload: tensor {name[:64]!r} has a malformed shape or offsets")
        numel, overflowed = 1, False
        for d in shape:  # as safetensors computes it: a running product past 2^63 is refused
            numel *= d
            overflowed = overflowed or numel >= 1 << 63
        if overflowed:
            raise CorruptState(f"unreadable safetensors payload: tensor {name[:64]!r}'s shape overflows")
        if numel * dtype.itemsize != end - begin:
            raise CorruptState(f"unreadable safetensors payload: tensor {name[:64]!r} spans {end - begin} bytes, "
                               f"not its shape's")
        spans.append((begin, end, name, dtype, shape))
    spans.sort()
    covered = 0
    for begin, end, name, _, _ in spans:
        if begin != covered:
            raise CorruptState(f"unreadable safetensors payload: tensor {name[:64]!r} does not start where the one "
                               "before it ends")
        covered = end
    if covered != size:
        raise CorruptState(f"unreadable safetensors payload: its tensors cover {covered} of its {size} data bytes")
    tensors = {}
    for begin, end, name, dtype, shape in spans:
        try:
            tensor = torch.empty(shape, dtype=dtype)
        except RuntimeError as error:  # a shape torch cannot hold (its sizes' product past int64 as it counts)
            if out_of_memory(error):
                raise
            raise CorruptState(f"unreadable safetensors payload: tensor {name[:64]!r} of shape {shape}: {error}") from None
        if end > begin:
            tensor.reshape(-1).view(torch.uint8).numpy()[:] = numpy.frombuffer(blob, numpy.uint8, end - begin,
                                                                                start + begin)
        tensors[name] = tensor
    return tensors


def entries_from_lines(text: bytes | str | None) -> list[dict]:
    """A session's remembered Idempotency-Key entries from their stored form (one JSON object a
    line, newest first); CorruptState when one does not read."""
    if not text:
        return []
    try:
        if isinstance(text, bytes):
            text = text.decode()
        entries = [json.loads(line) for line in text.split("\n") if line]
    except ValueError as error:  # not UTF-8, or not JSON
        raise CorruptState(f"its remembered Idempotency-Keys do not read ({error})") from None
    if not all(isinstance(entry, dict) for entry in entries):
        raise CorruptState("its remembered Idempotency-Keys are not JSON objects")
    return entries


def check_record_metadata(meta: dict, fields: tuple[str, ...] = ("model", "nbytes", "tokens")) -> None:
    """CorruptState naming the first of the fields a session's books are built from (`fields`,
    and the times and remembered Idempotency-Keys when present) that is missing or does not read: a header whose JSON parses but
    was damaged or written by something else must fail its own session, never the start-up or a
    listing of every session."""
    numbers = {"nbytes": int, "tokens": int, "version": int, "created_at": float, "last_used_at": float}
    for name in (*fields, *(n for n in ("created_at", "last_used_at") if n in meta)):
        if name not in meta:
            raise CorruptState(f"its metadata has no {name!r}")
        value = meta[name]
        if name == "model":
            if not isinstance(value, str) or not value:
                raise CorruptState(f"its metadata's 'model' is {value!r}, not a model name")
            continue
        try:
            number = numbers[name](value)
        except (TypeError, ValueError):
            raise CorruptState(f"its metadata's {name!r} is {value!r}, not a number") from None
        if number < 0 or number != number:  # negative, or NaN
            raise CorruptState(f"its metadata's {name!r} is {value!r}")
    if not isinstance(meta.get("owner") or "", str):  # an API key's owner, or none
        raise CorruptState(f"its metadata's 'owner' is a JSON {type(meta['owner']).__name__}, not a string")
    if "idempotency" in meta:
        entries_from_lines(meta["idempotency"])


def metadata_of(blob_or_head: bytes) -> dict[str, str]:
    """Only the metadata (no tensors read, no checksum verified): enough to index a file."""
    _, header = parse_header(blob_or_head)
    meta = header.get("__metadata__") or {}
    # an imported blob's header is the client's: its metadata may be any JSON value
    if not isinstance(meta, dict):
        raise CorruptState(f"not an {FORMAT} blob (its metadata is a JSON {type(meta).__name__}, not an object)")
    if meta.get("format") != FORMAT:
        raise CorruptState(f"not an {FORMAT} blob (metadata 'format' is {str(meta.get('format'))[:64]!r})")
    return {str(k): str(v) for k, v in meta.items()}


def decode(blob: bytes, require_checksum: bool = True) -> tuple[dict[str, str], dict[str, torch.Tensor], torch.Tensor | None]:
    """safetensors bytes -> (metadata, state tensors by State name, next_log_probs or None).
    Raises CorruptState when the blob is unreadable or its checksum does not match."""
    meta = metadata_of(blob)
    tensors = load_tensors(blob)
    if "checksum" in meta:
        if checksum(meta, tensors) != meta["checksum"]:
            raise CorruptState("checksum mismatch: the session's bytes were altered or truncated")
    elif require_checksum:
        raise CorruptState("the blob has no checksum")
    state = {k[len(STATE_PREFIX):]: v for k, v in tensors.items() if k.startswith(STATE_PREFIX)}
    stray = sorted(k for k in tensors if not k.startswith(STATE_PREFIX) and k != "next_log_probs")
    if stray:
        raise CorruptState(f"unexpected tensors {stray}")
    return meta, state, tensors.get("next_log_probs")


def session_data(state_class: type[State], meta: dict[str, str], state_tensors: dict[str, torch.Tensor],
                 next_log_probs: torch.Tensor | None) -> SessionData:
    """Rebuild SessionData from decoded parts (ValueError when the tensors do not fit the class)."""
    if meta.get("state_class") not in (None, state_class.__name__):
        raise ValueError(f"the state is a {meta.get('state_class')}, this model keeps a {state_class.__name__}")
    try:
        tokens = int(meta.get("tokens", "0"))
    except ValueError:
        raise ValueError(f"metadata 'tokens' is not an integer: {meta.get('tokens')!r}") from None
    if tokens < 0:
        raise ValueError("metadata 'tokens' is negative")
    if tokens > MAX_TOKENS:  # a count no history reaches; past floats, counters and metrics fail on it
        raise ValueError("metadata 'tokens' is past 2**62, more than any history holds")
    return SessionData(state=state_class.from_tensors(state_tensors), tokens=tokens, next_log_probs=next_log_probs)


# -- a commit's delta: what changed since the version before (issue 36, "commits that cost the new
# tokens"). The same safetensors encoding with a checksum, as a block of a session's append-only
# log on disk (stores.py `DiskStore.append`) or in Redis (`RedisStore.append`). Tensors:
# "values/<name>" and "index/<name>" of each changed state tensor (models/interface.py
# `TensorChange`), "next_log_probs" when the session has one; metadata: the session's metadata at
# the new version (as `encode` writes it), plus "delta" = JSON {name: [op, axis, drop]} for every
# tensor that changed, and "next_log_probs" = "set", "none" or "same". A blob with a "delta"
# key is never a session (`decode` refuses its tensors), so an import of one is refused.

DELTA_VALUES, DELTA_INDEX = "values/", "index/"


def encode_delta(changes: dict, state_meta: dict[str, str], next_log_probs: torch.Tensor | None | str,
                 metadata: dict[str, str]) -> bytes:
    """A delta block: `changes` (name -> TensorChange, from `State.delta_from`; empty: only the
    metadata changed), `state_meta` (tokens, nbytes, state_class, state_dtype of the new version:
    `state_metadata`), `next_log_probs` (a tensor, None, or "same": unchanged) and the session's
    `metadata` at the new version."""
    tensors, ops = {}, {}
    for name, change in changes.items():
        if change.op == "same":
            continue
        ops[name] = [change.op, change.axis, change.drop]
        tensors[DELTA_VALUES + name] = change.values
        if change.index is not None:
            tensors[DELTA_INDEX + name] = change.index.to(torch.int64)
    if isinstance(next_log_probs, torch.Tensor):
        tensors["next_log_probs"] = next_log_probs
        logits = "set"
    else:
        logits = "none" if next_log_probs is None else "same"
    meta = {k: str(v) for k, v in metadata.items()} | state_meta
    meta.update(format=FORMAT, format_version=FORMAT_VERSION, delta=json.dumps(ops, sort_keys=True),
                next_log_probs=logits)
    return joined(_sealed_parts(tensors, meta))


def delta_bytes_bound(changes: dict, next_log_probs: torch.Tensor | None, metadata: dict[str, str]) -> int:
    """At most the bytes `encode_delta(changes, ..., next_log_probs, metadata)` writes, framed in a
    log: every changed tensor (values and index), the next-token row, the metadata (as JSON, with
    the Idempotency-Keys it remembers), 512 bytes per tensor for its header entries (name, dtype,
    shape, offsets; its operation) and 4 kB for the rest of the header and the frame. What a
    delta commit books on disk before it is encoded."""
    changed = [change for change in changes.values() if change.op != "same"]
    logits = 0 if next_log_probs is None else next_log_probs.numel() * next_log_probs.element_size()
    header = len(json.dumps({k: str(v) for k, v in metadata.items()})) + 512 * (len(changed) + 1) + 4096
    return sum(change.nbytes() for change in changed) + logits + header


def state_metadata(data: SessionData) -> dict[str, str]:
    """The metadata `encode` derives from the data itself."""
    return {"tokens": str(data.tokens), "nbytes": str(data.nbytes()), "state_class": type(data.state).__name__,
            "state_dtype": state_dtype_of(data.state)}


def decode_delta(blob: bytes) -> tuple[dict[str, str], dict, str, torch.Tensor | None]:
    """A delta block -> (metadata, changes by tensor name, next_log_probs mode, next_log_probs).
    CorruptState when unreadable, not a delta, or its checksum does not match."""
    meta = metadata_of(blob)
    if "delta" not in meta:
        raise CorruptState("a log block that is not a delta")
    tensors = load_tensors(blob)
    if checksum(meta, tensors) != meta.get("checksum"):
        raise CorruptState("checksum mismatch in a delta block")
    try:
        ops = json.loads(meta["delta"])
        changes = {name: TensorChange(op, axis=int(axis), drop=int(drop), values=tensors[DELTA_VALUES + name],
                                      index=tensors.get(DELTA_INDEX + name))
                   for name, (op, axis, drop) in ops.items()}
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as error:  # not a {name: [op, axis, drop]}
        raise CorruptState(f"a delta block's description is unreadable: {error}") from None
    return meta, changes, meta.get("next_log_probs", "same"), tensors.get("next_log_probs")


class _Building:
    """One state tensor while a log's blocks are applied to it: the pieces it is made of (the
    base's positions still kept, then each slide's appended ones), joined once at the end or
    when a block overwrites slots. So reading a base and n blocks copies the state about once,
    not n times (a log of a hundred small appends to a 236 MB memory is 236 MB of copies, not
    23 GB)."""

    def __init__(self, tensor: torch.Tensor | None):
        self.parts = [] if tensor is None else [tensor]
        self.axis = 0
        self.owned = False  # parts == [a tensor made here], which a block may overwrite in place

    def apply(self, change: TensorChange) -> None:
        if change.op == "same":
            return
        if change.op == "whole":
            self.parts, self.owned = [change.values], False
            return
        if not self.parts:
            raise CorruptState("a delta block changes a state tensor the session lacks")
        if change.op == "slide":
            if len(self.parts) > 1 and change.axis != self.axis:
                self.join()
            self.axis, drop = change.axis, change.drop
            while drop:
                first = self.parts[0]
                length = first.shape[self.axis]
                if length <= drop:
                    self.parts.pop(0)
                    drop -= length
                    if not self.parts:
                        raise CorruptState("a delta block drops more positions than the state holds")
                else:
                    self.parts[0] = first.narrow(self.axis, drop, length - drop)
                    drop = 0
            self.parts.append(change.values)
            self.owned = False
        elif change.op == "slots":
            tensor = self.join()
            if not self.owned:
                tensor = tensor.clone()
            tensor.index_copy_(change.axis, change.index, change.values)
            self.parts, self.owned = [tensor], True
        else:
            raise CorruptState(f"unknown state change {change.op!r}")

    def join(self) -> torch.Tensor:
        if len(self.parts) > 1:
            self.parts, self.owned = [torch.cat(self.parts, dim=self.axis)], True
        return self.parts[0]


def materialise(base: bytes, deltas: list[bytes]) -> tuple[dict[str, str], dict[str, torch.Tensor], torch.Tensor | None]:
    """A base blob and the delta blocks after it, in order -> what `decode` gives for the session
    at the last block's version. CorruptState when any part is unreadable or does not apply."""
    meta, tensors, next_log_probs = decode(base)
    if not deltas:
        return meta, tensors, next_log_probs
    building = {name: _Building(tensor) for name, tensor in tensors.items()}
    for blob in deltas:
        meta, changes, logits, logits_tensor = decode_delta(blob)
        try:
            for name, change in changes.items():
                building.setdefault(name, _Building(None)).apply(change)
        except (RuntimeError, IndexError, TypeError, ValueError) as error:  # TypeError: a slots op without its index
            if out_of_memory(error):  # the machine's trouble, not the blocks': never called damage
                raise
            raise CorruptState(f"a delta block does not apply to the state before it: {error}") from None
        if logits == "set":
            next_log_probs = logits_tensor
        elif logits == "none":
            next_log_probs = None
    try:
        tensors = {name: piece.join() for name, piece in building.items() if piece.parts}
    except RuntimeError as error:
        if out_of_memory(error):
            raise
        raise CorruptState(f"a delta block does not apply to the state before it: {error}") from None
    meta = {k: v for k, v in meta.items() if k not in ("delta", "next_log_probs")}
    return meta, tensors, next_log_probs
