"""`LookbackMemory`: the keys and values of a fixed number of most recent positions, per layer,
and how many positions a session has seen (LogSparse, models/logsparse.py).

A model whose queries never look further back than S positions (a local window, exponential
steps inside a restarting block) needs nothing older: the state is the last S positions' keys
and values, whatever the history's length. The buffer always has S slots, aligned to the end:
slot S-1 holds the last position seen, slot S-1-d the position d before it. Slots for positions
before the session's first token hold zeros and are never attended to (the model masks them
from `position`). Every session's state has the same shape, so rows with different histories
batch with the default `concat` (stacking), and `nbytes` is the same after 4 KB and after 64 KB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xlserve.models.interface import FixedShapeState


@dataclass
class LookbackMemory(FixedShapeState):
    """keys[l], values[l]: (B, S, H, D), layer l's keys and values of the last S positions seen,
    aligned to the end (zeros before the first token). position: (B,) int64, the number of
    positions each row has seen (its next token's absolute position)."""

    keys: list[Tensor]
    values: list[Tensor]
    position: Tensor

    @property
    def slots(self) -> int:
        """S: the positions kept per row."""
        return self.keys[0].shape[1] if self.keys else 0

    @classmethod
    def empty(cls, batch_size: int, n_layer: int, slots: int, n_head: int, d_head: int, like: Tensor) -> "LookbackMemory":
        """A memory that has seen nothing, with the dtype and device of `like`."""
        zeros = lambda: like.new_zeros(batch_size, slots, n_head, d_head)  # noqa: E731
        return cls(
            keys=[zeros() for _ in range(n_layer)],
            values=[zeros() for _ in range(n_layer)],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    def check_consistent(self) -> None:
        """State.check_consistent: as many layers of keys as of values, all of one shape with
        the rows of `position`; a position that is not negative; and zeros in every slot of a
        position before the row's first token (a forward never writes there)."""
        if len(self.keys) != len(self.values):
            raise ValueError(f"state has keys for {len(self.keys)} layers and values for {len(self.values)}")
        if self.position.dim() != 1:
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, expected (B,)")
        rows = self.position.shape[0]
        reference = self.keys[0].shape if self.keys else None
        for name, tensor in self._named_tensors():
            if name == "position":
                continue
            if tensor.shape != reference or tensor.shape[0] != rows:
                raise ValueError(f"state tensor '{name}' has shape {tuple(tensor.shape)}; 'keys.0' has "
                                 f"{tuple(reference)} and 'position' {rows} rows")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' holds a negative count of positions")
        S = self.slots
        # slot m of row b holds position position[b] - S + m: empty (zero) while that is negative
        unwritten = torch.arange(S, device=self.position.device)[None, :] < (S - self.position)[:, None]  # (B, S)
        if bool(unwritten.any()):
            for name, tensor in self._named_tensors():
                if name != "position" and bool(tensor[unwritten].ne(0).any()):
                    raise ValueError(f"state tensor '{name}' holds values in slots before the first position "
                                     f"('position' says they were never written)")
