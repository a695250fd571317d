"""Locality-sensitive hashing attention and the chunked attention it runs on (Kitaev et al. 2020,
"Reformer: The Efficient Transformer", section 2), as Hugging Face's `ReformerModelWithLMHead`
(transformers 4.37.2) defines them. models/reformer.py says how a model uses these pieces;
this file holds the arithmetic.

Hashing (`hash_buckets`): angular LSH with a random rotation per head and hash round. With
rotations R_r ∈ R^{D × n_b/2} (fixed in the checkpoint),

    h_r(x) = argmax([x R_r ; −x R_r])  ∈ {0 .. n_b − 1},

and for a factorised bucket count n_b = f_1·f_2·…, one such argmax per factor over its own
columns of R_r, combined as h = h_1 + f_1·h_2 + f_1·f_2·h_3 + …. Round r's buckets are offset by
r·n_b so rounds never mix when sorted (by r·(n_b + 1) where the reference added a bucket for
padding; see models/reformer.py).

Chunked attention (`chunked_attention`): a sequence of S slots (S a multiple of the chunk
length c) split into S/c chunks; chunk k attends to itself and the `before` chunks before it,
cyclically (chunk k − m mod S/c), to the keys whose position is at most the query's (causal);
a key at the query's own position gets the score SELF_SCORE instead of its dot product, so a
query attends to itself only when nothing else is visible. For LSH the slots are the positions
sorted by bucket; for local attention they are the positions in order.

Decoding (`decode_windows`): the slots of one query among the positions it can see,
computed without re-sorting the history once per query.
"""

from __future__ import annotations

import torch
from torch import Tensor

# the score that replaces a query's dot product with its own key (the reference's float32
# self-mask value): exp(-1e5 - s) is 0 in float32 beside any real score s, so a query's own key
# has weight exactly 0 whenever another key is visible, and all the weight when none is
SELF_SCORE = -1e5


def bucket_factors(n_buckets: int | list[int]) -> list[int]:
    """The factors of a bucket count: [n] for an int, the list itself for a factorised one."""
    factors = [n_buckets] if isinstance(n_buckets, int) else [int(f) for f in n_buckets]
    if not factors or any(f < 2 or f % 2 for f in factors):
        raise ValueError(f"num_buckets must be an even int >= 2 or a list of them, got {n_buckets}")
    return factors


def bucket_count(n_buckets: int | list[int]) -> int:
    count = 1
    for f in bucket_factors(n_buckets):
        count *= f
    return count


def rotation_columns(n_buckets: int | list[int]) -> int:
    """Columns of one round's rotation: n_b/2, or Σ f_i/2 for a factorised count."""
    return sum(f // 2 for f in bucket_factors(n_buckets))


def hash_buckets(vectors: Tensor, rotations: Tensor, n_buckets: int | list[int]) -> Tensor:
    """vectors (B, H, T, D), rotations (H, D, R, n_b/2) -> buckets (B, H, R, T) int64 in
    [0, n_b), without round offsets."""
    rotated = torch.einsum("bhtd,hdrk->bhrtk", vectors.detach(), rotations.to(vectors.dtype))  # (B, H, R, T, cols)
    buckets, start, scale = None, 0, 1
    for f in bucket_factors(n_buckets):
        part = rotated[..., start : start + f // 2]
        index = torch.argmax(torch.cat([part, -part], dim=-1), dim=-1)  # (B, H, R, T)
        buckets = index if buckets is None else buckets + scale * index
        start, scale = start + f // 2, scale * f
    return buckets


def unit_rms(x: Tensor, epsilon: float = 1e-6) -> Tensor:
    """x / sqrt(mean(x²) + ε) over the last dimension: the shared-QK key normalisation (a key is
    the query's direction at a fixed length, so a query's dot product with itself is not
    automatically the largest)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)


def self_score_for(dtype: torch.dtype) -> float:
    """SELF_SCORE, or the reference's half-precision value (−1e3) where −1e5 does not fit."""
    return -1e3 if dtype == torch.float16 else SELF_SCORE


# the one pass computes its chunks' scores in groups of chunks holding at most this many scores
CHUNK_GROUP_SCORES = 1 << 24


def chunked_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, chunk: int, before: int,
                      self_score: float | None, dropout: float = 0.0, training: bool = False) -> tuple[Tensor, Tensor]:
    """Attention of every slot to its chunk and the `before` chunks before it (cyclically).

    q, k, v (B, H, S, D) in slot order (keys already scaled), positions (B, H, S) int64 the
    position each slot holds, negative for an empty slot (never visible). Key j is visible to
    query i when 0 <= pos_j <= pos_i; with `self_score`, pos_j == pos_i scores `self_score`.
    Returns the outputs (B, H, S, D) and each slot's log-sum-exp of its scores (B, H, S).
    Chunks are processed in groups (CHUNK_GROUP_SCORES), which changes nothing but memory."""
    B, H, S, D = q.shape
    n = S // chunk
    width = (before + 1) * chunk
    qc, kc, vc = (t.reshape(B, H, n, chunk, D) for t in (q, k, v))
    pc = positions.reshape(B, H, n, chunk)
    group = max(1, CHUNK_GROUP_SCORES // max(1, B * H * chunk * width))
    back = torch.arange(before, -1, -1, device=q.device)  # chunk k sees chunks k − before .. k (mod n)
    outs, lses = [], []
    for first in range(0, n, group):
        g = min(group, n - first)
        window = torch.remainder(torch.arange(first, first + g, device=q.device)[:, None] - back[None, :], n)  # (g, before+1)
        keys = kc[:, :, window].reshape(B, H, g, width, D)
        values = vc[:, :, window].reshape(B, H, g, width, D)
        key_pos = pc[:, :, window].reshape(B, H, g, 1, width)
        query_pos = pc[:, :, first : first + g, :, None]  # (B, H, g, c, 1)
        scores = torch.einsum("bhncd,bhnkd->bhnck", qc[:, :, first : first + g], keys)  # (B, H, g, c, width)
        visible = (key_pos >= 0) & (key_pos <= query_pos)
        if self_score is not None:
            scores = torch.where(key_pos == query_pos, torch.full_like(scores, self_score), scores)
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # every real query sees at least itself
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # an empty slot's query: no keys
        probs = torch.exp(scores - lse)  # the reference's exp(s − lse), not softmax (see models/reformer.py)
        if training and dropout > 0:
            probs = torch.nn.functional.dropout(probs, p=dropout)
        outs.append(torch.matmul(probs, values))  # (B, H, g, c, D)
        lses.append(lse[..., 0])
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=2) if len(lses) > 1 else lses[0]
    return out.reshape(B, H, S, D), lse.reshape(B, H, S)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, self_score: float | None, dropout: float = 0.0,
                     training: bool = False) -> Tensor:
    """Plain causal attention over T positions (what the chunked forms become when the whole
    sequence fits in one chunk): q, k, v (B, H, T, D), keys already scaled -> (B, H, T, D)."""
    T = q.shape[2]
    scores = torch.matmul(q, k.transpose(-1, -2))  # (B, H, T, T)
    index = torch.arange(T, device=q.device)
    if self_score is not None:
        scores = torch.where(index[:, None] == index[None, :], torch.full_like(scores, self_score), scores)
    scores = scores.masked_fill(index[None, :] > index[:, None], float("-inf"))
    probs = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))  # as the reference rounds it
    if training and dropout > 0:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    return torch.matmul(probs, v)


