"""models/convert/torch_file.py: a torch.save file's tensors read without unpickling. Every file
here is written by torch.save from tensors the test holds, and read back is compared with those
tensors (never with torch.load: nothing in this repository unpickles)."""

from __future__ import annotations

import pickle
import struct
import zipfile

import pytest
import torch

from xlserve.models.convert.torch_file import NotATensorFile, read_tensors


def state_dict() -> dict[str, torch.Tensor]:
    """What checkpoints hold: every storage dtype a model uses, tied and viewed storages, a
    parameter, a transposed (non-contiguous) tensor, an empty one, a scalar."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 3, generator=generator)
    return {
        "weight": weight, "tied": weight, "column": weight[:, 1], "rows": weight[1:3],
        "transposed": torch.randn(3, 5, generator=generator).t(),
        "parameter": torch.nn.Parameter(torch.randn(2, generator=generator)),
        "half": torch.randn(3, generator=generator).half(), "bfloat16": torch.randn(3, generator=generator).bfloat16(),
        "double": torch.randn(2, dtype=torch.float64, generator=generator),
        "long": torch.arange(7), "int": torch.arange(3, dtype=torch.int32), "byte": torch.arange(4, dtype=torch.uint8),
        "int8": torch.tensor([-3, 4], dtype=torch.int8), "bool": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
    }


@pytest.mark.parametrize("legacy,protocol", [(False, 2), (True, 2), (False, 4), (True, 4)],
                         ids=["zip", "legacy", "zip-protocol-4", "legacy-protocol-4"])
def test_every_tensor_reads_back_as_saved_with_shared_storages_shared(tmp_path, legacy, protocol):
    """Protocol 2 is torch.save's default; 4 (FRAME, MEMOIZE, SHORT_BINUNICODE, STACK_GLOBAL) is
    what a caller may ask it for."""
    saved = state_dict()
    saved["complex"] = torch.randn(3, dtype=torch.complex64)
    path = tmp_path / "pytorch_model.bin"
    torch.save(saved, path, _use_new_zipfile_serialization=not legacy, pickle_protocol=protocol)
    read = read_tensors(path)
    assert list(read) == list(saved)
    for name, tensor in saved.items():
        got = read[name]
        assert type(got) is torch.Tensor and not got.requires_grad, name
        assert (got.dtype, got.shape, got.stride()) == (tensor.dtype, tensor.shape, tensor.stride()), name
        assert torch.equal(got, tensor.detach()), name
    # tied weights and views stay one storage, as torch.save wrote them
    assert read["tied"].data_ptr() == read["weight"].data_ptr()
    assert read["column"].untyped_storage().data_ptr() == read["weight"].untyped_storage().data_ptr()


def test_an_ordered_state_dict_with_metadata_reads(tmp_path):
    """A module's state_dict() is an OrderedDict carrying `_metadata` (BUILD): the tensors read."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    path = tmp_path / "model.bin"
    torch.save(module.state_dict(), path)
    read = read_tensors(path)
    assert list(read) == list(module.state_dict())
    assert all(torch.equal(read[k], v) for k, v in module.state_dict().items())


class _RunsCode:
    marker = None

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # an unpickler would create this file


def test_a_pickle_that_imports_anything_else_is_refused_and_runs_nothing(tmp_path):
    _RunsCode.marker = tmp_path / "ran"
    for legacy in (False, True):
        path = tmp_path / f"evil-{legacy}.bin"
        torch.save({"weight": torch.ones(2), "bias": _RunsCode()}, path, _use_new_zipfile_serialization=not legacy)
        with pytest.raises(NotATensorFile, match=r"imports (io|builtins)\.open"):
            read_tensors(path)
    assert not _RunsCode.marker.exists()


