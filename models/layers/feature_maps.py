"""Positive orthogonal random features for the softmax kernel (FAVOR+), as the Performer uses them.

Choromanski et al., "Rethinking Attention with Performers", ICLR 2021, sections 2.3-2.4. The
softmax kernel SM(x, y) = exp(xᵀy) is the expectation over w ~ N(0, I_d) of

    phi(x)ᵀ phi(y),    phi(x) = exp(wᵀx − |x|²/2) / sqrt(m)    (m features w_1 .. w_m)

(their Lemma 1, the positive features: every feature is > 0, so attention weights built from
them are positive and their row sums never cancel to 0). Drawing the w_r *orthogonal* to each
other (blocks of d exactly orthogonal directions, each row's length drawn as the length of a
Gaussian vector, so every row is still marginally N(0, I_d)) lowers the estimator's variance
(their Theorem 2): `orthogonal_random_matrix`.

`favor_features` is the paper's phi itself. Its exponent is wᵀx − |x|²/2 = |w|²/2 − |x − w|²/2,
so in float32 it goes wrong at both ends: a feature row with |w|²/2 beyond ~88 (rows of length
> 13, which orthogonal rows reach for heads of more than about 150 dimensions, and the tail of
any chi draw) overflows for x near w; and a long x (|x|²/2 beyond ~100 more than its largest
wᵀx) underflows every feature to 0, so a query's phi(q)ᵀz is 0 and attention is 0/0. The
Performer layer therefore uses the same product split into two factors that are each at most 1
(`key_features`, `query_features`):

    phi_r(q) phi_r(k) · m = exp(w_rᵀq + |w_r|²/2 − |q|²/2) · exp(−|k − w_r|²/2)

since w_rᵀk − |k|²/2 − |w_r|²/2 = −|k − w_r|²/2. The key factor depends on k and w only: it is
<= 1 by construction, needs no stabiliser that depends on other keys, and therefore is the same
number whatever chunk the key arrived in. The query factor carries the rest; a query's factors
are all scaled by one common number (its own largest exponent is subtracted, and |q|²/2 is
dropped), which cancels between the numerator and the denominator of normalised attention, and
its largest factor is exactly 1, so it never underflows as a whole.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def orthogonal_random_matrix(n_features: int, dim: int, generator: torch.Generator | None = None) -> Tensor:
    """(n_features, dim) float32 rows w_r, orthogonal within each block of `dim` rows, each
    row's length distributed as that of a N(0, I_dim) vector (chi with dim degrees of freedom),
    so every row is marginally Gaussian, as FAVOR+ needs (Choromanski et al. 2021, section 2.4)."""
    if n_features < 1 or dim < 1:
        raise ValueError(f"need at least one feature and one dimension, got {n_features} x {dim}")
    blocks = []
    for _ in range(math.ceil(n_features / dim)):
        gaussian = torch.randn(dim, dim, generator=generator)
        q, r = torch.linalg.qr(gaussian)  # q's columns orthonormal
        q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(dim))  # Haar-uniform
        blocks.append(q.T)  # rows orthonormal
    directions = torch.cat(blocks)[:n_features]  # (m, d)
    lengths = torch.randn(n_features, dim, generator=generator).norm(dim=1)  # (m,) chi(d)
    return directions * lengths[:, None]


def favor_features(x: Tensor, w: Tensor) -> Tensor:
    """The paper's positive random features phi(x) = exp(wᵀx − |x|²/2) / sqrt(m): x (..., d),
    w (m, d) -> (..., m). Unstabilised: for tests and small inputs (it overflows for large x)."""
    exponent = x @ w.T - (x * x).sum(-1, keepdim=True) / 2
    return torch.exp(exponent) / math.sqrt(w.shape[0])


def key_features(k: Tensor, w: Tensor) -> Tensor:
    """exp(−|k − w_r|²/2) for every feature r: k (..., d), w (m, d) -> (..., m), float32, in
    [0, 1]. Equal to phi_r(k) · sqrt(m) · exp(−|w_r|²/2); the exp(|w_r|²/2) goes to the query
    side (`query_features`). Computed from the expansion wᵀk − |k|²/2 − |w|²/2, clamped at 0
    where rounding would push it above."""
    k = k.float()
    w = w.float()
    exponent = k @ w.T - (k * k).sum(-1, keepdim=True) / 2 - (w * w).sum(-1) / 2  # (..., m), <= 0
    return torch.exp(exponent.clamp(max=0.0))


def query_features(q: Tensor, w: Tensor) -> Tensor:
    """exp(w_rᵀq + |w_r|²/2 − c_q) for every feature r, with c_q the largest of those exponents
    for this query: q (..., d), w (m, d) -> (..., m), float32, largest entry 1. Equal to
    phi_r(q) · sqrt(m) · exp(|w_r|²/2) times exp(|q|²/2 − c_q), a factor common to all of
    the query's features, which cancels in normalised attention."""
    q = q.float()
    w = w.float()
    exponent = q @ w.T + (w * w).sum(-1) / 2  # (..., m)
    return torch.exp(exponent - exponent.amax(dim=-1, keepdim=True))
