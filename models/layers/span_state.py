"""`SpanMemory`: what adaptive attention span (models/adaptive_span.py) keeps between calls.

Per layer and head, the projected keys and values of the last positions that head can still
reach: a head with learned span z reaches ceil(z) + R - 1 positions before its query
(models/layers/span_mask.py), so a head with a short span keeps little.

Layout (every tensor batch-first):
- keys[l * n_head + h], values[l * n_head + h]: (B, m, D), head h of layer l; m = min(n_lh, M)
  where n_lh = ceil(z_lh) + R - 1 is what the head keeps once its memory is full and M is the
  longest head memory of the state (M = min(tokens seen, max n_lh) for one session). Positions
  run oldest to newest; the last one is the last token seen.
- position: (B,) int64, tokens each row has seen. In a batch, rows that have seen fewer positions
  than a head tensor holds are left-padded with zeros: row b's own positions in a tensor of
  length m are its last min(position_b, m).

Bytes for one session after t tokens, float32, D = d_head:
    8 * D * sum over (l, h) of min(n_lh, t)  +  8      (keys and values, 4 bytes each; `position`)
and once t >= max n_lh: 8 * D * sum n_lh + 8, against 8 * D * n_layer * n_head * (S + R - 1) + 8
for a state that kept the maximum span S for every head.

Heads of different spans batch together because each head is its own tensor; rows of different
histories batch together by left padding (`concat`), masked by `position`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xlserve.models.interface import State
from xlserve.models.layers.buffers import left_pad


@dataclass
class SpanMemory(State):
    keys: list[Tensor]  # n_layer * n_head tensors (B, m, D), index l * n_head + h
    values: list[Tensor]  # the same shapes as keys
    position: Tensor  # (B,) int64: tokens seen per row (the position of the next one)

    @property
    def length(self) -> int:
        """M: the longest head memory (positions) in this state."""
        return max((k.shape[1] for k in self.keys), default=0)

    @classmethod
    def empty(cls, batch_size: int, n_heads_total: int, d_head: int, like: Tensor) -> "SpanMemory":
        return cls(
            keys=[like.new_zeros(batch_size, 0, d_head) for _ in range(n_heads_total)],
            values=[like.new_zeros(batch_size, 0, d_head) for _ in range(n_heads_total)],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    def check_consistent(self) -> None:
        """State.check_consistent: keys and values for the same heads, of the same shapes, and a
        non-negative token count per row."""
        if len(self.keys) != len(self.values):
            raise ValueError(f"state has keys for {len(self.keys)} heads and values for {len(self.values)}")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k.shape != v.shape:
                raise ValueError(f"state tensors 'keys.{i}' {tuple(k.shape)} and 'values.{i}' {tuple(v.shape)} "
                                 f"differ in shape")
        if self.position.dim() != 1:
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, expected (batch,)")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' holds a negative token count")

    @classmethod
    def concat(cls, states: list["SpanMemory"]) -> "SpanMemory":
        """Rows of every state; each head's tensors left-padded with zeros to the longest among
        the states (the padding lies before each row's own positions, and `position` masks it)."""
        n = len(states[0].keys)

        def stack(which: str, i: int) -> Tensor:
            parts = [getattr(s, which)[i] for s in states]
            longest = max(p.shape[1] for p in parts)
            return torch.cat([left_pad(p, longest, 0) for p in parts])

        return cls(keys=[stack("keys", i) for i in range(n)], values=[stack("values", i) for i in range(n)],
                   position=torch.cat([s.position for s in states]))

    def split(self) -> list["SpanMemory"]:
        """One state per row, each head tensor trimmed to the row's own positions (what the row
        would hold alone)."""
        rows = []
        for b in range(self.batch_size):
            own = int(self.position[b])
            cut = lambda t: t[b : b + 1, t.shape[1] - min(own, t.shape[1]) :]  # noqa: E731
            rows.append(SpanMemory(keys=[cut(k) for k in self.keys], values=[cut(v) for v in self.values],
                                   position=self.position[b : b + 1]))
        return rows
