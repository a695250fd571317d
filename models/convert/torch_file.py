"""The tensors of a `torch.save` file (a Hugging Face `pytorch_model.bin`), read without unpickling.

A torch.save file describes its objects as a pickle: a program for Python's unpickler, which may
import and call anything it names. xlserve never runs one (nor torch.load's restricted
unpickler, `weights_only=True`, whose checks have been bypassed before). Instead this module reads
the pickle's opcodes as data (`pickletools.genops` disassembles; it constructs nothing) and
evaluates the few a state dict uses on a stack of plain values: strings, numbers, tuples, lists,
dicts, and tensors. Of the names a pickle may import, only those that build a state dict are
known (an OrderedDict, a tensor over a storage, a parameter around a tensor, the storage dtypes);
any other, or an opcode outside that subset, refuses the file with the name it asked for.

Both layouts torch.save writes are read:
- the zip archive (torch >= 1.6): `<name>/data.pkl` whose persistent ids name storages stored
  as `<name>/data/<key>`, little-endian unless `<name>/byteorder` says otherwise;
- the legacy stream (older files, such as 2019's Transformer-XL weights): five pickles (a magic
  number, a protocol version, system info, the object, the list of storage keys) followed by
  each storage as an int64 element count and its bytes.

A tensor is `torch.frombuffer` over its storage's bytes, viewed with the file's offset, size
and stride, so tensors that shared a storage (tied weights, views) share it here too. The bytes
are those of the file mapped into memory (copy on write), not read: a storage is paged in when an
importer reads it, so converting a checkpoint of many gigabytes holds the model it builds, not
the source file besides (a storage the file does not align to its element size is copied).

The file is its author's, so nothing it declares is trusted before it is checked against what
the file holds: an archive entry must be stored (torch.save never compresses) and lie within the
file, a storage's bytes must be there before its buffer is allocated, a legacy stream's reads are
capped at its length, a view must lie within its storage, and no value is walked or printed whole
(shared references let a few hundred bytes stand for 2**60 values). Anything else a damaged file
makes the parts raise is NotATensorFile too.
"""

from __future__ import annotations

import io
import mmap
import os
import pickletools
import struct
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of a legacy torch.save stream
LEGACY_PROTOCOL = 1001

STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


class NotATensorFile(ValueError):
    """The file is not a torch.save file of tensors this module reads; the message says why."""


class _Mark:
    """Where MARK put the start of a group of stack items."""


class _Global:
    """A name the pickle imports (`module.name`); only `_call` gives it a meaning."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class _StorageRef:
    """A persistent id's storage: its dtype, its key in the file and its element count."""

    def __init__(self, dtype: torch.dtype, key: str, numel: int):
        self.dtype, self.key, self.numel = dtype, key, numel


def read_tensors(path: str | Path) -> dict[str, Tensor]:
    """The flat name -> tensor dict a torch.save file holds. NotATensorFile naming the reason
    for anything else (another layout, an import or opcode outside a state dict's, a storage
    shorter than its tensors, sizes the file cannot hold)."""
    path = Path(path)
    try:
        with open(path, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            mapped = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
            if zipfile.is_zipfile(stream):
                stream.seek(0)
                with zipfile.ZipFile(stream) as archive:
                    return _flat(_read_archive(archive, size, mapped))
            stream.seek(0)
            return _read_legacy(_Bounded(stream, size), mapped)
    except NotATensorFile:
        raise
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, RuntimeError, EOFError, zipfile.BadZipFile,
            MemoryError, OverflowError, RecursionError) as error:  # whatever a damaged file makes the parts raise
        raise NotATensorFile(f"it does not read as a state dict ({type(error).__name__})") from None


def _flat(loaded: object) -> dict[str, Tensor]:
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, Tensor)
                                               for k, v in loaded.items()):
        raise NotATensorFile("it does not hold a flat name -> tensor state dict")
    return loaded


class _Bounded:
    """A file read by pickletools with every read capped at what the file still holds: an
    opcode that declares a length of 2**40 bytes reads what is there and is refused, instead of
    allocating the length it declares first."""

    def __init__(self, stream, size: int):
        self.stream, self.size = stream, size

    def read(self, n: int = -1) -> bytes:
        left = max(self.size - self.stream.tell(), 0)
        return self.stream.read(left if n < 0 else min(n, left))

    def readline(self) -> bytes:
        return self.stream.readline(max(self.size - self.stream.tell(), 0))

    def readinto(self, buffer) -> int:
        return self.stream.readinto(buffer)

    def tell(self) -> int:
        return self.stream.tell()


