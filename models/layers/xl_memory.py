"""`XLMemory`, the state of the two segment-recurrence models (Transformer-XL,
models/transformer_xl.py; XLNet, models/xlnet.py): per layer, the projected keys and values of
the last positions seen, in decoding buffers (models/layers/buffers.py).

A state's field names are its tensors' names when saved (`State.to_tensors`: "keys.0",
"values.0", "valid"): saved sessions and the server's codec find the tensors by those names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xlserve.models.interface import State
from xlserve.models.layers.buffers import (
    check_padding_on_the_left, check_same_positions, left_pad, left_padding, memory_buffer, write_left_padded,
)


@dataclass
class XLMemory(State):
    """Per layer, the projected keys and values of the last positions seen.

    keys[l], values[l]: (B, M, H, D) with M <= mem_len. `valid` (B, M) is False where a row of a
    batch was left-padded because its session has seen fewer positions than the longest one.
    """

    keys: list[Tensor]
    values: list[Tensor]
    valid: Tensor

    # a commit drops the oldest positions and appends the new ones (State.delta_from)
    delta_axes = {"keys": 1, "values": 1, "valid": 1}

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    @classmethod
    def empty(cls, batch_size: int, n_layer: int, n_head: int, d_head: int, like: Tensor) -> "XLMemory":
        """A memory that has seen nothing, with the dtype and device of `like`."""
        empty = lambda: like.new_zeros(batch_size, 0, n_head, d_head)  # noqa: E731
        return cls(
            keys=[empty() for _ in range(n_layer)],
            values=[empty() for _ in range(n_layer)],
            valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=like.device),
        )

    def check_within(self, mem_len: int | None) -> None:
        if mem_len is not None and self.length > mem_len:
            raise ValueError(f"memory holds {self.length} positions, more than mem_len {mem_len}")

    def check_consistent(self) -> None:
        """State.check_consistent: as many layers of keys as of values, and every one covering
        the positions of `valid`, padding first."""
        if len(self.keys) != len(self.values):
            raise ValueError(f"state has keys for {len(self.keys)} layers and values for {len(self.values)}")
        check_same_positions([*((f"keys.{i}", k) for i, k in enumerate(self.keys)),
                               *((f"values.{i}", v) for i, v in enumerate(self.values))], "valid", self.valid)
        check_padding_on_the_left(self.valid)

    def seen_positions(self) -> int:
        """Positions a batch-1 memory holds (its valid ones)."""
        return int(self.valid.sum())

    def check_holds_last(self, tokens: int, mem_len: int | None) -> None:
        """ValueError unless this batch-1 memory marks the positions a model keeps after `tokens`
        tokens: the last min(tokens, mem_len), or all of them when mem_len is None."""
        expected = tokens if mem_len is None else min(tokens, mem_len)
        if self.seen_positions() != expected:
            raise ValueError(f"state tensor 'valid' marks {self.seen_positions()} positions; after {tokens} tokens "
                             f"a memory of mem_len {mem_len} holds {expected}")

    @classmethod
    def concat(cls, states: list["XLMemory"]) -> "XLMemory":
        """Rows of every state, left-padded to the longest memory. Serving (autograd off) writes
        them straight into buffers with room, laid out as a batch decodes them (`memory_buffer`):
        the batch's first step then appends in place instead of copying every memory again."""
        longest = max(s.length for s in states)
        batch = sum(s.valid.shape[0] for s in states)

        def stack(parts: list[Tensor]) -> Tensor:  # (b_i, M_i, H, D) each -> (B, longest, H, D)
            if torch.is_grad_enabled():
                return torch.cat([left_pad(t, longest, 0) for t in parts])
            out = memory_buffer(parts[0], batch, longest)
            start = 0
            for t in parts:
                write_left_padded(out.narrow(0, start, t.shape[0]), t)
                start += t.shape[0]
            return out

        n_layer = len(states[0].keys)
        return cls(
            keys=[stack([s.keys[i] for s in states]) for i in range(n_layer)],
            values=[stack([s.values[i] for s in states]) for i in range(n_layer)],
            valid=torch.cat([left_pad(s.valid, longest, False) for s in states]),
        )

    def take(self, rows: list[int]) -> "XLMemory":
        """The rows at `rows` (see State.take), less the padding none of them needs: `concat` of
        one slice per run of neighbouring rows, where splitting would hand it one row at a time."""
        needed = self.valid[rows].any(dim=0)  # (M,)
        start = int(needed.long().argmax()) if bool(needed.any()) else self.length  # padding only before it
        runs: list[list[int]] = []  # [first row, row count]
        for row in rows:
            if runs and sum(runs[-1]) == row:
                runs[-1][1] += 1
            else:
                runs.append([row, 1])
        return XLMemory.concat([
            XLMemory(keys=[k.narrow(0, first, count)[:, start:] for k in self.keys],
                     values=[v.narrow(0, first, count)[:, start:] for v in self.values],
                     valid=self.valid.narrow(0, first, count)[:, start:])
            for first, count in runs
        ])

    def put_row(self, index: int, row: "XLMemory") -> bool:
        """State.put_row: the row's memory, left-padded to this batch's length, written into
        place `index` (its buffers' other places and room untouched). Not for a row with a
        longer memory than the batch's, nor under autograd."""
        if torch.is_grad_enabled() or row.valid.shape[0] != 1 or row.length > self.length:
            return False
        for mine, theirs in zip([*self.keys, *self.values], [*row.keys, *row.values]):
            write_left_padded(mine.narrow(0, index, 1), theirs)
        missing = self.length - row.length
        self.valid[index, :missing] = False
        self.valid[index, missing:] = row.valid[0]
        return True

    def split(self) -> list["XLMemory"]:
        rows = []
        for row in super().split():
            start = left_padding(row.valid)  # the padding this row carried inside a batch
            rows.append(
                XLMemory(
                    keys=[k[:, start:] for k in row.keys],
                    values=[v[:, start:] for v in row.values],
                    valid=row.valid[:, start:],
                )
            )
        return rows
