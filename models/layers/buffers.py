"""Growable key/value buffers for decoding, and the left-padding that batches rows of different lengths.

Decoding appends one position per step to every layer's memory of keys and values. Copying
the whole memory at every step (what `torch.cat` does) would cost more than the step's
attention itself, so a memory lives in a buffer with MEMORY_ROOM spare positions after it and
a step writes into that room (`extend_memory`); the memory is copied once per MEMORY_ROOM
steps instead of once per step.

The buffers are laid out for the matrix products that read them while decoding: each head's
keys and values as one contiguous (positions, D) matrix, (B, H, capacity, D), which the query
and the attention probabilities multiply from the left (models/transformer_xl.py); the kernels
then stream whole rows instead of rows strided by H * D. Callers never see the layout: a memory
is always a (B, M, H, D) view.

States are values: a buffer's room is written only by the first continuation of the state
that ends where the buffer's filled part ends, so every earlier state stays valid and a second
continuation of the same state (a retry, a fork) finds the room taken and copies instead.

Rows of a batch whose memories differ in length are left-padded to the longest (`left_pad`,
`write_left_padded`); the padding is masked by the `valid` flags of the state that holds them,
and `left_padding`, `check_padding_on_the_left` and `check_same_positions` let such a state
split its rows again and check that its tensors agree.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

MEMORY_ROOM = 64  # spare positions after a memory buffer: decoding copies the memory once per 64 steps
_CLAIM = threading.Lock()  # two threads continuing the same state must not both take its room


def extend_memory(memory: Tensor, new: Tensor) -> Tensor:
    """torch.cat([memory, new], dim=1) for (B, M, H, D) + (B, T, H, D), without copying `memory`
    when it can be avoided. With autograd on (training) it is torch.cat itself: a buffer written
    in place would break the graph.

    The result is a (B, M + T, H, D) view of a buffer with MEMORY_ROOM spare positions after it,
    laid out as (B, H, capacity, D). The buffer's storage records how far it has been written
    (`_xl_filled`, which also marks it as ours); when `memory` is a full-batch view of such a
    buffer that ends exactly there and the room suffices, `new` is written into the room and the
    longer view returned. Otherwise the memory is copied into a new buffer.
    """
    if torch.is_grad_enabled():
        return torch.cat([memory, new], dim=1)
    B, M, H, D = memory.shape
    T = new.shape[1]
    appended = _append_in_room(memory, new)
    if appended is not None:
        return appended
    out = memory_buffer(memory, B, M + T)
    out.narrow(1, 0, M).copy_(memory)
    out.narrow(1, M, T).copy_(new)
    return out


def _append_in_room(memory: Tensor, new: Tensor) -> Tensor | None:
    """`new` written into the room after `memory` and the longer view, or None when `memory` is
    not a full-batch view of one of our buffers that ends where its buffer is filled, or the
    room is too small."""
    B, M, H, D = memory.shape
    T = new.shape[1]
    storage = memory.untyped_storage()
    ours = hasattr(storage, "_xl_filled")  # a buffer made here
    if not (ours and memory.dtype == new.dtype and memory.device == new.device and B * H * D > 0):
        return None
    capacity = storage.nbytes() // (B * H * D * memory.element_size())
    buffer = memory.as_strided((B, H, capacity, D), (H * D * capacity, D * capacity, D, 1), 0)
    step = D  # storage elements between two positions
    offset = memory.storage_offset()
    if not (
        memory.stride() == buffer.transpose(1, 2).stride()  # a view of this buffer ...
        and buffer.numel() * memory.element_size() == storage.nbytes()  # ... of every batch row
        and offset % step == 0
        and offset < capacity * step  # starting in batch row 0, head 0
    ):
        return None
    start = offset // step
    with _CLAIM:
        claimed = storage._xl_filled == start + M and start + M + T <= capacity
        if claimed:
            storage._xl_filled = start + M + T
    if not claimed:
        return None
    buffer.narrow(2, start + M, T).copy_(new.transpose(1, 2))
    return buffer.narrow(2, start, M + T).transpose(1, 2)


def memory_buffer(like: Tensor, batch: int, length: int) -> Tensor:
    """A new, unwritten (batch, length, H, D) memory (H, D, dtype and device as `like`'s) at the
    start of a buffer with MEMORY_ROOM spare positions after it, in `extend_memory`'s layout and
    recorded as filled up to `length`: the caller writes it, and extend_memory then appends into
    its room."""
    _, _, H, D = like.shape
    capacity = length + MEMORY_ROOM
    buffer = like.new_empty((batch, H, capacity, D))
    buffer.untyped_storage()._xl_filled = length
    return buffer.narrow(2, 0, length).transpose(1, 2)  # (B, length, H, D)


def left_pad(t: Tensor, length: int, fill) -> Tensor:
    """(b, M, ...) -> (b, length, ...), M <= length: `fill` before the rows on dimension 1."""
    missing = length - t.shape[1]
    if missing == 0:
        return t
    return torch.cat([t.new_full((t.shape[0], missing, *t.shape[2:]), fill), t], dim=1)


def write_left_padded(target: Tensor, rows: Tensor) -> None:
    """Write (b, M, H, D) `rows` into the end of the (b, M', H, D) `target`, M <= M', and zeros
    before them: the padding is masked, but 0 * garbage could be nan."""
    missing = target.shape[1] - rows.shape[1]
    if missing:
        target.narrow(1, 0, missing).zero_()
    target.narrow(1, missing, rows.shape[1]).copy_(rows)


def left_padding(valid: Tensor) -> int:
    """Positions of padding before a batch-1 row's own positions (valid (1, M); padding only
    ever sits on the left)."""
    return int((~valid[0]).sum())


def check_padding_on_the_left(valid: Tensor) -> None:
    """ValueError unless every row's padding (False in `valid` (B, M)) comes before its own
    positions, which is what splitting a batch relies on."""
    if valid.shape[1] > 1 and bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        raise ValueError("state tensor 'valid' has padding after a valid position (padding only ever comes first)")


def check_same_positions(named: list[tuple[str, Tensor]], reference: str, like: Tensor) -> None:
    """ValueError naming the first tensor whose batch rows and positions (dims 0, 1) are not
    those of the state tensor `reference`, `like` (B, M)."""
    for name, tensor in named:
        if tuple(tensor.shape[:2]) != tuple(like.shape[:2]):
            raise ValueError(f"state tensor '{name}' has shape {tuple(tensor.shape)}: it must cover the "
                             f"{like.shape[1]} positions of '{reference}' for each of its {like.shape[0]} rows")