def _read_archive(archive: zipfile.ZipFile, archive_bytes: int, mapped: mmap.mmap) -> object:
    names = archive.namelist()
    pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise NotATensorFile(f"a zip archive without one <name>/data.pkl ({len(names)} entries)")
    root = pickles[0][: -len("data.pkl")]
    order = "little"
    if root + "byteorder" in names:
        order = _entry_bytes(archive, archive.getinfo(root + "byteorder"), archive_bytes).decode(errors="replace")
        order = order.strip()
    storages: dict[str, Tensor] = {}

    def storage(ref: _StorageRef) -> Tensor:
        if ref.key not in storages:
            try:
                entry = archive.getinfo(f"{root}data/{ref.key}")
            except KeyError:
                raise NotATensorFile(f"storage {ref.key!r} is missing from the archive") from None
            size = ref.numel * _element_size(ref.dtype)
            if entry.file_size < size:  # checked before its buffer is allocated
                raise NotATensorFile(f"storage {ref.key!r} holds {entry.file_size} bytes, fewer than its "
                                     f"{ref.numel} elements")
            _check_entry(entry, archive_bytes)
            storages[ref.key] = _storage_tensor(_mapped_bytes(mapped, _data_start(mapped, entry), size), ref, order)
        return storages[ref.key]

    pickled = _entry_bytes(archive, archive.getinfo(pickles[0]), archive_bytes)
    return _evaluate(pickletools.genops(io.BytesIO(pickled)), storage, legacy=False)


def _check_entry(entry: zipfile.ZipInfo, archive_bytes: int) -> None:
    """An archive entry as torch.save writes them: stored, not compressed, and within the file.
    The sizes an archive declares are its author's: a compressed entry could inflate past any
    bound, and a declared size past the file's end would be allocated before its read failed."""
    if entry.compress_type != zipfile.ZIP_STORED or entry.compress_size != entry.file_size:
        raise NotATensorFile(f"its entry {entry.filename!r} is compressed, which torch.save never does")
    if entry.header_offset + entry.compress_size > archive_bytes:
        raise NotATensorFile(f"its entry {entry.filename!r} declares more bytes than the file holds")


def _data_start(mapped: mmap.mmap, entry: zipfile.ZipInfo) -> int:
    """Where a stored entry's bytes begin: after its local header, whose name and extra field
    may differ in length from those of the central directory (zipfile reads it the same way)."""
    header = mapped[entry.header_offset : entry.header_offset + 30]
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise NotATensorFile(f"its entry {entry.filename!r} has no local header where the archive says")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return entry.header_offset + 30 + name_length + extra_length


def _mapped_bytes(mapped: mmap.mmap, start: int, size: int) -> Tensor:
    """`size` bytes of the mapped file from `start`, as a uint8 tensor over the mapping (nothing
    read yet); NotATensorFile when the file ends before them."""
    if start < 0 or start + size > len(mapped):
        raise NotATensorFile("it ends inside a storage")
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mapped, dtype=torch.uint8, count=size, offset=start)


def _entry_bytes(archive: zipfile.ZipFile, entry: zipfile.ZipInfo, archive_bytes: int) -> bytes:
    _check_entry(entry, archive_bytes)
    return archive.read(entry)


def _read_legacy(stream, mapped: mmap.mmap | None) -> object:
    try:
        header = [_evaluate(pickletools.genops(stream), _no_storage, legacy=True) for _ in range(3)]
    except NotATensorFile:
        raise NotATensorFile("neither a zip archive nor a legacy torch.save stream") from None
    magic, protocol, system = header
    if magic != LEGACY_MAGIC or protocol != LEGACY_PROTOCOL or not isinstance(system, dict):
        raise NotATensorFile("neither a zip archive nor a legacy torch.save stream")
    if not system.get("little_endian", True):
        raise NotATensorFile("a big-endian legacy file")
    refs: dict[str, _StorageRef] = {}

    def remember(ref: _StorageRef) -> _StorageRef:
        refs.setdefault(ref.key, ref)
        return ref  # a placeholder: the storages follow the object

    loaded = _evaluate(pickletools.genops(stream), remember, legacy=True)
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, _View) for k, v in loaded.items()):
        raise NotATensorFile("it does not hold a flat name -> tensor state dict")
    keys = _evaluate(pickletools.genops(stream), _no_storage, legacy=True)
    if not isinstance(keys, list) or not all(isinstance(key, str) for key in keys) or set(keys) != set(refs):
        raise NotATensorFile("its list of storages does not match the storages its tensors name")
    storages: dict[str, Tensor] = {}
    left = stream.size
    for key in keys:
        ref = refs[key]
        (count,) = struct.unpack("<q", bytes(_read_exactly(stream, 8)))
        if count != ref.numel:
            raise NotATensorFile(f"storage {key!r} holds {count} elements where {ref.numel} were named")
        size = count * _element_size(ref.dtype)
        if size > left - stream.tell():
            raise NotATensorFile("it ends inside a storage")
        start = stream.tell()
        storages[key] = _storage_tensor(_mapped_bytes(mapped, start, size), ref, "little")
        stream.stream.seek(start + size)
    return {name: _strided(storages[view.ref.key], view.offset, view.size, view.stride) for name, view in loaded.items()}


