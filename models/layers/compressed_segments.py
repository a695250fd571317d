"""`CompressedSegmentMemory`: the open segment's keys and values, and a bounded memory of
completed segments compressed into a few slots each, per layer (the causal Linformer,
models/linformer.py).

A history is cut into segments of L positions at fixed absolute positions (0, L, 2L, ...). The
segment the next position falls in is *open*: its keys and values are kept as they are, slot j
holding the position at offset j in the segment (zeros from offset `position mod L` on, not
written yet). Each *completed* segment is compressed by the layer's learned projections into k
slots (E·K and F·V, each (k, L) times (L, D)); the memory keeps the last M of them, oldest
first: group m holds the segment M − m segments before the open one, and the groups of segments
that do not exist yet (fewer than M completed) hold zeros. Completing a segment shifts the
groups by one, dropping the oldest.

What every slot holds follows from the number of positions seen alone, so every shape is fixed
by the model's config: rows of any histories batch with the default `State.concat`, and a
session's bytes are the same after 4 KB and after 64 KB of text.

A state's field names are its tensors' names when saved (`State.to_tensors`: "open_keys.0",
"slot_values.1", "position").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xlserve.models.interface import FixedShapeState


@dataclass
class CompressedSegmentMemory(FixedShapeState):
    """Per layer l (lists indexed by layer), batch on dimension 0:

    open_keys[l], open_values[l]: (B, H, L, D) the keys and values of the open segment, slot j
        = offset j in it; zeros from offset `position mod L` on
    slot_keys[l], slot_values[l]: (B, H, M, k, D) the compressed slots (E·K, F·V) of the last M
        completed segments, oldest first (group M − 1 is the segment just before the open one);
        zeros in the first M − min(position div L, M) groups (segments that do not exist)
    position: (B,) int64, the number of positions seen

    Bytes per session: 8 + Σ_l 2·H·(L + M·k)·D·itemsize, whatever the history.
    """

    open_keys: list[Tensor]
    open_values: list[Tensor]
    slot_keys: list[Tensor]
    slot_values: list[Tensor]
    position: Tensor

    @classmethod
    def empty(cls, batch_size: int, n_layer: int, n_head: int, d_head: int, segment_len: int,
              memory_segments: int, compressed_len: int, like: Tensor) -> "CompressedSegmentMemory":
        """A memory that has seen nothing, with the dtype and device of `like`."""
        opened = lambda: like.new_zeros(batch_size, n_head, segment_len, d_head)  # noqa: E731
        slots = lambda: like.new_zeros(batch_size, n_head, memory_segments, compressed_len, d_head)  # noqa: E731
        return cls(
            open_keys=[opened() for _ in range(n_layer)],
            open_values=[opened() for _ in range(n_layer)],
            slot_keys=[slots() for _ in range(n_layer)],
            slot_values=[slots() for _ in range(n_layer)],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    def check_consistent(self) -> None:
        """State.check_consistent: as many layers of every list, keys and values of one shape
        with the rows of `position`, a position that is not negative, and zeros wherever no
        position has been written yet (open slots past the open segment's offset, memory groups
        of segments that do not exist): a forward never writes there."""
        layers = {len(self.open_keys), len(self.open_values), len(self.slot_keys), len(self.slot_values)}
        if len(layers) != 1:
            raise ValueError(f"state has open keys for {len(self.open_keys)} layers, open values for "
                             f"{len(self.open_values)}, slot keys for {len(self.slot_keys)} and slot values "
                             f"for {len(self.slot_values)}")
        if self.position.dim() != 1:
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, expected (B,)")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' holds a negative number of positions")
        rows = self.position.shape[0]
        for kind, dims in (("open", 4), ("slot", 5)):
            for i, (keys, values) in enumerate(zip(getattr(self, f"{kind}_keys"), getattr(self, f"{kind}_values"))):
                if keys.shape != values.shape or keys.dim() != dims or keys.shape[0] != rows:
                    raise ValueError(f"state tensors '{kind}_keys.{i}' {tuple(keys.shape)} and '{kind}_values.{i}' "
                                     f"{tuple(values.shape)} must have one shape of {dims} dims with {rows} rows")
        for i, (keys, values) in enumerate(zip(self.open_keys, self.open_values)):
            L = keys.shape[2]
            # (B, L): slot j is past the open segment's offset
            unwritten = torch.arange(L, device=keys.device)[None, :] >= (self.position % max(L, 1))[:, None]
            self._refuse_written(f"open_keys.{i}", keys, unwritten)
            self._refuse_written(f"open_values.{i}", values, unwritten)
        if self.open_keys:
            L = max(self.open_keys[0].shape[2], 1)
            for i, (keys, values) in enumerate(zip(self.slot_keys, self.slot_values)):
                M = keys.shape[2]
                completed = torch.div(self.position, L, rounding_mode="floor").clamp(max=M)  # (B,)
                # (B, M): group m holds a segment only once M − m segments are complete
                unwritten = torch.arange(M, device=keys.device)[None, :] < (M - completed)[:, None]
                self._refuse_written(f"slot_keys.{i}", keys, unwritten)
                self._refuse_written(f"slot_values.{i}", values, unwritten)

    def _refuse_written(self, name: str, tensor: Tensor, unwritten: Tensor) -> None:
        """Raise unless `tensor` (B, H, S, ...) is zero in every slot s where unwritten (B, S)."""
        written = tensor.ne(0).flatten(3).any(dim=-1)  # (B, H, S)
        if bool((written & unwritten[:, None, :]).any()):
            raise ValueError(f"state tensor '{name}' holds values in slots that no position has reached "
                             f"(position {self.position.tolist()})")