def test_what_is_not_a_state_dict_of_tensors_is_refused_with_its_reason(tmp_path):
    path = tmp_path / "x.bin"
    torch.save([torch.ones(1)], path)
    with pytest.raises(NotATensorFile, match="flat name -> tensor"):
        read_tensors(path)
    torch.save({"nested": {"weight": torch.ones(1)}}, path)
    with pytest.raises(NotATensorFile, match="flat name -> tensor"):
        read_tensors(path)
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(NotATensorFile, match="neither a zip archive nor a legacy"):
        read_tensors(path)
    path.write_bytes(pickle.dumps({"weight": 1.0}, protocol=2))  # a pickle, but not torch.save's
    with pytest.raises(NotATensorFile):
        read_tensors(path)


def test_a_pickle_whose_key_would_take_forever_to_hash_is_refused_at_once(tmp_path):
    """440 bytes: memo references make a tuple that stands for 2**60 nested tuples, then use it as
    a dict's key. Hashing it never ends (`xlserve convert` spun at 100% CPU for good); a key that
    is not a name is refused before it is hashed. Read in a process of its own, bounded."""
    import subprocess
    import sys

    program = bytearray(b"\x80\x02})q\x00")  # PROTO 2, EMPTY_DICT, EMPTY_TUPLE, BINPUT 0
    for i in range(60):
        program += b"h" + bytes([i]) + b"\x86q" + bytes([i + 1])  # BINGET i, TUPLE2, BINPUT i + 1: (t_i, t_i)
    program += b"K\x01s."  # BININT1 1, SETITEM (the key hashed), STOP
    path = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", bytes(program))
    reader = ("import sys\nfrom xlserve.models.convert.torch_file import NotATensorFile, read_tensors\n"
              "try:\n    read_tensors(sys.argv[1])\nexcept NotATensorFile as error:\n    print(error)\n")
    done = subprocess.run([sys.executable, "-c", reader, str(path)], capture_output=True, text=True, timeout=60)
    assert "keys a dict by a tuple" in done.stdout, (done.stdout, done.stderr)


def rewritten(path, name: str, change) -> None:
    """The zip archive at `path` with entry `name` replaced by change(its bytes)."""
    with zipfile.ZipFile(path) as archive:
        entries = {info.filename: archive.read(info) for info in archive.infolist()}
    entry = next(n for n in entries if n.endswith(name))
    entries[entry] = change(entries[entry])
    with zipfile.ZipFile(path, "w") as archive:
        for entry_name, data in entries.items():
            archive.writestr(entry_name, data)


def test_a_storage_shorter_than_its_tensor_or_missing_is_refused(tmp_path):
    path = tmp_path / "x.bin"
    torch.save({"weight": torch.ones(8)}, path)
    rewritten(path, "data/0", lambda data: data[:12])
    with pytest.raises(NotATensorFile, match="holds 12 bytes, fewer than its 8 elements"):
        read_tensors(path)
    torch.save({"weight": torch.ones(8)}, path)
    rewritten(path, "data.pkl", lambda data: data.replace(b"X\x01\x00\x00\x000", b"X\x01\x00\x00\x007"))
    with pytest.raises(NotATensorFile, match="missing from the archive"):
        read_tensors(path)


