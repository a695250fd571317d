"""Session state kept in 16 bits (XLSERVE_STATE_DTYPE): the codec records and keeps the dtype,
only floating tensors are converted, imports in another floating dtype are converted and others
refused by name, and for every architecture a session stored in bfloat16 continues within a
stated tolerance of one stored in float32, at half the bytes of its floating tensors."""

import pytest
import torch

from xlserve.models.registry import ARCHITECTURES
from xlserve.server.cache.codec import STATE_DTYPES, SessionData, conform_import, decode, encode, session_data
from xlserve.server.cache.session_cache import SessionCache
from xlserve.server.engine.errors import InvalidInput
from xlserve.server.engine.process import compute_dtypes, validated_import
from tests.server.test_cache_architectures import feed, tiny_model

# the largest difference in a continuation's log-probabilities (nats) between a session stored
# in bfloat16 and the same session stored in float32, on the tiny random checkpoints: bfloat16
# keeps 8 bits of mantissa (a relative rounding of at most 2^-9 per value); the largest seen is
# 7e-4 (the Conformer), this bound leaves room for other seeds and torch versions
LOG_PROB_TOLERANCE = 1e-2

HISTORY = list(b"import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n" * 3)  # > one segment
CONTINUATION = list(b"    print('done')\n")


def session_after_history(model) -> SessionData:
    return feed(model, SessionData(model.init_state(1), 0, None), HISTORY)[1]


def floating_bytes(data: SessionData) -> int:
    """Bytes of the floating tensors a 16-bit store halves (those the state keeps in float32 aside)."""
    return sum(t.numel() * t.element_size() for n, t in data.state._named_tensors()
               if t.is_floating_point() and n.split(".")[0] not in data.state.kept_in_float32)


@pytest.mark.parametrize("dtype_name", sorted(STATE_DTYPES))
def test_codec_round_trip_keeps_the_dtype_and_records_it(dtype_name):
    model = tiny_model("reformer")  # float, int32, int64 and bool state tensors
    data = session_after_history(model).cast_state(STATE_DTYPES[dtype_name])
    meta, tensors, next_log_probs = decode(encode(data, {"model": "m"}))
    assert meta["state_dtype"] == dtype_name
    again = session_data(model.state_class, meta, tensors, next_log_probs)
    for (name, before), (_, after) in zip(data.state.to_tensors().items(), again.state.to_tensors().items()):
        assert after.dtype == before.dtype and torch.equal(after, before), name
    assert next_log_probs.dtype == torch.float32 and torch.equal(next_log_probs, data.next_log_probs)
    assert int(meta["nbytes"]) == data.nbytes()


def test_only_floating_tensors_are_converted_and_a_cast_to_the_same_dtype_copies_nothing():
    model = tiny_model("reformer")
    data = session_after_history(model)
    stored = data.cast_state(torch.bfloat16)
    for (name, before), (_, after) in zip(data.state._named_tensors(), stored.state._named_tensors()):
        if before.is_floating_point():
            assert after.dtype == torch.bfloat16, name
            assert torch.allclose(after.float(), before, rtol=2 ** -8, atol=0), name
        else:  # masks, buckets and positions as they were
            assert after is before, name
    assert stored.next_log_probs is data.next_log_probs  # kept float32
    assert floating_bytes(stored) * 2 == floating_bytes(data)
    same = data.cast_state(torch.float32)
    assert all(a is b for (_, a), (_, b) in zip(data.state._named_tensors(), same.state._named_tensors()))
    # back to the model's own dtypes: every tensor as the fresh state has it
    restored = stored.cast_state(compute_dtypes(model))
    fresh = dict(model.init_state(1)._named_tensors())
    assert all(t.dtype == fresh[name].dtype for name, t in restored.state._named_tensors())


