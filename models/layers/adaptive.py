"""Adaptive input embedding and adaptive softmax for large word-level vocabularies.

Papers: Alexei Baevski, Michael Auli, "Adaptive Input Representations for Neural Language
Modeling", ICLR 2019; Edouard Grave, Armand Joulin, Moustapha Cissé, David Grangier, Hervé Jégou,
"Efficient softmax approximation for GPUs", ICML 2017. Transformer-XL's WikiText-103 model uses
both, with the input and output sides sharing their weights.

The vocabulary, sorted by frequency, is cut into clusters at `cutoffs`: cluster 0 holds ids
[0, cutoffs[0]), cluster i holds [cutoffs[i-1], cutoffs[i]), the last one ends at vocab_size.
Cluster i has vectors of width d_embed // div_val**i (rare words get narrow vectors) that a
projection of shape (d_model, d_i) maps to and from the model width.

- Input: token -> its cluster's vector (d_i) -> projected to d_model. With div_val == 1 there
  is one table of width d_embed for the whole vocabulary and one projection, present only when
  d_embed != d_model.
- Output: the head scores the ids of cluster 0 plus one logit per further cluster; a tail
  cluster's ids are scored among themselves, and log p(id) = log p_head(cluster) + log p_tail(id).
  Every cluster projects the hidden state with its own projection (with div_val == 1 and
  d_embed == d_model there are none). The head's cluster logits use `cluster_weight` (width
  d_embed) and `cluster_bias`.
- Sharing: `tie_weight` makes the output vectors of each cluster the input table (the output
  keeps its own bias); `tie_projs[i]` makes cluster i's output projection the input projection
  of cluster i (with div_val == 1: the single input projection).

`AdaptiveLogSoftmax` returns log-probabilities over the whole vocabulary (no sampled or
target-only shortcut): serving needs the full distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.layers.linear import linear


def cluster_bounds(vocab_size: int, cutoffs: list[int]) -> list[int]:
    """[0, *cutoffs, vocab_size], checked to be strictly increasing."""
    bounds = [0, *cutoffs, vocab_size]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cutoffs {cutoffs} must increase strictly between 0 and vocab_size {vocab_size}")
    return bounds


def cluster_widths(d_embed: int, n_clusters: int, div_val: int) -> list[int]:
    """Vector width of each cluster: d_embed // div_val**i (all d_embed when div_val == 1)."""
    widths = [d_embed // div_val**i for i in range(n_clusters)]
    if min(widths) < 1:
        raise ValueError(f"d_embed {d_embed} with div_val {div_val} leaves a cluster of width 0")
    return widths


class AdaptiveEmbedding(nn.Module):
    """tokens (B, T) -> (B, T, d_model), unscaled."""

    streaming = False  # products through models/layers/linear.py's streaming path (choose_kernels)

    def __init__(self, vocab_size: int, d_embed: int, d_model: int, cutoffs: list[int], div_val: int):
        super().__init__()
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        self.d_model = d_model
        if div_val == 1:  # one table for the whole vocabulary
            self.tables = nn.ModuleList([nn.Embedding(vocab_size, d_embed)])
            widths = [d_embed] if d_embed != d_model else []
        else:
            widths = cluster_widths(d_embed, len(self.bounds) - 1, div_val)
            sizes = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
            self.tables = nn.ModuleList(nn.Embedding(n, d) for n, d in zip(sizes, widths))
        # projections[i]: (d_model, d_i), applied as x @ P.T; one per table, or none at all
        self.projections = nn.ParameterList(nn.Parameter(torch.empty(d_model, d)) for d in widths)
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.02)
        for projection in self.projections:
            nn.init.normal_(projection, std=0.01)

    def forward(self, tokens: Tensor) -> Tensor:
        if len(self.tables) == 1:
            x = self.tables[0](tokens)  # (B, T, d_embed)
            return linear(x, self.projections[0], streaming=self.streaming) if len(self.projections) else x
        flat = tokens.reshape(-1)
        out = self.projections[0].new_zeros(flat.shape[0], self.d_model)  # (B*T, d_model)
        for i, (table, projection) in enumerate(zip(self.tables, self.projections)):
            low, high = self.bounds[i], self.bounds[i + 1]
            rows = ((flat >= low) & (flat < high)).nonzero().squeeze(1)
            if rows.numel():
                out.index_copy_(0, rows, linear(table(flat[rows] - low), projection, streaming=self.streaming))
        return out.view(*tokens.shape, self.d_model)


