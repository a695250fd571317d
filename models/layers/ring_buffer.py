"""Fixed-size ring buffers of keys and values, the memory of the windowed-attention models (the
Longformer, the Conformer, the Lite Transformer).

A ring of capacity C holds the keys and values of the last C positions of a history: position p
lives in slot p mod C, so writing a new position overwrites the oldest one and nothing ever
moves. What a slot holds follows from the number of positions seen, P, alone: slot s holds the
latest p < P with p ≡ s (mod C), or nothing yet when that p is negative (`ring_positions`). A
ring's shape never depends on the history, so rows of different histories batch with the
default `State.concat`, and a state's bytes are the same after 4 KB and after 64 KB of text.

Layout: (B, H, C, D), batch first (as every state tensor), then head-major so that each head's
keys are contiguous rows for attention.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ring_positions(seen: Tensor, capacity: int) -> Tensor:
    """The absolute position each slot of a ring holds after `seen` (B,) positions: (B, C)
    int64, negative for a slot not written yet."""
    slots = torch.arange(capacity, device=seen.device)
    last = seen[:, None] - 1  # the latest position written, (B, 1)
    return last - torch.remainder(last - slots[None, :], capacity)


def ring_write(ring: Tensor, seen: Tensor, new: Tensor) -> Tensor:
    """A new ring (B, H, C, D): `ring` after `seen` (B,) positions, with the T positions `new`
    (B, H, T, D) written after them (row b's at positions seen[b] .. seen[b] + T - 1). Only the
    last C of them can be kept. Out of place: states are values."""
    capacity, T = ring.shape[2], new.shape[2]
    if capacity == 0:
        return ring
    kept = min(T, capacity)
    offsets = torch.arange(T - kept, T, device=seen.device)
    slots = torch.remainder(seen[:, None] + offsets[None, :], capacity)  # (B, kept), all distinct
    index = slots[:, None, :, None].expand(-1, ring.shape[1], -1, ring.shape[3])
    return ring.scatter(2, index, new[:, :, T - kept :].to(ring.dtype))
