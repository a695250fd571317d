"""What several model tests share: random byte inputs and feeding a model chunk by chunk."""

import torch


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