def sorted_slots(buckets: Tensor, padded_length: int) -> Tensor:
    """The LSH slots of one pass: buckets (B, H, R, T) -> positions (B, H, R·T'), round by round
    the positions sorted by (bucket, position), each round followed by T' − T empty slots (−1),
    where the reference sorts its padding tokens (which see and are seen by nothing)."""
    B, H, R, T = buckets.shape
    order = torch.argsort(buckets, dim=-1, stable=True)  # (B, H, R, T): positions in bucket order
    if padded_length > T:
        order = torch.cat([order, order.new_full((B, H, R, padded_length - T), -1)], dim=-1)
    return order.reshape(B, H, R * padded_length)


def sort_entries(values: Tensor) -> tuple[Tensor, Tensor]:
    """values (B, H, R, N) sort keys in position order -> (order, rank): the entry at each
    global index of a stable sort (by value, then position), and each entry's global index."""
    order = torch.argsort(values, dim=-1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(values.shape[-1], device=values.device).expand_as(order))
    return order, rank


def decode_windows(order: Tensor, rank: Tensor, new_count: int, first: int, seen: Tensor, chunk: int,
                   before: int) -> Tensor:
    """The LSH windows of a call's new queries first .. first + Tq − 1, as the reference's
    cached decoding defines them for one new token at a time.

    order, rank (B, H, R, N): `sort_entries` of the sort keys of every entry in position order
    (stored bucket values; the call's `new_count` new entries last; entries that hold nothing
    with a key above every real one, so they sort last). seen (B, Tq) int64: n = position + 1
    of each query processed. Returns entry indices (B, H, R, Tq, (before + 1)·chunk).

    Query t sees positions 0 .. t and nothing after. In round r they are sorted by (value,
    position); the query's slot u there comes after every earlier position of its value; its
    window is the slots (⌊u/c⌋·c − before·c + k) mod n for k = 0 .. (before+1)·c − 1, with
    repeats when the window is longer than n.

    Without a sort per query: one stable sort of all N entries gives each a global index. The
    entries query t must not see are the new ones after it (and the empty ones, which sort after
    every real entry and are never reached); with e_0 < e_1 < … their global indices, the ρ-th
    entry the query sees (in sorted order) is the global entry ρ + #{k : e_k − k <= ρ}, and the
    query's own slot is its global index less #{k : e_k < its global index}.
    """
    B, H, R, N = order.shape
    Tq, T, device = seen.shape[1], new_count, order.device
    new_rank = rank[..., N - T :]  # (B, H, R, T): global index of each new entry
    big = 4 * (N + T) + 16  # above every global index and every rho
    later = torch.arange(T, device=device)[None, :] > torch.arange(first, first + Tq, device=device)[:, None]  # (Tq, T)
    excluded = torch.where(later, new_rank[..., None, :], torch.full_like(new_rank[..., None, :], big))  # (B, H, R, Tq, T)
    excluded = torch.sort(excluded, dim=-1).values.contiguous()
    query_rank = new_rank[..., first : first + Tq]  # (B, H, R, Tq)
    slot = query_rank - torch.searchsorted(excluded, query_rank[..., None].contiguous()).squeeze(-1)  # u
    width = (before + 1) * chunk
    start = (torch.div(slot, chunk, rounding_mode="floor") - before) * chunk
    rho = torch.remainder(start[..., None] + torch.arange(width, device=device),
                          seen[:, None, None, :, None])  # (B, H, R, Tq, W): the window's slots among what t sees
    shifted = torch.where(excluded < big, excluded - torch.arange(T, device=device), excluded)  # e_k − k
    global_index = rho + torch.searchsorted(shifted.contiguous(), rho.contiguous(), right=True)
    return order.gather(-1, global_index.reshape(B, H, R, Tq * width)).reshape(B, H, R, Tq, width)
