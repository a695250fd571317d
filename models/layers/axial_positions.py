"""Axial position embeddings (Kitaev et al. 2020, "Reformer: The Efficient Transformer", and the
Trax code it comes with): a learned absolute position embedding for n_1·n_2·…·n_k positions
stored as k small tables instead of one large one.

Position p is unravelled row-major over the shape (n_1, …, n_k),

    p = Σ_i p_i · Π_{j>i} n_j,    0 <= p_i < n_i,

and its embedding is the concatenation of one row per axis,

    e(p) = [E_1[p_1] ; E_2[p_2] ; … ; E_k[p_k]],    E_i ∈ R^{n_i × d_i},  Σ_i d_i = d_model.

For the enwik8 Reformer's shape (128, 512) with widths (256, 768) that is 128·256 + 512·768
parameters for 65,536 positions instead of 65,536·1024. The number of positions, Π_i n_i, is
the longest history such a model can condition on: there is no embedding beyond it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class AxialPositions(nn.Module):
    """positions (B, T) int64 -> (B, T, Σ d_i). Parameters `weights.i` (n_i, d_i)."""

    def __init__(self, shape: list[int], dims: list[int]):
        super().__init__()
        if len(shape) != len(dims) or not shape or min(shape) < 1 or min(dims) < 1:
            raise ValueError(f"axial shape {shape} and widths {dims} must be non-empty lists of positive ints "
                             "of the same length")
        self.shape = [int(n) for n in shape]
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(n, d)) for n, d in zip(shape, dims))

    @property
    def max_positions(self) -> int:
        return math.prod(self.shape)

    def forward(self, positions: Tensor) -> Tensor:
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.max_positions):
            raise ValueError(f"position {int(positions.max())} is beyond the {self.max_positions} axial positions "
                             f"{tuple(self.shape)}")
        parts, stride = [], self.max_positions
        for n, table in zip(self.shape, self.weights):
            stride //= n
            parts.append(table[torch.div(positions, stride, rounding_mode="floor") % n])  # (B, T, d_i)
        return torch.cat(parts, dim=-1)


class LearnedPositions(nn.Module):
    """One learned vector per absolute position (the Reformer without axial embeddings):
    positions (B, T) -> (B, T, d_model). Parameter `table.weight` (max_positions, d_model)."""

    def __init__(self, max_positions: int, d_model: int):
        super().__init__()
        self.table = nn.Embedding(max_positions, d_model)

    @property
    def max_positions(self) -> int:
        return self.table.num_embeddings

    def forward(self, positions: Tensor) -> Tensor:
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the {self.max_positions} learned positions")
        return self.table(positions)