def test_an_import_is_converted_or_refused_naming_the_dtype():
    model = tiny_model("transformer-xl")
    data = session_after_history(model)
    expected = compute_dtypes(model)
    wide = {name: t.double() if t.is_floating_point() else t for name, t in data.state.to_tensors().items()}
    converted = conform_import(wide, expected, "float64")
    assert all(t.dtype == data.state.to_tensors()[name].dtype for name, t in converted.items())

    name = next(iter(expected))
    odd = dict(data.state.to_tensors(), **{name: data.state.to_tensors()[name].to(torch.float8_e4m3fn)})
    with pytest.raises(ValueError, match=f"'{name}' is float8_e4m3fn"):
        conform_import(odd, expected, None)
    with pytest.raises(ValueError, match="'state_dtype' names int4"):
        conform_import(data.state.to_tensors(), expected, "int4")


def test_validated_import_takes_a_16_bit_export_and_refuses_an_integer_tensor_by_name():
    model = tiny_model("transformer-xl")
    data = session_after_history(model)
    meta, tensors, next_log_probs = decode(encode(data.cast_state(torch.bfloat16), {"model": "m"}))
    assert meta["state_dtype"] == "bfloat16"
    imported = validated_import("m", model, meta, tensors, next_log_probs)
    assert all(t.dtype == torch.float32 for t in imported.state.to_tensors().values() if t.is_floating_point())
    name = next(iter(compute_dtypes(model)))
    tensors[name] = tensors[name].to(torch.int64)
    with pytest.raises(InvalidInput, match=f"'{name}' is torch.int64") as refused:
        validated_import("m", model, meta, tensors, next_log_probs)
    assert refused.value.code == "invalid_state"


def host_allocation_failure():
    """What torch's CPU allocator raises when host RAM runs out (a plain RuntimeError)."""
    from tests.models.helpers import allocator_refusal

    raise allocator_refusal()


@pytest.mark.parametrize("fails", ["device", "host"])
def test_the_device_running_out_of_memory_while_probing_an_import_is_a_retryable_503(monkeypatch, fails):
    """torch's OutOfMemoryError is a RuntimeError, which a malformed state raises too: it must not
    be answered as the client's state not fitting (a 400 the client would never retry). On the
    CPU the allocator's failure is a plain RuntimeError, told apart by its text."""
    from xlserve.server.api.errors import as_api_error
    from xlserve.server.engine import process
    from xlserve.server.engine.errors import DeviceOutOfMemory
    from xlserve.server.engine.wire import error_from_wire, error_to_wire

    model = tiny_model("transformer-xl")
    meta, tensors, next_log_probs = decode(encode(session_after_history(model), {"model": "m"}))

    def out_of_memory(*args):
        if fails == "host":
            host_allocation_failure()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(process, "probe_forward", out_of_memory)
    with pytest.raises(DeviceOutOfMemory) as refused:
        validated_import("m", model, meta, tensors, next_log_probs)
    answered = as_api_error(error_from_wire(error_to_wire(refused.value)))  # as the client gets it
    assert (answered.status, answered.code, answered.headers) == (503, "device_out_of_memory", {"Retry-After": "1"})


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_a_session_stored_in_bfloat16_continues_like_float32_at_half_the_bytes(architecture, tmp_path):
    model = tiny_model(architecture)
    data = session_after_history(model)
    expected, _ = feed(model, data, CONTINUATION)
    sizes, results = {}, {}
    for name in ("float32", "bfloat16"):
        cache = SessionCache(tmp_path / name, None, None, None, state_dtype=STATE_DTYPES[name])
        cache.open({"m": model})
        session = cache.create("m", None, data.clone()).id
        lease = cache.acquire(session, None)  # the copy kept on the device tier
        held = lease.data.state
        kept = [t.dtype for n, t in held._named_tensors() if t.is_floating_point() and n.split(".")[0] not in held.kept_in_float32]
        assert set(kept) <= {STATE_DTYPES[name]}
        assert {t.dtype for n, t in held._named_tensors() if n.split(".")[0] in held.kept_in_float32} <= {torch.float32}
        from_device, _ = feed(model, lease.data.cast_state(compute_dtypes(model)), CONTINUATION)
        cache.release(lease)
        cache.move(session, "disk")
        lease = cache.acquire(session, None)  # read back from its safetensors file
        from_disk, _ = feed(model, lease.data.cast_state(compute_dtypes(model)), CONTINUATION)
        cache.release(lease)
        assert torch.equal(from_device, from_disk)  # the disk holds exactly what the device held
        sizes[name], results[name] = cache.info(session, None).state_bytes, from_disk
        cache.close()
    assert torch.equal(results["float32"], expected)
    assert (results["bfloat16"] - expected).abs().max().item() <= LOG_PROB_TOLERANCE
    floating = floating_bytes(data)  # the vanilla transformer keeps token ids only: nothing to halve
    assert sizes["float32"] == data.nbytes()
    assert sizes["bfloat16"] == data.nbytes() - floating // 2
    # and what /v1/models reports for a full session agrees with what the cache counts
    if model.full_state_bytes() == data.state.nbytes():  # (a state of fixed shape: full already)
        assert model.full_state_bytes(torch.bfloat16) == sizes["bfloat16"] - data.next_log_probs.numel() * 4


