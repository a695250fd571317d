"""Every way an imported state (POST /v1/sessions/import, PUT /v1/sessions/{id}/state) can be
wrong is refused at the door as InvalidInput (400 invalid_state, param "body"), never another
exception (a 500): one case per class of exception the decoding and checking code raises
(server/cache/codec.py's CorruptState and ValueError, State.from_tensors, LanguageModel's
check_state, each architecture's check_consistent and _check_tokens, check_next_log_probs, and
torch's own IndexError or RuntimeError on a malformed tensor), for every architecture.

The cases build blobs as a client could: safetensors bytes with any header, tensors and
metadata, no checksum (an import may come without one)."""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import save as save_safetensors

from tests.server.test_import_checks import ARCHITECTURES, state_after_document, tiny_model
from xlserve.server.cache.codec import encode, metadata_of
from xlserve.server.engine.errors import InvalidInput
from xlserve.server.engine.process import decode_import, validated_import


@functools.cache
def exported(architecture: str) -> tuple:
    """(model, metadata without checksum, tensors) of a state the model made, as an exported file holds them."""
    model = tiny_model(architecture)
    data = state_after_document(model)
    blob = encode(data, {"model": "m", "architecture": model.architecture})
    metadata = {name: value for name, value in metadata_of(blob).items() if name != "checksum"}
    tensors = {"state." + name: tensor for name, tensor in data.state.to_tensors().items()}
    tensors["next_log_probs"] = data.next_log_probs.contiguous()
    return model, metadata, tensors


def safetensors_with_header(header: object) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded


def first_state_tensor(tensors: dict) -> str:
    return next(name for name in tensors if name.startswith("state."))


def first_floating_tensor(tensors: dict) -> str | None:
    return next((name for name, t in tensors.items()
                 if name.startswith("state.") and t.is_floating_point() and t.numel()), None)


def changed(tensors: dict, name: str, value: torch.Tensor) -> dict:
    return {**tensors, name: value.contiguous()}


def other_architecture(architecture: str) -> str:
    return "reformer" if architecture != "reformer" else "transformer-xl"


def state_of_another_architecture(architecture: str, metadata: dict, tensors: dict) -> bytes:
    """Another architecture's real state, its metadata rewritten to claim this one."""
    _, other_metadata, other_tensors = exported(other_architecture(architecture))
    return save_safetensors(other_tensors, metadata={**other_metadata, "model": "m",
                                                      "architecture": metadata["architecture"]})


def wrong_dtype(tensors: dict) -> dict:
    name = first_state_tensor(tensors)
    tensor = tensors[name]
    return changed(tensors, name, tensor.to(torch.int32 if tensor.is_floating_point() else torch.float32))


def wider_fixed_dimension(tensors: dict) -> dict:
    """The last dimension doubled: a model of another width (d_head, n_head, ...) made it."""
    name = first_state_tensor(tensors)
    return changed(tensors, name, torch.cat([tensors[name], tensors[name]], dim=-1))


def batch_of_two(tensors: dict) -> dict:
    return {name: torch.cat([t, t]) if name.startswith("state.") else t for name, t in tensors.items()}


def every_state_tensor_empty(tensors: dict) -> dict:
    return {name: t.new_zeros((0,) * t.dim()) if name.startswith("state.") else t for name, t in tensors.items()}


def scalar_in_place_of_a_tensor(tensors: dict) -> dict:
    name = first_state_tensor(tensors)
    return changed(tensors, name, tensors[name].reshape(-1)[:1].reshape(()))


def nan_in_a_state_tensor(tensors: dict) -> dict:
    name = first_floating_tensor(tensors)
    if name is None:  # the vanilla transformer's window of token ids: ids past the vocabulary instead
        name = "state.tokens"
        return changed(tensors, name, torch.full_like(tensors[name], 10**6))
    return changed(tensors, name, torch.full_like(tensors[name], float("nan")))


