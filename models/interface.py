"""The contract every architecture in xlserve implements.

A model is a pure function of its weights: `forward(tokens, state) -> (log_probs, new_state)`.
Whatever a model must remember between calls (Transformer-XL's memory, a window of keys and
values, a linear-attention summary) lives in a `State` value that the caller owns. The server's
session cache stores, moves, saves and batches these values without knowing what is inside them,
through the small interface below.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn


@dataclass
class ArchConfig:
    """Hyperparameters of one architecture; serialised as the "config" object of config.json."""

    vocab_size: int = 256  # byte-level by default: every UTF-8 text is a sequence of bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ArchConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} has no fields {unknown}")
        return cls(**values)


@dataclass
class State:
    """Per-session model state: a dataclass whose fields are tensors or lists of tensors.

    Every tensor has the batch on dimension 0, so a state can be split into per-session states
    and concatenated back into a batch. Subclasses whose tensors vary in length between sessions
    (a memory that is not full yet) override `concat` to pad.
    """

    def _named_tensors(self) -> list[tuple[str, Tensor]]:
        named = []
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Tensor):
                named.append((field.name, value))
            else:
                named.extend((f"{field.name}.{i}", t) for i, t in enumerate(value))
        return named

    def _map(self, fn) -> "State":
        changes = {}
        for field in fields(self):
            value = getattr(self, field.name)
            changes[field.name] = fn(value) if isinstance(value, Tensor) else [fn(t) for t in value]
        return dataclasses.replace(self, **changes)

    @property
    def batch_size(self) -> int:
        return self._named_tensors()[0][1].shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self._named_tensors())

    def to(self, device: torch.device | str) -> "State":
        return self._map(lambda t: t.to(device))

    def clone(self) -> "State":
        return self._map(lambda t: t.clone())

    def to_tensors(self) -> dict[str, Tensor]:
        """Flat name -> tensor dict, ready for safetensors (contiguous, on the CPU)."""
        return {name: t.detach().contiguous().cpu() for name, t in self._named_tensors()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "State":
        """Inverse of `to_tensors`. Raises ValueError naming what is missing or unexpected."""
        values: dict[str, Any] = {}
        used = set()
        for field in fields(cls):
            if field.name in tensors:
                values[field.name] = tensors[field.name]
                used.add(field.name)
                continue
            items = []
            while f"{field.name}.{len(items)}" in tensors:
                name = f"{field.name}.{len(items)}"
                items.append(tensors[name])
                used.add(name)
            if not items:
                raise ValueError(f"state tensor '{field.name}' is missing")
            values[field.name] = items
        unexpected = sorted(set(tensors) - used)
        if unexpected:
            raise ValueError(f"unexpected state tensors {unexpected}")
        return cls(**values)

    def split(self) -> list["State"]:
        """One batch-1 state per batch row."""
        return [self._map(lambda t, i=i: t[i : i + 1]) for i in range(self.batch_size)]

    def take(self, rows: list[int]) -> "State":
        """The batch rows at `rows`, in that order, as a new batch: what a batch keeps when some
        of its rows leave. A class may do it in fewer copies than splitting and concatenating."""
        parts = self.split()
        return type(self).concat([parts[i] for i in rows])

    def put_row(self, index: int, row: "State") -> bool:
        """Overwrite batch row `index` with the batch-1 state `row` in place and return True, or
        return False and change nothing where the class cannot (the default) or not for this
        row. Writing in place breaks the rule that states are values, so only the owner of a
        batch that nobody else can see may call it: the engine does, to give a row that joins
        the place a finished row left, instead of copying the whole batch."""
        return False

    @classmethod
    def concat(cls, states: list["State"]) -> "State":
        """Stack batch rows; the default needs equal shapes."""
        first = states[0]
        changes = {}
        for field in fields(first):
            value = getattr(first, field.name)
            if isinstance(value, Tensor):
                changes[field.name] = torch.cat([getattr(s, field.name) for s in states])
            else:
                changes[field.name] = [
                    torch.cat([getattr(s, field.name)[i] for s in states]) for i in range(len(value))
                ]
        return dataclasses.replace(first, **changes)


class LanguageModel(nn.Module):
    """Base class of every architecture. Subclasses set the class attributes and implement
    `init_state` and `forward`."""

    architecture: ClassVar[str]  # registry name, e.g. "transformer-xl"
    config_class: ClassVar[type[ArchConfig]]
    state_class: ClassVar[type[State]]
    state_kind: ClassVar[str]  # "segment-recurrence", "continuous", "window", "linear", "none"
    state_grows_with_context: ClassVar[bool]
    # True: forward also takes `lengths` (B,), for a batch of chunks of different lengths, each
    # row right-padded to T: row b's tokens are tokens[b, :lengths[b]], its log-probabilities
    # past that are meaningless, and the state returned holds each row after its own tokens
    # only. The engine then prefills prompts of different lengths in one forward.
    ragged_chunks: ClassVar[bool] = False

    config: ArchConfig

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int | None:
        """Longest history the model can condition on, or None when unbounded."""
        return None

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def init_state(self, batch_size: int) -> State:
        raise NotImplementedError

    def forward(self, tokens: Tensor, state: State) -> tuple[Tensor, State]:
        """tokens (B, T) int64 -> log-probabilities (B, T, V) of the next token after each
        position, and the state after these T tokens."""
        raise NotImplementedError

    def check_state(self, state: State) -> None:
        """Raise ValueError when `state` could not have come from this model (wrong class,
        tensor count, per-row shape or dtype). Sequence lengths may differ from a fresh state."""
        if not isinstance(state, self.state_class):
            raise ValueError(f"expected a {self.state_class.__name__}, got {type(state).__name__}")
        fresh = dict(self.init_state(1)._named_tensors())
        given = dict(state._named_tensors())
        if set(fresh) != set(given):
            raise ValueError(f"state tensors {sorted(given)} do not match {sorted(fresh)}")
        for name, expected in fresh.items():
            actual = given[name]
            if actual.dtype != expected.dtype or actual.dim() != expected.dim():
                raise ValueError(
                    f"state tensor '{name}' is {actual.dtype} with {actual.dim()} dims, "
                    f"expected {expected.dtype} with {expected.dim()}"
                )
            for dim in self._fixed_state_dims(name, expected):
                if actual.shape[dim] != expected.shape[dim]:
                    raise ValueError(
                        f"state tensor '{name}' has shape {tuple(actual.shape)}, "
                        f"dimension {dim} must be {expected.shape[dim]}"
                    )

    def _fixed_state_dims(self, name: str, fresh: Tensor) -> range:
        """Dimensions of a state tensor that never change (all but batch by default)."""
        return range(1, fresh.dim())
