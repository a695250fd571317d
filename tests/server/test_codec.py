"""The session codec's safetensors writer and reader (server/cache/codec.py `save_tensor_parts`,
`load_tensors`): the bytes safetensors' own writer makes, with each tensor's memory copied once,
and what its own reader reads from them, refusing what it refuses."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from xlserve.server.cache.codec import SessionData, decode, encode, joined, load_tensors, save_tensor_parts
from xlserve.server.cache.errors import CorruptState

EVERY_KIND = {
    "state.keys": torch.randn(2, 3, 5, 4),
    "state.positions": torch.arange(7),
    "state.bfloat16": torch.randn(6).to(torch.bfloat16),
    "state.float16": torch.randn(3).to(torch.float16),
    "state.float64": torch.randn(2, dtype=torch.float64),
    "state.int32": torch.arange(3, dtype=torch.int32),
    "state.int8": torch.arange(-2, 3, dtype=torch.int8),
    "state.uint8": torch.arange(4, dtype=torch.uint8),
    "state.mask": torch.tensor([True, False, True]),
    "state.empty": torch.zeros(0, 3),
    "state.scalar": torch.tensor(2.5),
    "state.transposed": torch.randn(4, 3).t(),  # not contiguous: written as its values
    "next_log_probs": torch.randn(11).log_softmax(-1),
}


@pytest.mark.parametrize("metadata", [{"format": "xlserve-session", "checksum": "sha256:0", "é": "ü"}, {}])
def test_the_bytes_are_safetensors_own(metadata):
    """What safetensors.torch.save writes, for every dtype a session holds, empty and 0-d tensors,
    and a view that is not contiguous: the same header length, the same header (as JSON: its
    writer puts the metadata's keys in a hash map's order, which changes from one process to the
    next) and the same data, byte for byte, in the same order."""
    ours = joined(save_tensor_parts(EVERY_KIND, metadata))
    theirs = save_safetensors({name: t.contiguous() for name, t in EVERY_KIND.items()}, metadata=metadata or None)
    (length,), (their_length,) = struct.unpack("<Q", ours[:8]), struct.unpack("<Q", theirs[:8])
    assert length == their_length and length % 8 == 0
    assert json.loads(ours[8 : 8 + length]) == json.loads(theirs[8 : 8 + length])
    assert ours[8 + length :] == theirs[8 + length :]
    loaded = load_safetensors(ours)
    assert loaded.keys() == EVERY_KIND.keys()
    for name, tensor in EVERY_KIND.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)


def test_a_dtype_no_session_holds_is_refused_by_name():
    with pytest.raises(ValueError, match="complex64"):
        save_tensor_parts({"state.z": torch.zeros(2, dtype=torch.complex64)}, {})


def test_encode_is_a_snapshot_of_the_state_it_read_in_place():
    """`encode` no longer clones the state before writing it: the bytes it returns are the
    values at the time of the call, whatever happens to the tensors afterwards."""
    from tests.server.cache_helpers import ToyState

    memory = torch.arange(12, dtype=torch.float32).reshape(1, 12)
    state = ToyState(memory=memory.clone(), layers=[torch.arange(3).reshape(1, 3)])
    data = SessionData(state=state, tokens=3, next_log_probs=torch.zeros(5))
    blob = encode(data, {"session_id": "sess_x", "model": "m"})
    state.memory.add_(100)  # the cache's buffers are written in place by later appends
    state.layers[0].add_(100)
    meta, tensors, next_log_probs = decode(blob)
    assert torch.equal(tensors["memory"], memory) and torch.equal(tensors["layers.0"], torch.arange(3).reshape(1, 3))
    assert meta["tokens"] == "3" and torch.equal(next_log_probs, torch.zeros(5))


def test_a_blob_in_parts_is_the_blob(tmp_path):
    """`encode_parts` joined is `encode`, and the disk writes its parts as the same file without
    joining them (what a compaction at real size writes), counting the same bytes."""
    from tests.server.cache_helpers import ToyState
    from xlserve.server.cache.codec import blob_bytes, encode_parts
    from xlserve.server.cache.stores import DiskStore

    state = ToyState(memory=torch.randn(2, 1000), layers=[torch.arange(6).reshape(2, 3)])
    data = SessionData(state=state, tokens=7, next_log_probs=torch.randn(9).log_softmax(-1))
    metadata = {"session_id": "sess_" + "a" * 32, "model": "m"}
    parts, whole = encode_parts(data, metadata), encode(data, metadata)
    assert len(parts) == 4 and joined(parts) == whole and blob_bytes(parts) == len(whole) == blob_bytes(whole)
    store = DiskStore(tmp_path)
    store.write("sess_" + "a" * 32, parts)
    store.write("sess_" + "b" * 32, whole)
    assert store.read("sess_" + "a" * 32) == store.read("sess_" + "b" * 32) == whole
    assert store.bytes_written["whole"] == 2 * len(whole)


def test_compact_copies_only_the_tensors_that_are_views_of_a_batch():
    """A finished row's next-token log-probs are a row of its batch's, while its state may be its
    own already: the whole state was copied again for them (237 MB at wt103's size)."""
    import torch

    from tests.server.cache_helpers import data

    session = data(100, 0)
    batch_rows = torch.randn(4, 7)
    viewed = SessionData(state=session.state, tokens=session.tokens, next_log_probs=batch_rows[2])
    compacted = viewed.compact()
    own = dict(session.state._named_tensors())
    assert all(tensor is own[name] for name, tensor in compacted.state._named_tensors())  # not copied
    assert compacted.next_log_probs.untyped_storage().nbytes() == 7 * 4  # copied out of the batch
    assert torch.equal(compacted.next_log_probs, batch_rows[2])


def test_the_reader_reads_what_safetensors_reads():
    """Every dtype a session holds, empty and 0-d tensors: the same names, dtypes, shapes and
    values as safetensors.torch.load, each tensor its own memory (not a view of the blob)."""
    blob = joined(save_tensor_parts(EVERY_KIND, {"format": "xlserve-session"}))
    ours, theirs = load_tensors(blob), load_safetensors(blob)
    assert ours.keys() == theirs.keys() == EVERY_KIND.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape
        assert torch.equal(ours[name], tensor)
    ours["state.keys"].zero_()  # writable, and the blob unchanged
    assert torch.equal(load_tensors(blob)["state.keys"], EVERY_KIND["state.keys"])


def _header_and_data(blob: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def _blob(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _mutations(header: dict, data: bytes, rng: random.Random):
    """Damaged variants of a safetensors file: offsets, shapes and dtypes changed, data cut or
    padded, metadata of other types."""
    names = [name for name in header if name != "__metadata__"]
    for _ in range(300):
        changed = json.loads(json.dumps(header))
        body = data
        name = rng.choice(names)
        kind = rng.randrange(9)
        entry = changed[name]
        if kind == 0:
            entry["data_offsets"][rng.randrange(2)] += rng.choice([-8, -1, 1, 4, 8, 1 << 40])
        elif kind == 1 and entry["shape"]:
            entry["shape"][rng.randrange(len(entry["shape"]))] = rng.choice([0, 1, 3, -1, 2.0, True, "2", 1 << 64])
            if rng.random() < 0.3:  # sizes whose running product overflows, the whole one 0
                entry["shape"], entry["data_offsets"] = [1 << 62, 1 << 62, 0], [0, 0]
        elif kind == 2:
            entry["dtype"] = rng.choice(["F32", "F16", "I64", "BOOL", "U16", "C64", "f32", 3])
        elif kind == 3:
            body = data[: rng.randrange(len(data) + 1)]
        elif kind == 4:
            body = data + bytes(rng.choice([1, 4, 8]))
        elif kind == 5:
            changed["__metadata__"] = rng.choice([{"a": 1}, ["x"], "x", {"a": None}, {}])
        elif kind == 6:
            del entry[rng.choice(["dtype", "shape", "data_offsets"])]
        elif kind == 7:
            entry["data_offsets"] = rng.choice([[0], [1, 0], "0,4", [0, 4, 8], None])
        else:
            entry["shape"] = rng.choice([None, 3, [], [[1]], {}])
        yield _blob(changed, body)


def test_the_reader_refuses_what_safetensors_refuses():
    """300 damaged files: each that safetensors refuses (or reads into tensors it cannot build)
    is a CorruptState here, never another exception; each it reads (a dtype no session holds
    among them: the engine refuses it by name) is read the same here."""
    header, data = _header_and_data(joined(save_tensor_parts(EVERY_KIND, {"format": "xlserve-session"})))
    agreed = refused = 0
    for blob in _mutations(header, data, random.Random(7)):
        try:
            theirs = load_safetensors(blob)
        except Exception:  # safetensors raises its own error types
            theirs = None
        try:
            ours = load_tensors(blob)
        except CorruptState:
            ours = None
        if theirs is None:
            assert ours is None
            refused += 1
        elif ours is not None:
            assert ours.keys() == theirs.keys()
            assert all(ours[n].dtype == theirs[n].dtype and torch.equal(ours[n], theirs[n]) for n in ours)
            agreed += 1
        else:
            pytest.fail("read by safetensors, refused here")
    assert refused > 150 and agreed > 10