# name -> (what it exercises, blob from (architecture, metadata, tensors))
CASES: dict[str, Callable[[str, dict, dict], bytes]] = {
    # server/cache/codec.py: CorruptState
    "not safetensors": lambda a, m, t: b"\x00" * 64,
    "header past its length": lambda a, m, t: struct.pack("<Q", 10**9) + b"{}",
    "header not JSON": lambda a, m, t: struct.pack("<Q", 4) + b"{{{{",
    "header not an object": lambda a, m, t: safetensors_with_header([1, 2]),
    "header nested past the parser's depth": lambda a, m, t: struct.pack("<Q", 100_000) + b"[" * 100_000,
    "header with an integer past the parser's digits": lambda a, m, t: struct.pack("<Q", 5_006) + b'{"a":'
                                                                       + b"1" * 5_000 + b"}",
    "metadata a string": lambda a, m, t: safetensors_with_header({"__metadata__": "xlserve"}),
    "metadata a list": lambda a, m, t: safetensors_with_header({"__metadata__": ["format"]}),
    "not an xlserve blob": lambda a, m, t: save_safetensors(t, metadata={**m, "format": "other"}),
    "payload cut short": lambda a, m, t: save_safetensors(t, metadata=m)[:-16],
    "checksum mismatch": lambda a, m, t: save_safetensors(t, metadata={**m, "checksum": "0" * 64}),
    "a tensor outside the state": lambda a, m, t: save_safetensors({**t, "weights": torch.zeros(2)}, metadata=m),
    # codec.session_data: ValueError
    "another architecture's state class": lambda a, m, t: save_safetensors(t, metadata={**m, "state_class": "Other"}),
    "tokens not an integer": lambda a, m, t: save_safetensors(t, metadata={**m, "tokens": "1e3"}),
    "tokens negative": lambda a, m, t: save_safetensors(t, metadata={**m, "tokens": "-1"}),
    "tokens past any history": lambda a, m, t: save_safetensors(t, metadata={**m, "tokens": "1" + "0" * 400}),
    # the engine process's own checks of the metadata
    "another model": lambda a, m, t: save_safetensors(t, metadata={**m, "model": "other"}),
    "another architecture named": lambda a, m, t: save_safetensors(t, metadata={**m, "architecture": "other"}),
    # State.from_tensors: ValueError
    "a state tensor missing": lambda a, m, t: save_safetensors(
        {name: v for name, v in t.items() if name != first_state_tensor(t)}, metadata=m),
    "an unexpected state tensor": lambda a, m, t: save_safetensors({**t, "state.extra": torch.zeros(1)}, metadata=m),
    "another architecture's tensors": state_of_another_architecture,
    # LanguageModel.check_state and the architectures' check_consistent: ValueError
    "a dtype other than the model's": lambda a, m, t: save_safetensors(wrong_dtype(t), metadata=m),
    "shapes of another config": lambda a, m, t: save_safetensors(wider_fixed_dimension(t), metadata=m),
    "a batch of two": lambda a, m, t: save_safetensors(batch_of_two(t), metadata=m),
    "NaN, or ids past the vocabulary": lambda a, m, t: save_safetensors(nan_in_a_state_tensor(t), metadata=m),
    # torch on malformed tensors (IndexError, RuntimeError), or the checks first
    "every state tensor empty": lambda a, m, t: save_safetensors(every_state_tensor_empty(t), metadata=m),
    "a scalar for a tensor": lambda a, m, t: save_safetensors(scalar_in_place_of_a_tensor(t), metadata=m),
    # LanguageModel.check_next_log_probs: ValueError
    "no next-token row": lambda a, m, t: save_safetensors(
        {name: v for name, v in t.items() if name != "next_log_probs"}, metadata=m),
    "a next-token row of another vocabulary": lambda a, m, t: save_safetensors(
        {**t, "next_log_probs": torch.zeros(7)}, metadata=m),
    "a next-token row that is no distribution": lambda a, m, t: save_safetensors(
        {**t, "next_log_probs": torch.zeros_like(t["next_log_probs"])}, metadata=m),
}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("case", CASES)
def test_a_malformed_import_is_invalid_state_never_another_error(architecture, case):
    model, metadata, tensors = exported(architecture)
    blob = CASES[case](architecture, metadata, tensors)
    with pytest.raises(InvalidInput) as refused:
        validated_import("m", model, *decode_import(blob))
    assert refused.value.code == "invalid_state" and refused.value.param == "body", refused.value