def _read_exactly(stream, n: int) -> bytearray:
    """`n` bytes of `stream` into one buffer."""
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        read = stream.readinto(view[got:])
        if not read:
            raise NotATensorFile("it ends inside a storage")
        got += read
    return data


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _storage_tensor(raw: Tensor, ref: _StorageRef, order: str) -> Tensor:
    """The storage's elements (`raw`, exactly its bytes, uint8) as a flat tensor sharing `raw`
    (a copy where `raw` does not start at a multiple of the element size)."""
    if order not in ("little", "big"):
        raise NotATensorFile(f"its byteorder is {order[:20]!r}")
    size = _element_size(ref.dtype)
    if ref.numel == 0:
        return torch.empty(0, dtype=ref.dtype)
    if raw.data_ptr() % size:
        raw = raw.clone()  # a fresh allocation is aligned
    flat = raw.view(ref.dtype)
    if order != sys.byteorder and size > 1:  # swap the bytes of each number (a complex number's two apart)
        part = size // 2 if ref.dtype.is_complex else size
        flat = flat.view(torch.uint8).view(-1, part).flip(1).contiguous().view(-1).view(ref.dtype)
    return flat


def _no_storage(ref: _StorageRef) -> Tensor:
    raise NotATensorFile("a storage where none belongs")


# -- the pickle's opcodes, evaluated as data ---------------------------------------------------

# the opcodes a state dict's pickle uses; each one's effect on the stack is in _evaluate
PUSH_ARGUMENT = {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "BININT", "BININT1", "BININT2",
                 "LONG1", "LONG4", "INT", "LONG", "BINFLOAT", "FLOAT", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8",
                 "SHORT_BINSTRING", "BINSTRING", "STRING"}
CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}
IGNORED = {"PROTO", "FRAME", "STOP"}


def _evaluate(ops: Iterator, storage: Callable[[_StorageRef], object], legacy: bool) -> object:
    """Run one pickle's opcodes (`ops`, from pickletools.genops) on a stack of plain values;
    the value left at STOP. A persistent id becomes `storage(ref)`."""
    stack: list = []
    memo: dict[int, object] = {}

    def pop_mark() -> list:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1 :]
                del stack[i:]
                return items
        raise NotATensorFile("its pickle pops a mark it never set")

    try:
        for op, arg, _ in ops:
            name = op.name
            if name in IGNORED:
                if name == "STOP":
                    break
            elif name in PUSH_ARGUMENT:
                stack.append(arg)
            elif name in CONSTANTS:
                stack.append(CONSTANTS[name])
            elif name == "EMPTY_DICT":
                stack.append({})
            elif name == "EMPTY_LIST":
                stack.append([])
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "TUPLE":
                stack.append(tuple(pop_mark()))
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif name == "LIST":
                stack.append(pop_mark())
            elif name == "DICT":
                items = pop_mark()
                stack.append(dict(zip(_keys(items[::2]), items[1::2])))
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(arg)] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo[int(arg)])
            elif name == "SETITEM":
                value, key = stack.pop(), stack.pop()
                _dict(stack[-1])[_key(key)] = value
            elif name == "SETITEMS":
                items = pop_mark()
                _dict(stack[-1]).update(zip(_keys(items[::2]), items[1::2]))
            elif name == "APPEND":
                value = stack.pop()
                _list(stack[-1]).append(value)
            elif name == "APPENDS":
                items = pop_mark()
                _list(stack[-1]).extend(items)
            elif name == "GLOBAL":
                module, _, attribute = arg.partition(" ")
                stack.append(_Global(module, attribute))
            elif name == "STACK_GLOBAL":
                attribute, module = stack.pop(), stack.pop()
                if not (isinstance(module, str) and isinstance(attribute, str)):
                    raise NotATensorFile("its pickle imports a name that is not a string")
                stack.append(_Global(module, attribute))
            elif name == "REDUCE":
                arguments, function = stack.pop(), stack.pop()
                stack.append(_call(function, arguments))
            elif name == "BUILD":
                stack.pop()  # an OrderedDict's state (a state dict's `_metadata`): not a tensor
                if not isinstance(stack[-1], (dict, Tensor)):
                    raise NotATensorFile(f"its pickle sets the state of a {type(stack[-1]).__name__}")
            elif name == "BINPERSID":
                stack.append(storage(_storage_ref(stack.pop(), legacy)))
            else:
                raise NotATensorFile(f"its pickle uses the opcode {name}, which a state dict does not need")
        else:
            raise NotATensorFile("its pickle ends before STOP")
    except NotATensorFile:
        raise
    except (IndexError, KeyError, TypeError, ValueError) as error:  # ValueError: genops met no opcode it knows
        raise NotATensorFile(f"its pickle does not evaluate as a state dict ({type(error).__name__}: {error})") from None
    if len(stack) != 1:
        raise NotATensorFile("its pickle leaves no single object")
    return stack[0]


