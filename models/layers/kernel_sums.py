"""`KernelSums`: what a linear-attention model (the Performer, models/performer.py) remembers.

Per layer, the prefix sums of causal kernel attention over every position seen so far, and the
last few normalised inputs its causal convolution reads. Every tensor has a fixed shape, set by
the model's config and never by the history's length, so rows of any histories batch with the
default `concat`, and a session's bytes are the same after ten tokens or a million.

A state's field names are its tensors' names when saved (`State.to_tensors`: "value_sums.0",
"key_sums.1", "recent_inputs.0", "position").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xlserve.models.interface import FixedShapeState


@dataclass
class KernelSums(FixedShapeState):
    """Per layer l (lists indexed by layer), batch on dimension 0:

    value_sums[l]: (B, H, m, D) float32, S = Σ_j phi(k_j) v_jᵀ over every position seen
    key_sums[l]: (B, H, m) float32, z = Σ_j phi(k_j)
        (phi is the key factor of models/layers/feature_maps.py: every entry in [0, 1], so each
        entry of z lies between 0 and the number of tokens seen)
    recent_inputs[l]: (B, K − 1, d_model) the last K − 1 normalised inputs of layer l, oldest
        first, for its causal convolution of width K; zeros before the first token (the
        convolution's left padding)
    position: (B,) int64, tokens seen

    Bytes per session: n_layer · (4·H·m·D + 4·H·m + (K − 1)·d_model·element size) + 8.
    """

    value_sums: list[Tensor]
    key_sums: list[Tensor]
    recent_inputs: list[Tensor]
    position: Tensor

    @classmethod
    def empty(cls, batch_size: int, n_layer: int, n_head: int, n_features: int, d_head: int,
              conv_width: int, d_model: int, like: Tensor) -> "KernelSums":
        """A state that has seen nothing: zero sums, zero padding, on `like`'s device
        (`recent_inputs` in `like`'s dtype, the sums always float32)."""
        device = like.device
        return cls(
            value_sums=[torch.zeros(batch_size, n_head, n_features, d_head, device=device) for _ in range(n_layer)],
            key_sums=[torch.zeros(batch_size, n_head, n_features, device=device) for _ in range(n_layer)],
            recent_inputs=[like.new_zeros(batch_size, conv_width - 1, d_model) for _ in range(n_layer)],
            position=torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    def check_consistent(self) -> None:
        """State.check_consistent: as many layers of every list, each layer's z covering the
        heads and features of its S, and one position per row."""
        layers = {len(self.value_sums), len(self.key_sums), len(self.recent_inputs)}
        if len(layers) != 1:
            raise ValueError(f"state has value_sums for {len(self.value_sums)} layers, key_sums for "
                             f"{len(self.key_sums)} and recent_inputs for {len(self.recent_inputs)}")
        for i, (s, z) in enumerate(zip(self.value_sums, self.key_sums)):
            if tuple(z.shape) != tuple(s.shape[:3]):
                raise ValueError(f"state tensor 'key_sums.{i}' has shape {tuple(z.shape)}, 'value_sums.{i}' "
                                 f"{tuple(s.shape)}: z must have the (B, H, m) of S")
        if tuple(self.position.shape) != (self.batch_size,):
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, "
                             f"expected ({self.batch_size},)")