# the architectures' _check_tokens: a token count the state's lengths do not fit (the Reformer's
# max_context included). A state whose window or memory has filled (Transformer-XL, XLNet, the
# vanilla window) looks the same after any longer history: a larger count is no malformation
# there, and the state is imported (tests/e2e/test_user_input_refusals.py goes on from one).
TOKEN_COUNTS = {"one token more than the state holds": lambda tokens: tokens + 1,
                "more tokens than any context": lambda tokens: 2**62}
COUNT_BLIND = {"transformer-xl", "xlnet", "vanilla"}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("count", TOKEN_COUNTS)
def test_a_token_count_the_state_does_not_fit_is_invalid_state(architecture, count):
    model, metadata, tensors = exported(architecture)
    claimed = TOKEN_COUNTS[count](int(metadata["tokens"]))
    blob = save_safetensors(tensors, metadata={**metadata, "tokens": str(claimed)})
    if architecture in COUNT_BLIND:
        assert validated_import("m", model, *decode_import(blob)).tokens == claimed
        return
    with pytest.raises(InvalidInput) as refused:
        validated_import("m", model, *decode_import(blob))
    assert refused.value.code == "invalid_state" and refused.value.param == "body", refused.value


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_unchanged_export_is_imported(architecture):
    """The cases above change one thing each: the blob they start from is a good one."""
    model, metadata, tensors = exported(architecture)
    assert validated_import("m", model, *decode_import(save_safetensors(tensors, metadata=metadata))).tokens > 0


