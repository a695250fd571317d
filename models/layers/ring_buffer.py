"""Fixed-size ring buffers of keys and values, and the state of a sliding-window model built on
them (`SlidingWindowMemory`, the Longformer's).

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

from dataclasses import dataclass

import torch
from torch import Tensor

from xlserve.models.interface import FixedShapeState


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


def prefix_write(prefix: Tensor, seen: Tensor, new: Tensor) -> Tensor:
    """A new prefix store (B, H, G, D) holding the first G positions of a history: `prefix` after
    `seen` (B,) positions, with the T positions `new` (B, H, T, D) that follow them written where
    they fall among the first G. Out of place."""
    G, T = prefix.shape[2], new.shape[2]
    if G == 0 or T == 0:
        return prefix
    source = torch.arange(G, device=seen.device)[None, :] - seen[:, None]  # (B, G): index into new
    lands = (source >= 0) & (source < T)
    index = source.clamp(0, T - 1)[:, None, :, None].expand(-1, prefix.shape[1], -1, prefix.shape[3])
    written = new.gather(2, index).to(prefix.dtype)
    return torch.where(lands[:, None, :, None], written, prefix)


@dataclass
class SlidingWindowMemory(FixedShapeState):
    """What a sliding-window model with global prefix positions keeps between calls, per layer
    (lists indexed by layer):

    ring_keys[l], ring_values[l]: (B, H, C_l, D) the keys and values of the last C_l positions,
        position p in slot p mod C_l; slots not written yet are zero
    global_keys[l], global_values[l]: (B, H, G, D) the keys and values of the first G positions
        of the history (slot j = position j); slots not reached yet are zero
    position: (B,) int64, the number of positions seen

    Every shape is fixed by the model's config, so rows of any histories concatenate with the
    default `State.concat` and the byte size is the same whatever the history:
    nbytes = 8·B + Σ_l 2·B·H·(C_l + G)·D·itemsize.
    """

    ring_keys: list[Tensor]
    ring_values: list[Tensor]
    global_keys: list[Tensor]
    global_values: list[Tensor]
    position: Tensor

    @classmethod
    def empty(cls, batch_size: int, capacities: list[int], n_global: int, n_head: int, d_head: int,
              like: Tensor) -> "SlidingWindowMemory":
        """A memory that has seen nothing, with the dtype and device of `like`."""
        ring = lambda c: like.new_zeros(batch_size, n_head, c, d_head)  # noqa: E731
        return cls(
            ring_keys=[ring(c) for c in capacities],
            ring_values=[ring(c) for c in capacities],
            global_keys=[ring(n_global) for _ in capacities],
            global_values=[ring(n_global) for _ in capacities],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    def check_consistent(self) -> None:
        """State.check_consistent: as many layers of every kind, keys and values of one shape,
        `position` (B,) and not negative, and zeros in every slot no position has reached (a
        model never writes there, so anything else did not come from one)."""
        layers = {len(self.ring_keys), len(self.ring_values), len(self.global_keys), len(self.global_values)}
        if len(layers) != 1:
            raise ValueError(f"state has ring keys for {len(self.ring_keys)} layers, ring values for "
                             f"{len(self.ring_values)}, global keys for {len(self.global_keys)} and global "
                             f"values for {len(self.global_values)}")
        B = self.position.shape[0] if self.position.dim() == 1 else -1
        if self.position.dim() != 1:
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, expected (B,)")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' holds a negative number of positions")
        for kind in ("ring", "global"):
            for i, (keys, values) in enumerate(zip(getattr(self, f"{kind}_keys"), getattr(self, f"{kind}_values"))):
                if keys.shape != values.shape or keys.shape[0] != B:
                    raise ValueError(f"state tensors '{kind}_keys.{i}' {tuple(keys.shape)} and '{kind}_values.{i}' "
                                     f"{tuple(values.shape)} must have one shape with {B} rows")
                if kind == "ring":
                    unwritten = ring_positions(self.position, keys.shape[2]) < 0  # (B, C)
                else:
                    unwritten = torch.arange(keys.shape[2], device=keys.device)[None, :] >= self.position[:, None]
                for name, tensor in ((f"{kind}_keys.{i}", keys), (f"{kind}_values.{i}", values)):
                    if bool((tensor != 0).any(dim=-1).logical_and(unwritten[:, None, :]).any()):
                        raise ValueError(f"state tensor '{name}' holds values in slots that no position has "
                                         f"reached (position {self.position.tolist()})")
