"""Causal depthwise convolution over a stream, and the state of the two models built of it and
of windowed attention (`ConvWindowMemory`: the Conformer, models/conformer.py; the Lite
Transformer, models/lite_transformer.py).

A causal convolution of width K gives position t a weighted sum of inputs t − K + 1 .. t: it
looks only left, so the inputs before the first position are zeros (left padding only), and
between calls it needs nothing of the past but the last K − 1 inputs. A caller keeps them as a
(B, K − 1, C) buffer, oldest first and zeros before the first position, and passes it back with
the next chunk: the chunk is read after the buffer, as if the whole history had been fed at
once, so the result is the same in any chunking. The buffer's shape never depends on the
history's length. `causal_depthwise_conv` applies one kernel per channel (the Lite Transformer
adds its own dynamic convolution on `with_history`).

`ConvWindowMemory` keeps, per layer, that buffer and the keys and values of the last C positions
in a ring (models/layers/ring_buffer.py: position p in slot p mod C, `ring_positions` says which
slot holds what), C = mem_len − 1: a query sees itself and the C positions before it, so the
next query can still reach exactly these. Plus the number of positions each row has seen, from
which every slot's meaning follows (no validity mask is stored: a slot is written once
`position` has reached it). Every shape is fixed by the config, never by the history, so rows of
any histories batch with the default `State.concat`, a row can be written in place (`put_row`),
and a session's bytes are the same after 4 KB and after 64 KB of text. A state's field names are
its tensors' names when saved (`State.to_tensors`: "conv_inputs.0", "keys.1", "values.1",
"position").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from xlserve.models.interface import FixedShapeState
from xlserve.models.layers.ring_buffer import ring_positions


def with_history(x: Tensor, recent: Tensor) -> tuple[Tensor, Tensor]:
    """x (B, T, C) after the buffer `recent` (B, K − 1, C) -> the inputs read, (B, K − 1 + T, C),
    and the buffer after x: the last K − 1 of them (part of the old buffer when T < K − 1)."""
    padded = torch.cat([recent.to(x.dtype), x], dim=1)  # (B, K − 1 + T, C)
    return padded, padded[:, padded.shape[1] - recent.shape[1] :]


def causal_depthwise_conv(x: Tensor, recent: Tensor, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """out[b, t, c] = Σ_k weight[c, k] · input[b, t − K + 1 + k, c] (+ bias[c]) for x (B, T, C)
    after `recent` (B, K − 1, C), weight (C, K) -> out (B, T, C) and the buffer after x."""
    padded, recent = with_history(x, recent)
    C, K = weight.shape
    if K != recent.shape[1] + 1:
        raise ValueError(f"a kernel of width {K} needs {K - 1} buffered inputs, got {recent.shape[1]}")
    bias = None if bias is None else bias.to(x.dtype)
    if x.shape[1] == 1:
        # a decode step: K products and a sum per channel. conv1d's set-up (a oneDNN primitive
        # per call) cost ~250 µs here, 6 ms of a 24-layer Mamba step at mamba-130m's width
        out = (padded * weight.t().to(x.dtype)).sum(dim=1, keepdim=True)  # (B, 1, C)
        return (out if bias is None else out + bias), recent
    out = F.conv1d(padded.transpose(1, 2), weight[:, None, :].to(x.dtype), bias, groups=C)  # (B, C, T)
    return out.transpose(1, 2), recent


@dataclass
class ConvWindowMemory(FixedShapeState):
    """Per layer l (lists indexed by layer), batch on dimension 0:

    conv_inputs[l]: (B, K_l − 1, C) the last K_l − 1 inputs (C channels) of layer l's
        depthwise convolution, oldest first; zeros for positions before the first token
    keys[l], values[l]: (B, H, C, D) the keys and values of the last C = mem_len − 1 positions,
        position p in slot p mod C; zeros in slots no position has reached yet
    position: (B,) int64, the number of positions seen (the next token's absolute position)

    Bytes per session: Σ_l ((K_l − 1)·C + 2·H·C_ring·D) · element size + 8.
    """

    conv_inputs: list[Tensor]
    keys: list[Tensor]
    values: list[Tensor]
    position: Tensor

    # a commit slides the convolution inputs and overwrites its positions' ring slots (State.delta_from)
    delta_axes = {"conv_inputs": 1, "keys": 2, "values": 2}

    @classmethod
    def empty(cls, batch_size: int, kernel_sizes: list[int], conv_channels: int, capacity: int, n_head: int,
              d_head: int, like: Tensor) -> "ConvWindowMemory":
        """A memory that has seen nothing, one layer per kernel width, in the dtype and on the
        device of `like`."""
        ring = lambda: like.new_zeros(batch_size, n_head, capacity, d_head)  # noqa: E731
        return cls(
            conv_inputs=[like.new_zeros(batch_size, k - 1, conv_channels) for k in kernel_sizes],
            keys=[ring() for _ in kernel_sizes],
            values=[ring() for _ in kernel_sizes],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    def check_consistent(self) -> None:
        """State.check_consistent: as many layers of every kind, keys and values of one shape,
        one `position` per row and none negative, and zeros wherever no position has reached
        (ring slots not written yet, convolution inputs before the first token): a model never
        writes there, so a state with anything else did not come from one."""
        layers = {len(self.conv_inputs), len(self.keys), len(self.values)}
        if len(layers) != 1:
            raise ValueError(f"state has conv_inputs for {len(self.conv_inputs)} layers, keys for {len(self.keys)} "
                             f"and values for {len(self.values)}")
        if self.position.dim() != 1:
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, expected (B,)")
        B = self.position.shape[0]
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' holds a negative number of positions")
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):
            if keys.shape != values.shape or keys.shape[0] != B:
                raise ValueError(f"state tensors 'keys.{i}' {tuple(keys.shape)} and 'values.{i}' "
                                 f"{tuple(values.shape)} must have one shape with {B} rows")
            unwritten = ring_positions(self.position, keys.shape[2]) < 0  # (B, C)
            for name, tensor in ((f"keys.{i}", keys), (f"values.{i}", values)):
                if bool((tensor != 0).any(dim=-1).logical_and(unwritten[:, None, :]).any()):
                    raise ValueError(f"state tensor '{name}' holds values in slots that no position has reached "
                                     f"('position' says {self.position.tolist()})")
        for i, recent in enumerate(self.conv_inputs):
            if recent.shape[0] != B:
                raise ValueError(f"state tensor 'conv_inputs.{i}' holds {recent.shape[0]} rows, 'position' {B}")
            # slot s of K − 1 holds position `position` − (K − 1) + s: empty while that is negative
            slots = recent.shape[1]
            unwritten = torch.arange(slots, device=recent.device)[None, :] < (slots - self.position)[:, None]  # (B, K − 1)
            if bool((recent != 0).any(dim=-1).logical_and(unwritten).any()):
                raise ValueError(f"state tensor 'conv_inputs.{i}' holds values in slots that no position has "
                                 f"reached ('position' says {self.position.tolist()})")