def test_a_storage_that_claims_more_than_the_file_holds_allocates_nothing(tmp_path):
    """A storage naming 2**40 elements is refused from the file's sizes, before any buffer."""
    huge = b"cpuq\x06\x8a\x06\x00\x00\x00\x00\x00\x01"  # the location, then LONG1 2**40
    path = tmp_path / "x.bin"
    torch.save({"weight": torch.ones(8)}, path)
    rewritten(path, "data.pkl", lambda pickled: pickled.replace(b"cpuq\x06K\x08", huge, 1))
    with pytest.raises(NotATensorFile, match="fewer than its 1099511627776 elements"):
        read_tensors(path)
    torch.save({"weight": torch.ones(8)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    count = struct.pack("<q", 8) + struct.pack("<f", 1.0) * 8  # the legacy storage: its count, its floats
    assert data.endswith(count)
    path.write_bytes(data.replace(b"cpuq\x06K\x08", huge, 1)[: -len(count)] + struct.pack("<q", 2**40) + count[8:])
    with pytest.raises(NotATensorFile, match="ends inside a storage"):
        read_tensors(path)


def test_a_view_past_its_storage_is_refused(tmp_path):
    """A stride or size the file declares that would reach past the storage's bytes is refused,
    not read out of bounds."""
    path = tmp_path / "x.bin"
    torch.save({"weight": torch.ones(4)}, path)
    # the size tuple (4,) is BININT1 4 then TUPLE1 (K\x04\x85); ask for 400 elements instead (M\x90\x01)
    rewritten(path, "data.pkl", lambda data: data.replace(b"K\x04\x85", b"M\x90\x01\x85", 1))
    with pytest.raises(NotATensorFile, match="reaches past its storage"):
        read_tensors(path)


def test_a_big_endian_archive_is_read_in_this_machines_order(tmp_path):
    path = tmp_path / "x.bin"
    values = torch.tensor([1.5, -2.25, 3.0])
    torch.save({"weight": values}, path)
    rewritten(path, "byteorder", lambda _: b"big")
    rewritten(path, "data/0", lambda data: b"".join(struct.pack(">f", v) for v in struct.unpack("<3f", data)))
    assert torch.equal(read_tensors(path)["weight"], values)


def test_the_legacy_stream_cut_inside_a_storage_is_refused(tmp_path):
    path = tmp_path / "x.bin"
    torch.save({"weight": torch.ones(4)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # cut inside the last storage
    with pytest.raises(NotATensorFile, match="ends inside a storage"):
        read_tensors(path)
    path.write_bytes(data)
    assert torch.equal(read_tensors(path)["weight"], torch.ones(4))


def test_a_compressed_entry_or_one_past_the_files_end_is_refused(tmp_path):
    """torch.save stores its entries uncompressed; a deflated entry could inflate past any
    bound, and a declared size past the file's end would be allocated before its read failed."""
    path = tmp_path / "x.bin"
    torch.save({"weight": torch.ones(8)}, path)
    with zipfile.ZipFile(path) as archive:
        entries = {info.filename: archive.read(info) for info in archive.infolist()}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    with pytest.raises(NotATensorFile, match="compressed"):
        read_tensors(path)
    torch.save({"weight": torch.ones(8)}, path)
    data = bytearray(path.read_bytes())
    # the central directory's record of data/0: its sizes (compressed, then not) claim 2**31 bytes
    name = next(n for n in entries if n.endswith("data/0")).encode()
    record = data.rfind(b"PK\x01\x02", 0, data.rfind(name))
    data[record + 20 : record + 28] = struct.pack("<II", 2**31, 2**31)
    path.write_bytes(bytes(data))
    with pytest.raises(NotATensorFile):
        read_tensors(path)


def test_a_legacy_opcode_declaring_more_bytes_than_the_file_holds_allocates_nothing(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\x8e" + struct.pack("<Q", 2**40))  # BINBYTES8 of 2**40 bytes, then nothing
    with pytest.raises(NotATensorFile):
        read_tensors(path)
    path.write_bytes(b"\x8e" + struct.pack("<Q", 2**63 - 1))
    with pytest.raises(NotATensorFile):
        read_tensors(path)


def shared_references(depth: int) -> bytes:
    """A pickle of a few hundred bytes whose value, written out, has 2**depth leaves: each list
    holds the one before twice (BINGET of the memo)."""
    body = b"]q\x00"  # EMPTY_LIST, BINPUT 0
    for i in range(1, depth + 1):
        body += b"(h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"lq" + bytes([i])  # MARK, 2x BINGET, LIST, BINPUT
    return body


def test_a_pickle_of_shared_references_is_refused_at_once(tmp_path):
    """Nothing walks or prints a pickle's values whole: a value of 2**60 leaves in a few hundred
    bytes is refused without being expanded (in a call, as a storage id, as the state dict)."""
    import time

    bomb = shared_references(60)
    pickles = {
        "as the state dict": b"\x80\x02" + bomb + b".",
        "called": b"\x80\x02" + bomb + b"h\x3c\x85R.",  # the list calls itself: REDUCE
        "as a storage": b"\x80\x02" + bomb + b"Q.",  # BINPERSID
    }
    for what, pickled in pickles.items():
        path = tmp_path / "x.bin"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("x/data.pkl", pickled)
        started = time.monotonic()
        with pytest.raises(NotATensorFile) as refused:
            read_tensors(path)
        assert time.monotonic() - started < 5 and len(str(refused.value)) < 500, what
    legacy = tmp_path / "legacy.bin"
    header = b"".join(pickle.dumps(value, protocol=2) for value in
                      (0x1950A86A20F9469CFC6C, 1001, {"little_endian": True}))
    legacy.write_bytes(header + b"\x80\x02" + bomb + b".")  # the object: the bomb itself
    with pytest.raises(NotATensorFile):
        read_tensors(legacy)


def test_a_conjugate_view_is_refused_not_read_as_its_plain_values(tmp_path):
    path = tmp_path / "x.bin"
    torch.save({"weight": torch.randn(3, dtype=torch.complex64).conj()}, path)
    with pytest.raises(NotATensorFile, match="conjugate"):
        read_tensors(path)


def test_a_big_endian_complex_storage_swaps_each_part(tmp_path):
    path = tmp_path / "x.bin"
    values = torch.tensor([1.5 - 2j, 0.25 + 4j], dtype=torch.complex64)
    torch.save({"weight": values}, path)
    rewritten(path, "byteorder", lambda _: b"big")
    rewritten(path, "data/0", lambda data: b"".join(struct.pack(">f", v) for v in struct.unpack("<4f", data)))
    assert torch.equal(read_tensors(path)["weight"], values)


MAPPED_CHECK = """
import gc, sys, torch
from xlserve.models.convert.torch_file import read_tensors

def anonymous_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

before = anonymous_bytes()
tensors = read_tensors(sys.argv[1])
gc.collect()
total = sum(float(tensor.double().sum()) if tensor.numel() < 2**20 else float(tensor.sum()) for tensor in tensors.values())
print(anonymous_bytes() - before, total)
"""


def test_an_archives_storages_are_the_files_pages_not_a_copy_read_into_memory(tmp_path):
    """A checkpoint of many gigabytes is converted holding the model it builds, not the source
    besides: the tensors read are over the file's mapping, paged in as they are read (their pages
    are the file's, which the system may drop again), and they outlive the file's handle."""
    import subprocess
    import sys

    generator = torch.Generator().manual_seed(0)
    saved = {f"layer{i}.weight": torch.randn(1024, 4096, generator=generator) for i in range(4)}  # 64 MiB
    path = tmp_path / "pytorch_model.bin"
    torch.save(saved, path)
    expected = sum(float(tensor.sum()) for tensor in saved.values())
    result = subprocess.run([sys.executable, "-c", MAPPED_CHECK, str(path)], capture_output=True, text=True,
                            timeout=120, check=True)
    grown, total = result.stdout.split()
    assert int(grown) < 16 * 2**20, f"{int(grown) / 2**20:.1f} MiB of anonymous memory for a 64 MiB file"
    assert abs(float(total) - expected) <= 1e-3 * abs(expected) + 1e-2
    read = read_tensors(path)
    path.unlink()  # the mapping holds the file's pages, not its name
    for name, tensor in saved.items():
        assert torch.equal(read[name], tensor), name


def test_a_storage_the_file_does_not_align_is_copied_aligned(tmp_path):
    """A legacy stream puts each storage where the one before ended (after its 8-byte count), so
    a float storage can start at any byte: it is copied to an aligned buffer, values unchanged."""
    saved = {"bytes": torch.arange(3, dtype=torch.uint8), "floats": torch.randn(5), "longs": torch.arange(4)}
    path = tmp_path / "pytorch_model.bin"
    torch.save(saved, path, _use_new_zipfile_serialization=False)
    read = read_tensors(path)
    for name, tensor in saved.items():
        assert read[name].data_ptr() % tensor.element_size() == 0, name
        assert torch.equal(read[name], tensor), name