_MARK = _Mark()


def _key(key) -> str:
    """A dict's key, which in a state dict, its `_metadata` and a legacy file's header is always a
    string: anything else is refused before it is hashed (shared references let a few hundred
    bytes make a tuple of 2**60 tuples, whose hash never ends)."""
    if not isinstance(key, str):
        raise NotATensorFile(f"its pickle keys a dict by a {type(key).__name__}, where a state dict's keys are names")
    return key


def _keys(keys: list) -> list[str]:
    return [_key(key) for key in keys]


def _dict(value) -> dict:
    if not isinstance(value, dict):
        raise NotATensorFile(f"its pickle sets an item of a {type(value).__name__}")
    return value


def _list(value) -> list:
    if not isinstance(value, list):
        raise NotATensorFile(f"its pickle appends to a {type(value).__name__}")
    return value


def _storage_ref(pid, legacy: bool) -> _StorageRef:
    """('storage', <dtype's Storage>, key, location, numel[, view metadata]) -> _StorageRef."""
    if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage" and isinstance(pid[1], _Global)):
        raise NotATensorFile(f"a persistent id that is not a storage ({_kind(pid)})")
    kind = pid[1]
    if kind.module != "torch" or kind.name not in STORAGE_DTYPES:
        raise NotATensorFile(f"a storage of the unknown type {kind!r}")
    if legacy and len(pid) > 5 and pid[5] is not None:
        raise NotATensorFile("a legacy storage view (torch < 1.0), which this reader does not take")
    key, numel = pid[2], pid[4]
    if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
        raise NotATensorFile("a storage id that does not read")
    return _StorageRef(STORAGE_DTYPES[kind.name], key, numel)


def _call(function, arguments):
    """What REDUCE builds: only the calls a state dict's pickle makes."""
    if not isinstance(function, _Global) or not isinstance(arguments, tuple):
        raise NotATensorFile(f"its pickle calls a {_kind(function)}")
    name = f"{function.module}.{function.name}"
    if name == "collections.OrderedDict" and arguments in ((), ([],)):
        return {}
    if name in ("torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor"):
        if len(arguments) < 4:
            raise NotATensorFile(f"{name} with {len(arguments)} arguments")
        if len(arguments) > 6 and arguments[6]:  # a conjugate or negative view's bits: not plain values
            raise NotATensorFile("a tensor stored as a conjugate or negative view, which this reader does not take")
        storage, offset, size, stride = arguments[:4]
        return _view(storage, offset, size, stride)
    if name == "torch._utils._rebuild_parameter" and arguments and isinstance(arguments[0], (Tensor, _View)):
        return arguments[0]
    raise NotATensorFile(f"its pickle imports {name}, which xlserve does not run (only plain tensors are read)")


def _kind(value) -> str:
    """What a value of the pickle is, for a message: never its repr, which a pickle of shared
    references can make as large as it likes."""
    return repr(value) if isinstance(value, _Global) else type(value).__name__


class _View:
    """A legacy stream's tensor before its storage is read (the storages follow the object)."""

    def __init__(self, ref: _StorageRef, offset: int, size: tuple, stride: tuple):
        self.ref, self.offset, self.size, self.stride = ref, offset, size, stride


def _view(storage, offset, size, stride):
    if not isinstance(storage, (Tensor, _StorageRef)):
        raise NotATensorFile(f"a tensor over a {_kind(storage)}, not a storage")
    if not (isinstance(offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) <= 64
            and all(isinstance(n, int) and 0 <= n < 2**62 for n in (offset, *size, *stride))):
        raise NotATensorFile("a tensor's offset, size or stride does not read")
    if isinstance(storage, _StorageRef):
        return _View(storage, offset, size, stride)
    return _strided(storage, offset, size, stride)


def _strided(storage: Tensor, offset: int, size: tuple, stride: tuple) -> Tensor:
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset - 1
    if last >= storage.numel():
        raise NotATensorFile(f"a tensor of size {size} reaches past its storage of {storage.numel()} elements")
    return storage.as_strided(size, stride, offset)
