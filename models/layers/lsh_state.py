"""The Reformer's state between calls (`LSHMemory`): what its LSH layers and its local layers
need to decode the next token as the reference does (models/reformer.py has the semantics).

- LSH layers: every position's shared-QK key (unit-RMS, as attention uses it), its value and
  its bucket in every hash round (with the round offset the reference stored it under). A new
  query is hashed, sorted among these buckets and attends within its window: nothing of the
  history is recomputed. These tensors grow by one position per token, up to the model's
  `max_context` (its axial positions' product).
- Local layers: the keys and values of the last S = (before + 1)·c − 1 positions, the most any
  later query can reach back (left-padded with zeros while fewer have been seen). Fixed size.
- `position` (B,): tokens seen; `hashed` (B,): whether the reference would hold buckets by now
  (it hashes its cache only once the history reaches the LSH chunk length; before that a new
  token attends to every earlier one).

Layout: batch first; LSH tensors (B, N, H, ·) with positions on dimension 1, so that decoding
appends into spare room (models/layers/buffers.py) instead of copying the whole history at every
step. Rows of a batch with different histories are left-padded to the longest (row b's entries
are its last position[b]); `split` strips that padding again.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from xlserve.models.interface import State
from xlserve.models.layers.buffers import left_pad

LIST_FIELDS = ("lsh_keys", "lsh_values", "buckets", "local_keys", "local_values")
GROWING = ("lsh_keys", "lsh_values", "buckets")


@dataclass
class LSHMemory(State):
    lsh_keys: list[Tensor]  # per LSH layer (B, N, H, D) float: unit-RMS shared-QK keys
    lsh_values: list[Tensor]  # per LSH layer (B, N, H, D)
    buckets: list[Tensor]  # per LSH layer (B, N, H, R) int32: bucket + round offset, per hash round
    local_keys: list[Tensor]  # per local layer (B, S, H, D): the last S positions, oldest first
    local_values: list[Tensor]  # per local layer (B, S, H, D)
    position: Tensor  # (B,) int64: tokens seen
    hashed: Tensor  # (B,) bool: the reference holds buckets for this history

    @classmethod
    def empty(cls, batch_size: int, n_lsh: int, n_local: int, n_head: int, d_head: int, n_hashes: int,
              window: int, like: Tensor) -> "LSHMemory":
        growing = lambda: like.new_zeros(batch_size, 0, n_head, d_head)  # noqa: E731
        fixed = lambda: like.new_zeros(batch_size, window, n_head, d_head)  # noqa: E731
        return cls(
            lsh_keys=[growing() for _ in range(n_lsh)], lsh_values=[growing() for _ in range(n_lsh)],
            buckets=[torch.zeros(batch_size, 0, n_head, n_hashes, dtype=torch.int32, device=like.device)
                     for _ in range(n_lsh)],
            local_keys=[fixed() for _ in range(n_local)], local_values=[fixed() for _ in range(n_local)],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
            hashed=torch.zeros(batch_size, dtype=torch.bool, device=like.device),
        )

    @property
    def length(self) -> int:
        """N: entries the LSH tensors hold per row (the longest row's history in a batch)."""
        return self.buckets[0].shape[1] if self.buckets else int(self.position.max()) if self.position.numel() else 0

    def check_consistent(self) -> None:
        """State.check_consistent: as many keys as values per kind of layer, every LSH tensor
        covering the same N positions, each row's history within them, `hashed` one per row."""
        for keys, values, name in ((self.lsh_keys, self.lsh_values, "lsh"), (self.local_keys, self.local_values, "local")):
            if len(keys) != len(values):
                raise ValueError(f"state has {name} keys for {len(keys)} layers and values for {len(values)}")
        if len(self.buckets) != len(self.lsh_keys):
            raise ValueError(f"state has buckets for {len(self.buckets)} LSH layers and keys for {len(self.lsh_keys)}")
        if self.position.dim() != 1 or tuple(self.hashed.shape) != tuple(self.position.shape):
            raise ValueError(f"state tensors 'position' {tuple(self.position.shape)} and 'hashed' "
                             f"{tuple(self.hashed.shape)} must be one value per batch row")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' is negative")
        growing = [(f"{kind}.{i}", t) for kind in GROWING for i, t in enumerate(getattr(self, kind))]
        if growing:
            n = growing[0][1].shape[1]
            for name, t in growing:
                if t.shape[1] != n:
                    raise ValueError(f"state tensor '{name}' covers {t.shape[1]} positions, "
                                     f"'{growing[0][0]}' {n}: every LSH tensor covers the same positions")
            if bool((self.position > n).any()):
                raise ValueError(f"state tensor 'position' says {int(self.position.max())} tokens, "
                                 f"the LSH tensors hold {n} positions")
        windows = {t.shape[1] for t in [*self.local_keys, *self.local_values]}
        if len(windows) > 1:
            raise ValueError(f"local keys and values hold windows of different lengths {sorted(windows)}")

    @classmethod
    def concat(cls, states: list["LSHMemory"]) -> "LSHMemory":
        """Rows of every state; the LSH tensors left-padded to the longest history."""
        longest = max(s.length for s in states)
        merged = {}
        for f in fields(cls):
            first = getattr(states[0], f.name)
            if isinstance(first, Tensor):
                merged[f.name] = torch.cat([getattr(s, f.name) for s in states])
            elif f.name in GROWING:
                merged[f.name] = [torch.cat([left_pad(getattr(s, f.name)[i], longest, 0) for s in states])
                                  for i in range(len(first))]
            else:
                merged[f.name] = [torch.cat([getattr(s, f.name)[i] for s in states]) for i in range(len(first))]
        return cls(**merged)

    def split(self) -> list["LSHMemory"]:
        """One batch-1 state per row, each LSH tensor holding exactly that row's positions."""
        rows = []
        n = self.length
        for b, row in enumerate(super().split()):
            start = n - int(self.position[b])
            rows.append(LSHMemory(
                lsh_keys=[t[:, start:] for t in row.lsh_keys], lsh_values=[t[:, start:] for t in row.lsh_values],
                buckets=[t[:, start:] for t in row.buckets], local_keys=row.local_keys,
                local_values=row.local_values, position=row.position, hashed=row.hashed,
            ))
        return rows

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "LSHMemory":
        """State.from_tensors, where a list may be empty (a Reformer without LSH layers, or
        without local ones, has no such tensors); `check_state` compares the names with a
        fresh state's."""
        values: dict = {}
        used = set()
        for f in fields(cls):
            if f.name not in LIST_FIELDS:
                if f.name not in tensors:
                    raise ValueError(f"state tensor '{f.name}' is missing")
                values[f.name] = tensors[f.name]
                used.add(f.name)
                continue
            items = []
            while f"{f.name}.{len(items)}" in tensors:
                used.add(f"{f.name}.{len(items)}")
                items.append(tensors[f"{f.name}.{len(items)}"])
            values[f.name] = items
        unexpected = sorted(set(tensors) - used)
        if unexpected:
            raise ValueError(f"unexpected state tensors {unexpected}")
        return cls(**values)