def test_float16_saturates_instead_of_overflowing():
    model = tiny_model("performer")
    data = session_after_history(model).clone()  # a clone made outside inference mode may be changed
    # a tensor the float16 store halves (the running sums themselves stay float32 there)
    name, tensor = next((n, t) for n, t in data.state._named_tensors()
                        if t.is_floating_point() and data.state.stored_dtype(n, torch.float16) == torch.float16)
    tensor.view(-1)[0] = 1e6  # past float16's 65,504, as a long session's values can get
    tensor.view(-1)[1] = -1e6
    stored = data.cast_state(torch.float16)
    kept = dict(stored.state._named_tensors())[name]
    assert bool(torch.isfinite(kept).all())
    assert kept.view(-1)[0].item() == torch.finfo(torch.float16).max == -kept.view(-1)[1].item()
    # bfloat16 has float32's range: no saturation needed, the value kept to its precision
    wide = dict(data.cast_state(torch.bfloat16).state._named_tensors())[name].view(-1)[0].item()
    assert wide == pytest.approx(1e6, rel=2 ** -8)


def test_rwkv_keeps_its_exponent_in_float32_when_its_state_is_stored_in_16_bits():
    """The exponent scales the whole history (num · e^max): in bfloat16 an exponent of 20.03
    would round to 20.0, re-weighting every past token by 3%; it is stored as it is."""
    model = tiny_model("rwkv")
    data = session_after_history(model).clone()
    exponent = data.state.exponent[0]
    exponent.fill_(20.03)
    for dtype in (torch.bfloat16, torch.float16):
        stored = data.cast_state(dtype)
        assert stored.state.exponent[0].dtype == torch.float32 and torch.equal(stored.state.exponent[0], exponent)
        assert stored.state.numerator[0].dtype == dtype  # the rest is halved
        assert model.full_state_bytes(dtype) == stored.state.nbytes()



def test_the_performer_keeps_its_running_sums_in_float32_in_a_float16_store():
    """Most entries of its key sums lie far below float16's smallest normal number: 57-77% of
    them rounded to 0 at every commit, taking their values' sums with them (held-out bits per
    byte 1.91 -> 2.29-2.55 on performer-stdlib). In a float16 store they stay float32, and a
    session continues as in float32; bfloat16, float32's range, still halves them."""
    model = tiny_model("performer")
    data = session_after_history(model).clone()
    tiny = data.state.key_sums[0]
    tiny.view(-1)[0] = 1e-6  # under float16's smallest normal (6.1e-5): rounded away there
    stored = data.cast_state(torch.float16)
    assert stored.state.key_sums[0].dtype == stored.state.value_sums[0].dtype == torch.float32
    assert stored.state.key_sums[0].view(-1)[0].item() == pytest.approx(1e-6)
    assert stored.state.recent_inputs[0].dtype == torch.float16  # the rest is halved
    assert model.full_state_bytes(torch.float16) == stored.state.nbytes()
    halved = data.cast_state(torch.bfloat16)
    assert halved.state.key_sums[0].dtype == torch.bfloat16 and model.full_state_bytes(torch.bfloat16) == \
        halved.state.nbytes()