class AdaptiveLogSoftmax(nn.Module):
    """hidden (..., d_model) -> log-probabilities (..., vocab_size) in float32."""

    streaming = False  # products through models/layers/linear.py's streaming path (choose_kernels)

    def __init__(
        self,
        vocab_size: int,
        d_embed: int,
        d_model: int,
        cutoffs: list[int],
        div_val: int,
        embedding: AdaptiveEmbedding,
        tie_weight: bool,
        tie_projs: list[bool],
    ):
        super().__init__()
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        n_clusters = len(self.bounds) - 1
        if len(tie_projs) not in (0, n_clusters):
            raise ValueError(f"tie_projs has {len(tie_projs)} entries, expected one per cluster ({n_clusters})")
        tie_projs = list(tie_projs) or [False] * n_clusters

        # output vectors: the input tables (tie_weight) or tables of the same layout
        if tie_weight:
            self.tables = embedding.tables  # shared module: same parameters under both names
        else:
            self.tables = nn.ModuleList(nn.Embedding(*t.weight.shape) for t in embedding.tables)
            for table in self.tables:
                nn.init.normal_(table.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(vocab_size))  # (V,) never shared

        # one projection per cluster when the input side has any (div_val > 1 or d_embed != d_model)
        projections = []
        for i in range(n_clusters if len(embedding.projections) else 0):
            source = embedding.projections[0 if div_val == 1 else i]
            if tie_projs[i]:
                projections.append(source)
            else:
                projections.append(nn.Parameter(torch.empty_like(source).normal_(std=0.01)))
        self.projections = nn.ParameterList(projections)

        if n_clusters > 1:  # the head scores each tail cluster with one logit
            self.cluster_weight = nn.Parameter(torch.zeros(n_clusters - 1, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(n_clusters - 1))
            nn.init.normal_(self.cluster_weight, std=0.02)

    def _cluster_vectors(self, i: int) -> Tensor:
        """(size_i, d_i): output vectors of cluster i."""
        if len(self.tables) == 1:
            return self.tables[0].weight[self.bounds[i] : self.bounds[i + 1]]
        return self.tables[i].weight

    def _project(self, hidden: Tensor, i: int) -> Tensor:
        """(N, d_model) -> (N, d_i) with cluster i's projection (identity when there is none)."""
        return hidden @ self.projections[i] if len(self.projections) else hidden

    def forward(self, hidden: Tensor) -> Tensor:
        shape = hidden.shape[:-1]
        h = hidden.reshape(-1, hidden.shape[-1])  # (N, d_model)
        b = self.bounds
        projected = self._project(h, 0)  # (N, d_0)
        # (N, cutoffs[0])
        head_logits = linear(projected, self._cluster_vectors(0), self.bias[b[0] : b[1]], self.streaming)
        if len(b) > 2:  # one more logit per tail cluster
            cluster_logits = linear(projected, self.cluster_weight, self.cluster_bias, self.streaming)
            head_logits = torch.cat([head_logits, cluster_logits], dim=-1)
        head = F.log_softmax(head_logits.float(), dim=-1)
        pieces = [head[:, : b[1]]]
        for i in range(1, len(b) - 1):
            tail_logits = linear(
                self._project(h, i), self._cluster_vectors(i), self.bias[b[i] : b[i + 1]], self.streaming
            )
            pieces.append(head[:, b[1] + i - 1, None] + F.log_softmax(tail_logits.float(), dim=-1))
        return torch.cat(pieces, dim=-1).view(*shape, b[-1])  # (..., V)
