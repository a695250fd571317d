"""Sparse attention patterns given as per-query lists of look-back distances, and attention over
the keys those lists pick out.

A pattern whose shape depends only on where a query sits (its offset in a repeating block) is a
table: row r lists the distances d (0 = the query itself) that a query at offset r looks back,
padded to a common width A and flagged in `allowed`. Attention then gathers A keys per query
instead of scoring every key, so a query costs O(A · d) whatever the history's length, and a
chunk of queries is computed the same way as a single decoding query (which is what keeps
results independent of how a text is split into calls).

- `logsparse_distances`: the LogSparse pattern of Li et al. 2019 (local window + exponential
  steps inside a restarting subsequence; see models/logsparse.py).
- `longest_distance`: how far back a pattern table ever reaches (what a state has to keep).
- `gathered_attention`: softmax attention of each query over its own gathered keys (decoding:
  a few queries, each reading A keys).
- `pattern_mask` and `masked_attention`: the same attention as one dense product under the
  pattern's mask (long chunks: B·T·A gathered key copies cost far more than scoring all S + T
  keys of a bounded look-back with one matrix product; the two agree to float rounding).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def logsparse_distances(restart_len: int, local_window: int) -> tuple[Tensor, Tensor]:
    """The LogSparse look-back distances of a query at each offset r = 0 .. R-1 of its
    subsequence (R = `restart_len`, w = `local_window`):

        D(r) = {0, 1, ..., w-1}  ∪  {2^k : k >= 0, w <= 2^k <= r}

    the local window (itself and the w-1 positions before it) and the exponential steps that
    stay inside the query's own subsequence (2^k <= r). Returns `distances` (R, A) int64, each
    row ascending and padded with 0, and `allowed` (R, A) bool, False on the padding; A is the
    largest |D(r)|. Distances that reach before the history's first position are the caller's
    to mask (they depend on the absolute position, not on r)."""
    if restart_len < 1 or local_window < 1:
        raise ValueError(f"restart_len ({restart_len}) and local_window ({local_window}) must be at least 1")
    rows = []
    for r in range(restart_len):
        steps = {1 << k for k in range(max(r, 1).bit_length()) if local_window <= (1 << k) <= r}
        rows.append(sorted(set(range(local_window)) | steps))
    width = max(len(row) for row in rows)
    distances = torch.zeros(restart_len, width, dtype=torch.long)
    allowed = torch.zeros(restart_len, width, dtype=torch.bool)
    for r, row in enumerate(rows):
        distances[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        allowed[r, : len(row)] = True
    return distances, allowed


def longest_distance(distances: Tensor, allowed: Tensor) -> int:
    """The largest distance any query of the pattern looks back (0 when only itself)."""
    return int(distances[allowed].max()) if bool(allowed.any()) else 0


def gathered_attention(
    q: Tensor,  # (B, T, H, D) queries
    keys: Tensor,  # (B, K, H, D)
    values: Tensor,  # (B, K, H, D)
    index: Tensor,  # (B, T, A) int64: which of the K keys query t may attend to
    allowed: Tensor,  # (B, T, A) bool: False where an entry of `index` is padding (ignored)
    dropatt: float = 0.0,
) -> Tensor:
    """softmax(q kᵀ / √D) v of each query over only its own A gathered keys -> (B, T, H, D).

    Every query must have at least one allowed entry (a causal pattern always lets a query see
    itself), so no row of the softmax is empty."""
    B, T, H, D = q.shape
    rows = torch.arange(B, device=q.device)[:, None, None]
    picked_keys = keys[rows, index]  # (B, T, A, H, D)
    picked_values = values[rows, index]  # (B, T, A, H, D)
    scores = torch.einsum("bthd,btahd->btha", q, picked_keys) / math.sqrt(D)  # (B, T, H, A)
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if dropatt > 0.0:
        weights = F.dropout(weights, p=dropatt, training=True)
    return torch.einsum("btha,btahd->bthd", weights, picked_values)  # (B, T, H, D)


def pattern_mask(index: Tensor, allowed: Tensor, n_keys: int) -> Tensor:
    """The pattern as a dense mask (B, 1, T, n_keys) bool: True where query t attends to key
    index[b, t, a] with allowed[b, t, a]. index and allowed (B, T, A) as for gathered_attention."""
    B, T, _ = index.shape
    target = torch.where(allowed, index, n_keys)  # padding lands in one spare column, dropped below
    mask = torch.zeros(B, T, n_keys + 1, dtype=torch.bool, device=index.device)
    mask.scatter_(2, target, True)
    return mask[:, None, :, :n_keys]


def masked_attention(
    q: Tensor,  # (B, T, H, D) queries
    keys: Tensor,  # (B, K, H, D)
    values: Tensor,  # (B, K, H, D)
    mask: Tensor,  # (B or 1, 1, T, K) bool from pattern_mask
    dropatt: float = 0.0,
) -> Tensor:
    """softmax(q kᵀ / √D) v over the keys `mask` allows, as one dense product -> (B, T, H, D).
    Equal to gathered_attention over the same pattern (to float rounding)."""
    attended = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                              attn_mask=mask, dropout_p=dropatt)  # (B, H, T, D)
    return attended.transpose(1, 2)