def test_an_import_whose_header_or_metadata_is_huge_is_refused_before_it_is_parsed_or_quoted():
    """An untrusted safetensors header took about 24 bytes of memory a byte to parse (64 MiB
    allowed: 1.5 GB a request), and metadata values were quoted whole in error messages that go
    to the API process (a 30 M-character model name: a 180 MB frame). An imported state's header
    is bounded at 1 MiB before it is parsed, each metadata value at 4,096 characters."""
    from xlserve.server.engine.process import MAX_IMPORT_HEADER_BYTES, MAX_IMPORT_METADATA_VALUE

    header = b'{"x":[' + b"{}," * (MAX_IMPORT_HEADER_BYTES // 3) + b"{}]}"
    with pytest.raises(InvalidInput, match="header is") as refused:
        decode_import(struct.pack("<Q", len(header)) + header)
    assert refused.value.code == "invalid_state" and len(refused.value.message) < 300
    _, metadata, tensors = exported("transformer-xl")
    blob = save_safetensors(tensors, {**metadata, "model": "é" * (MAX_IMPORT_METADATA_VALUE + 1)})
    with pytest.raises(InvalidInput, match="'model' is 4,097 characters") as refused:
        decode_import(blob)
    assert len(refused.value.message) < 300


def test_a_stored_delta_block_whose_description_is_no_mapping_is_corrupt_not_a_500():
    """A delta block's `delta` metadata is JSON the store holds: a list there raised AttributeError
    (a 500) where any other damage is CorruptState (the session's own 503)."""
    from xlserve.server.cache.codec import CorruptState, checksum, decode_delta

    meta = {"format": "xlserve-session", "format_version": "1", "delta": "[1, 2]"}
    meta["checksum"] = checksum(meta, {})
    with pytest.raises(CorruptState, match="description is unreadable"):
        decode_delta(save_safetensors({}, meta))


def test_an_import_is_checked_as_the_cache_will_keep_it():
    """With a 16-bit XLSERVE_STATE_DTYPE the cache keeps an import rounded to it: the state the
    checks and the probe see is that one (each value as float16 gives it back), not the float32
    values the client sent, which a value that rounds to 0 or saturates could pass where the
    stored state would fail every request after."""
    from xlserve.models.interface import same_bits
    from xlserve.server.engine.process import validated_import

    model, metadata, tensors = exported("rwkv")
    meta, state, next_log_probs = decode_import(save_safetensors(tensors, metadata))
    sent = validated_import("m", model, meta, state, next_log_probs)
    checked = validated_import("m", model, meta, state, next_log_probs, torch.float16)
    stored = checked.cast_state(torch.float16).cast_state(torch.float32)
    exact = lambda a, b: all(same_bits(x, y) for x, y in zip(a.state.to_tensors().values(), b.state.to_tensors().values()))
    assert exact(checked, stored) and not exact(sent, checked)


def test_a_vanilla_window_padded_on_the_left_is_refused():
    """A batch pads short windows on the left, and `split` takes the padding off: a session's
    window holds none. One imported with padding passed (the valid bytes matched the token
    count), was read as history when it ran alone and not in a batch, and after one commit
    failed every restore (503) until replaced."""
    model, metadata, tensors = exported("vanilla")
    L = model.config.context_len
    padded = {name: tensor for name, tensor in tensors.items() if not name.startswith(("state.keys", "state.values"))}
    padded["state.tokens"] = torch.zeros(1, L - 1, dtype=torch.long)
    padded["state.valid"] = torch.tensor([[False] * (L - 2) + [True]])
    padded["state.cached"] = torch.tensor([False])
    for name in tensors:
        if name.startswith(("state.keys", "state.values")):
            padded[name] = torch.zeros(1, 0, *tensors[name].shape[2:])
    with pytest.raises(InvalidInput, match="no padding"):
        validated_import("m", model, *decode_import(save_safetensors(padded, {**metadata, "tokens": "1"})))


def test_a_state_that_names_no_model_imported_without_one_is_invalid_state_not_model_not_found():
    """An import without ?model whose state names no model was a 404 model_not_found about a model
    named '', which the client never named: it is the body's fault, a 400 saying to add ?model."""
    from xlserve.server.engine import process
    from xlserve.server.engine.wire import ImportSession

    _, metadata, tensors = exported("transformer-xl")
    blob = save_safetensors(tensors, metadata={name: value for name, value in metadata.items() if name != "model"})
    handler = process.EngineProcess.__new__(process.EngineProcess)  # the handler's own state only
    handler.models = {}
    with pytest.raises(InvalidInput) as refused:
        handler.import_session(ImportSession(None, None, blob, None))
    assert (refused.value.code, refused.value.param) == ("invalid_state", "body") and "?model=" in refused.value.message


def test_a_keyed_import_retried_with_its_own_model_named_is_the_same_import():
    """The fingerprint took ?model as sent: a retry adding ?model= naming the state's own model was
    422 idempotency_key_reused. It takes the model the import goes to; another model is another
    import, and without a key the body is not hashed at all."""
    import asyncio
    from types import SimpleNamespace

    from xlserve.server.api.serving.sessions import import_new_session, state_model_name

    _, metadata, tensors = exported("transformer-xl")
    blob = save_safetensors(tensors, metadata=metadata)
    assert state_model_name(blob) == metadata["model"] and state_model_name(b"not a state") is None
    deep = struct.pack("<Q", 200_000) + b"[" * 200_000  # nested past the parser: no name, not a 500
    assert state_model_name(deep) is None and state_model_name(struct.pack("<Q", 2 << 20) + b" " * (2 << 20)) is None
    sent = []

    class Sent(Exception):
        pass

    async def import_session(model, owner, state, key):
        sent.append(key)
        raise Sent

    app = SimpleNamespace(engine=SimpleNamespace(import_session=import_session))
    for model, key in ((None, "k"), (metadata["model"], "k"), ("other", "k"), (None, None)):
        with pytest.raises(Sent):
            asyncio.run(import_new_session(app, None, model, blob, key))
    assert sent[0]["fingerprint"] == sent[1]["fingerprint"] != sent[2]["fingerprint"] and sent[3] is None
