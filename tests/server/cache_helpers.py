"""A toy model state and session data for the session-cache tests (no model runs).

Shared by tests/server/test_cache_sessions.py (memory and disk stores) and
tests/server/test_cache_redis.py (two replicas over one redis-server).
"""

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from xlserve.models.interface import State
from xlserve.server.cache.codec import SessionData

V = 8  # vocabulary of the toy model: the size of next_log_probs


@dataclass
class ToyState(State):
    memory: Tensor  # (B, n) float32
    layers: list[Tensor]  # (B, 3) int64 each


def check_toy(state):
    if not isinstance(state, ToyState) or len(state.layers) != 2:
        raise ValueError("not a toy state")


def check_toy_session(state, tokens, next_log_probs):
    check_toy(state)


def init_toy(batch_size: int) -> ToyState:
    """A fresh toy state: its dtypes are those the toy model computes in (float32 memory)."""
    return ToyState(memory=torch.zeros(batch_size, 0), layers=[torch.zeros(batch_size, 3, dtype=torch.long)] * 2)


MODEL = SimpleNamespace(device=torch.device("cpu"), state_class=ToyState, architecture="toy", check_state=check_toy,
                        check_session=check_toy_session, init_state=init_toy)


def data(n: int, seed: int, tokens: int = 5) -> SessionData:
    """Session data with a memory of n floats, reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    state = ToyState(memory=torch.randn(1, n, generator=g), layers=[torch.randint(0, 9, (1, 3), generator=g) for _ in range(2)])
    return SessionData(state=state, tokens=tokens, next_log_probs=torch.randn(V, generator=g).log_softmax(-1))


def size(n: int) -> int:
    """The state bytes of `data(n, ...)`."""
    return n * 4 + 2 * 3 * 8 + V * 4  # memory + two int64 layers + next_log_probs


def same(a: SessionData, b: SessionData) -> bool:
    return (a.tokens == b.tokens and torch.equal(a.next_log_probs, b.next_log_probs)
            and all(torch.equal(x, y) for x, y in zip(a.state.to_tensors().values(), b.state.to_tensors().values())))
