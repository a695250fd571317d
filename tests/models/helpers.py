"""What several model tests share: random byte inputs, feeding a model chunk by chunk, and the
state invariants every architecture keeps (a safetensors round trip, bounded size)."""

import pytest
import torch
from safetensors.torch import load_file, save_file


def tokens(batch, length, seed=1):
    """Random bytes (batch, length), the same for the same seed."""
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def run_in_chunks(model, ids, chunk, state=None):
    """Feed `ids` (B, T) in calls of `chunk` tokens, from `state` (default: a fresh one); returns
    the log-probs of every position (B, T, V) and the state after the last call."""
    state = state if state is not None else model.init_state(ids.shape[0])
    outputs = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            log_probs, state = model(ids[:, start : start + chunk], state)
            outputs.append(log_probs)
    return torch.cat(outputs, dim=1), state


def assert_same_as_one_pass(model, ids, chunk, atol=1e-5):
    """Feeding `ids` in calls of `chunk` tokens gives the log-probs and the state (every tensor,
    `position` exactly) of one call over all of them, within `atol`."""
    whole, whole_state = run_in_chunks(model, ids, ids.shape[1])
    served, state = run_in_chunks(model, ids, chunk)
    assert (served - whole).abs().max().item() < atol
    assert torch.equal(state.position, whole_state.position)
    for (name, a), (_, b) in zip(state._named_tensors(), whole_state._named_tensors()):
        assert (a - b).abs().max().item() < atol, name


def state_bytes_after_4_kb_and_64_kb(model, seed):
    """Feed 64 KB of random bytes to `model` in 4 KB calls; returns the state's `nbytes()` after
    4 KB and after 64 KB, and the final state (already checked for 65,536 positions)."""
    text = tokens(1, 65536, seed)
    state = model.init_state(1)
    sizes = {}
    with torch.no_grad():
        for start in range(0, 65536, 4096):
            _, state = model(text[:, start : start + 4096], state)
            sizes[start + 4096] = state.nbytes()
    assert int(state.position[0]) == 65536
    model.check_state(state, 65536)
    return sizes[4096], sizes[65536], state


def assert_state_round_trips(model, state, history, continuation, tmp_path, required="position"):
    """`state` (after `history` tokens) written to safetensors and read back is the same state:
    it passes the model's checks, every tensor is equal in name, dtype and value, and feeding
    `continuation` (1, T) from either gives identical log-probs and identical states after. A file
    without the `required` tensor is refused by name."""
    kind = type(state)
    save_file(state.to_tensors(), str(tmp_path / "state.safetensors"))
    restored = kind.from_tensors(load_file(str(tmp_path / "state.safetensors")))
    model.check_state(restored, history)
    for (name, a), (other, b) in zip(state._named_tensors(), restored._named_tensors()):
        assert name == other and a.dtype == b.dtype and torch.equal(a, b), name
    a, after_a = run_in_chunks(model, continuation, continuation.shape[1], state)
    b, after_b = run_in_chunks(model, continuation, continuation.shape[1], restored)
    assert torch.equal(a, b)
    for (name, x), (_, y) in zip(after_a._named_tensors(), after_b._named_tensors()):
        assert torch.equal(x, y), name
    with pytest.raises(ValueError, match=f"'{required}' is missing"):
        kind.from_tensors({k: v for k, v in state.to_tensors().items() if k != required})


def assert_rows_batch_like_single_rows(model, histories, step, decode, atol=1e-5):
    """Rows of different `histories` (each (1, T_i)) batched together are each what they are alone:
    feeding `step` (B, S) to the batch, then decoding `decode` (B, N) one token at a time, gives
    every row's log-probs and state of feeding it alone, within `atol`; every row's state passes
    the model's checks for its token count after each. Returns, for an architecture's own checks,
    the batch's state after `step`, its rows split apart, and the batch's state after `decode`."""
    with torch.no_grad():
        states = [model(h, model.init_state(1))[1] for h in histories]
        kind = type(states[0])
        singles = [model(step[i : i + 1], s) for i, s in enumerate(states)]
        batch = kind.concat(states)
        model.check_state(batch)
        batched, batch_state = model(step, batch)
        for i, (single, _) in enumerate(singles):
            assert (batched[i] - single[0]).abs().max().item() < atol
        parts = batch_state.split()
        for part, (_, single_state), history in zip(parts, singles, histories):
            for (name, a), (_, b) in zip(part._named_tensors(), single_state._named_tensors()):
                assert (a - b).abs().max().item() < atol, name
            model.check_state(part, history.shape[1] + step.shape[1])
    decoded, decoded_state = run_in_chunks(model, decode, 1, batch_state)
    for (_, single_state), history, row, decoded_row, part in zip(
            singles, histories, decode, decoded, decoded_state.split()):
        alone, alone_state = run_in_chunks(model, row[None], 1, single_state)
        assert (decoded_row - alone[0]).abs().max().item() < atol
        for (name, a), (_, b) in zip(part._named_tensors(), alone_state._named_tensors()):
            assert (a - b).abs().max().item() < atol, name
        model.check_state(part, history.shape[1] + step.shape[1] + decode.shape[1])
    return batch_state, parts, decoded_state


@pytest.fixture
def one_thread():
    """Evaluations on one intra-op thread, as the tests run beside other work on 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def allocator_refusal(nbytes: int = 2**30) -> RuntimeError:
    """The error torch's CPU allocator raises when it cannot allocate `nbytes` (its own text, from
    a real refusal of a size no machine holds, with the size replaced): what a model on the CPU
    meets when host RAM runs out under a container's limit or a strict overcommit policy."""
    import re

    import torch

    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError as error:
        return RuntimeError(re.sub(r"allocate \d+ bytes", f"allocate {nbytes} bytes", str(error)))
    raise AssertionError("an allocation of 1 PiB succeeded")
