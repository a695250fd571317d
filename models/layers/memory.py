"""What each architecture remembers between calls: the `State` value types.

- `XLMemory` (Transformer-XL, XLNet): per layer, the keys and values of the last positions
  seen, in decoding buffers (models/layers/buffers.py).
- `ByteWindow` (the vanilla transformer): the last bytes of a fixed window, and the key/value
  cache of that window while it has not slid yet.

A state's field names are its tensors' names when saved (`State.to_tensors`: "keys.0",
"valid", ...): saved sessions and the server's codec find the tensors by those names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xlserve.models.interface import State
from xlserve.models.layers.buffers import left_pad, memory_buffer, write_left_padded


def _left_padding(valid: Tensor) -> int:
    """Positions of padding before a batch-1 row's own positions (valid (1, M); padding only
    ever sits on the left)."""
    return int((~valid[0]).sum())


def _check_padding_on_the_left(valid: Tensor) -> None:
    """ValueError unless every row's padding (False in `valid` (B, M)) comes before its own
    positions, which is what splitting a batch relies on."""
    if valid.shape[1] > 1 and bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        raise ValueError("state tensor 'valid' has padding after a valid position (padding only ever comes first)")


def _check_same_positions(named: list[tuple[str, Tensor]], reference: str, like: Tensor) -> None:
    """ValueError naming the first tensor whose batch rows and positions (dims 0, 1) are not
    those of the state tensor `reference`, `like` (B, M)."""
    for name, tensor in named:
        if tuple(tensor.shape[:2]) != tuple(like.shape[:2]):
            raise ValueError(f"state tensor '{name}' has shape {tuple(tensor.shape)}: it must cover the "
                             f"{like.shape[1]} positions of '{reference}' for each of its {like.shape[0]} rows")


@dataclass
class XLMemory(State):
    """Per layer, the projected keys and values of the last positions seen.

    keys[l], values[l]: (B, M, H, D) with M <= mem_len. `valid` (B, M) is False where a row of a
    batch was left-padded because its session has seen fewer positions than the longest one.
    """

    keys: list[Tensor]
    values: list[Tensor]
    valid: Tensor

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
        _check_same_positions([*((f"keys.{i}", k) for i, k in enumerate(self.keys)),
                               *((f"values.{i}", v) for i, v in enumerate(self.values))], "valid", self.valid)
        _check_padding_on_the_left(self.valid)

    def seen_positions(self) -> int:
        """Positions a batch-1 memory holds (its valid ones)."""
        return int(self.valid.sum())

    @classmethod
    def concat(cls, states: list["XLMemory"]) -> "XLMemory":
        """Rows of every state, left-padded to the longest memory. Serving (autograd off) writes
        them straight into buffers with room, laid out as a batch decodes them (`memory_buffer`):
        the batch's first step then appends in place instead of copying every memory again."""
        longest = max(s.length for s in states)
        batch = sum(s.valid.shape[0] for s in states)

        def stack(parts: list[Tensor], positions_last: bool) -> Tensor:  # (b_i, M_i, H, D) each -> (B, longest, H, D)
            if torch.is_grad_enabled():
                return torch.cat([left_pad(t, longest, 0) for t in parts])
            out = memory_buffer(parts[0], batch, longest, positions_last)
            start = 0
            for t in parts:
                write_left_padded(out.narrow(0, start, t.shape[0]), t)
                start += t.shape[0]
            return out

        n_layer = len(states[0].keys)
        return cls(
            keys=[stack([s.keys[i] for s in states], False) for i in range(n_layer)],
            values=[stack([s.values[i] for s in states], batch > 1) for i in range(n_layer)],
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
            start = _left_padding(row.valid)  # the padding this row carried inside a batch
            rows.append(
                XLMemory(
                    keys=[k[:, start:] for k in row.keys],
                    values=[v[:, start:] for v in row.values],
                    valid=row.valid[:, start:],
                )
            )
        return rows


@dataclass
class ByteWindow(State):
    """The last (at most L) bytes seen, and the key/value cache of the window while it has not
    slid yet.

    tokens (B, W) int64 with W <= L; `valid` (B, W) is False where a row of a batch was
    left-padded because its session has seen fewer bytes. keys[l], values[l]: (B, C, H, D), the
    layer-l keys and values of the window's positions, aligned with `tokens` (C == W), or C == 0
    when no row has a cache; `cached` (B,) says whose cache is valid. A cache exists only while
    the window still starts at byte 0 (W < L); it is dropped once the window is full, since the
    next byte shifts every position.
    """

    tokens: Tensor
    valid: Tensor
    cached: Tensor
    keys: list[Tensor]
    values: list[Tensor]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def cache_length(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    @property
    def fully_cached(self) -> bool:
        """Every row's cache covers its whole window (trivially so for an empty window)."""
        return self.length == 0 or (self.cache_length == self.length and bool(self.cached.all()))

    def check_consistent(self) -> None:
        """State.check_consistent: `valid` and `cached` fit `tokens`, padding comes first, and
        each layer's cached keys and values cover the whole window or nothing."""
        if len(self.keys) != len(self.values):
            raise ValueError(f"state has keys for {len(self.keys)} layers and values for {len(self.values)}")
        _check_same_positions([("valid", self.valid)], "tokens", self.tokens)
        if tuple(self.cached.shape) != tuple(self.tokens.shape[:1]):
            raise ValueError(f"state tensor 'cached' has shape {tuple(self.cached.shape)}, "
                             f"expected ({self.tokens.shape[0]},)")
        _check_padding_on_the_left(self.valid)
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):
            if keys.shape != values.shape:
                raise ValueError(f"state tensors 'keys.{i}' {tuple(keys.shape)} and 'values.{i}' "
                                 f"{tuple(values.shape)} differ in shape")
            if keys.shape[1] not in (0, self.length) or keys.shape[1] != self.cache_length:
                raise ValueError(f"state tensor 'keys.{i}' caches {keys.shape[1]} positions, the window holds "
                                 f"{self.length} and layer 0 caches {self.cache_length}")

    def _without_cache(self) -> "ByteWindow":
        empty = lambda t: t[:, :0]  # noqa: E731
        return ByteWindow(self.tokens, self.valid, torch.zeros_like(self.cached),
                          [empty(k) for k in self.keys], [empty(v) for v in self.values])

    @classmethod
    def concat(cls, states: list["ByteWindow"]) -> "ByteWindow":
        """Rows of every state, left-padded to the longest window. The batch keeps a cache when
        any row has one; rows without one get zeros there, flagged as not cached."""
        longest = max(s.length for s in states)
        any_cache = any(s.cache_length > 0 and bool(s.cached.any()) for s in states)

        def cache(s: ByteWindow, which: str, layer: int) -> Tensor:
            t = getattr(s, which)[layer]
            if not any_cache:
                return t
            if t.shape[1] != s.length:  # no cache in this state
                t = t.new_zeros(t.shape[0], s.length, *t.shape[2:])
            return left_pad(t, longest, 0)

        n_layer = len(states[0].keys)
        if not any_cache:
            states = [s._without_cache() for s in states]
        return cls(
            tokens=torch.cat([left_pad(s.tokens, longest, 0) for s in states]),
            valid=torch.cat([left_pad(s.valid, longest, False) for s in states]),
            cached=torch.cat([s.cached & (s.cache_length == s.length) for s in states]),
            keys=[torch.cat([cache(s, "keys", i) for s in states]) for i in range(n_layer)],
            values=[torch.cat([cache(s, "values", i) for s in states]) for i in range(n_layer)],
        )

    def split(self) -> list["ByteWindow"]:
        rows = []
        for row in super().split():
            start = _left_padding(row.valid)
            trimmed = ByteWindow(row.tokens[:, start:], row.valid[:, start:], row.cached,
                                 [k[:, start:] for k in row.keys], [v[:, start:] for v in row.values])
            rows.append(trimmed if trimmed.fully_cached and trimmed.length > 0 else trimmed._without_cache())
        return rows
