"""Continuous signals over [0, 1] for the ∞-former's long-term memory.

A sequence of L vectors X ∈ R^{L×d}, placed at positions t_1 < ... < t_L in [0, 1], becomes a
continuous signal X̄(t) = Bᵀ ψ(t), where ψ(t) ∈ R^N holds N Gaussian radial basis functions

    ψ_j(t) = N(t; c_j, s_j²)        (a Gaussian density: centre c_j, width s_j)

with centres spread evenly over [0, 1], one set of centres per width. The coefficients
B ∈ R^{N×d} come from ridge regression,

    B = (Ψ Ψᵀ + λ I)⁻¹ Ψ X,        Ψ = [ψ(t_1), ..., ψ(t_L)] ∈ R^{N×L},

and (ΨΨᵀ + λI)⁻¹Ψ depends only on the positions, so it is computed once (`ridge_operator`).

Continuous attention reads the signal through a Gaussian density p = N(μ, σ²) over t:
E_p[X̄(t)] = E_p[ψ(t)]ᵀ B, and the expectation of a Gaussian basis function under a Gaussian is
again a Gaussian, E_p[ψ_j(t)] = N(μ; c_j, σ² + s_j²) (`gaussian_expectation`). As σ → 0 this
is ψ(μ): the read-out becomes the signal's value at μ.

Everything here is a pure function of tensors; `RBFMemory` bundles the buffers one
configuration needs (basis, the ridge operator of the memory update, histogram bins).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

_MASK32 = 0xFFFFFFFF


def rbf_basis(n_basis: int, widths: Sequence[float]) -> tuple[Tensor, Tensor]:
    """Centres and widths of N Gaussian RBFs: N / len(widths) centres evenly over [0, 1]
    (ends included) for each width. Returns (centres (N,), widths (N,)) in float64."""
    if n_basis % len(widths):
        raise ValueError(f"n_basis {n_basis} is not a multiple of the number of widths {len(widths)}")
    per_width = n_basis // len(widths)
    centres = torch.linspace(0.0, 1.0, per_width, dtype=torch.float64).repeat(len(widths))
    sigma = torch.tensor(list(widths), dtype=torch.float64).repeat_interleave(per_width)
    return centres, sigma


def evaluate_basis(t: Tensor, centres: Tensor, widths: Tensor) -> Tensor:
    """ψ(t): t (...,) -> (..., N), each ψ_j a Gaussian density N(t; c_j, s_j²)."""
    z = (t[..., None] - centres) / widths
    return torch.exp(-0.5 * z * z) / (widths * math.sqrt(2 * math.pi))


def ridge_operator(positions: Tensor, centres: Tensor, widths: Tensor, penalty: float) -> Tensor:
    """G = (ΨΨᵀ + λI)⁻¹ Ψ ∈ R^{N×P} for P positions, so that B = G X fits X ∈ R^{P×d}.
    Computed in float64 (ΨΨᵀ is badly conditioned when widths overlap)."""
    psi = evaluate_basis(positions.double(), centres.double(), widths.double()).T  # (N, P)
    gram = psi @ psi.T + penalty * torch.eye(psi.shape[0], dtype=torch.float64)
    return torch.linalg.solve(gram, psi)


def gaussian_expectation(mu: Tensor, sigma_sq: Tensor, centres: Tensor, widths: Tensor) -> Tensor:
    """E_{t~N(μ,σ²)}[ψ(t)] in closed form: N(μ; c_j, σ² + s_j²). mu, sigma_sq (...,) -> (..., N)."""
    variance = sigma_sq[..., None] + widths * widths
    diff = mu[..., None] - centres
    return torch.exp(-0.5 * diff * diff / variance) * torch.rsqrt(2 * math.pi * variance)


class _GridGaussianExpectation(torch.autograd.Function):
    """`gaussian_expectation` for a basis laid out as G widths × C shared centres (the layout of
    `rbf_basis`), with a hand-written backward: a few passes over the (..., N) output each way, where
    autograd through the generic formula takes a dozen."""

    @staticmethod
    def forward(ctx, mu: Tensor, sigma_sq: Tensor, grid: Tensor, group_widths: Tensor) -> Tensor:
        inv_var = (sigma_sq[..., None] + group_widths * group_widths).reciprocal()  # (..., G)
        diff = mu[..., None] - grid  # (..., C)
        out = torch.exp((diff * diff)[..., None, :] * (-0.5 * inv_var)[..., None])  # (..., G, C)
        out.mul_(torch.sqrt(inv_var * (1 / (2 * math.pi)))[..., None])
        ctx.save_for_backward(out, diff, inv_var)
        return out.flatten(-2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out, diff, inv_var = ctx.saved_tensors
        weighted = grad.view(out.shape) * out  # (..., G, C)
        by_diff = weighted * diff[..., None, :]
        s0 = weighted.sum(-1)  # (..., G): Σ_c g f, Σ_c g f d, Σ_c g f d²
        s1 = by_diff.sum(-1)
        s2 = (by_diff * diff[..., None, :]).sum(-1)
        # ∂f/∂μ = -f d / v;  ∂f/∂σ² = f (d²/v - 1) / (2v)
        grad_mu = -(inv_var * s1).sum(-1)
        grad_sigma_sq = 0.5 * (inv_var * (inv_var * s2 - s0)).sum(-1)
        return grad_mu, grad_sigma_sq, None, None


def grid_gaussian_expectation(mu: Tensor, sigma_sq: Tensor, grid: Tensor, group_widths: Tensor) -> Tensor:
    """Same as `gaussian_expectation` with centres = grid repeated per width and widths =
    group_widths repeated per centre (N = G·C, width-major). mu, sigma_sq (...,) -> (..., N)."""
    return _GridGaussianExpectation.apply(mu, sigma_sq, grid, group_widths)


def gaussian_bin_mass(mu: Tensor, sigma_sq: Tensor, edges: Tensor) -> Tensor:
    """Probability that t ~ N(μ, σ²) falls in each bin [e_k, e_{k+1}). mu, sigma_sq (...,),
    edges (K+1,) -> (..., K)."""
    z = (edges - mu[..., None]) * torch.rsqrt(2 * sigma_sq[..., None])
    cdf = 0.5 * (1 + torch.erf(z))
    return cdf[..., 1:] - cdf[..., :-1]


def kl_to_gaussian(mu: Tensor, sigma_sq: Tensor, sigma0: float, mu0: float | None = None) -> Tensor:
    """KL(N(μ, σ²) || N(μ₀, σ₀²)), elementwise. With mu0=None the (μ - μ₀)² term is left out,
    so only the width is regularised (what the authors did for language modelling)."""
    ratio = sigma_sq / (sigma0 * sigma0)
    kl = 0.5 * (ratio - torch.log(ratio) - 1)
    if mu0 is not None:
        kl = kl + 0.5 * (mu - mu0) ** 2 / (sigma0 * sigma0)
    return kl


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mixing function on int64 tensors holding values in [0, 2^32)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def counter_uniforms(seeds: Tensor, stream: int, n: int) -> Tensor:
    """n uniforms in (0, 1) per row, a pure function of (seed, stream, index): the same on every
    device and whatever else is in the batch. seeds (R,) int64 -> (R, n) float64."""
    index = torch.arange(n, device=seeds.device, dtype=torch.int64)
    key = _hash32(_hash32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32))
    key = _hash32(key ^ (stream & _MASK32))
    bits = _hash32(key[:, None] ^ _hash32(index)[None, :])
    return (bits.double() + 0.5) / 2.0**32


def sample_from_histogram(histogram: Tensor, uniforms: Tensor, edges: Tensor) -> Tensor:
    """Inverse-CDF sampling from a piecewise-constant density on [0, 1].

    histogram (R, K) non-negative bin weights (all zero means uniform), uniforms (R, M) in
    (0, 1), edges (K+1,). Returns (R, M) points, in the order of `uniforms` (sorted uniforms
    give sorted points)."""
    weights = histogram.double()
    total = weights.sum(-1, keepdim=True)
    floor = 1e-6 * total / weights.shape[-1] + 1e-30  # every bin keeps a sliver of mass
    probs = (weights + floor) / (total + floor * weights.shape[-1])
    cdf = torch.cat([probs.new_zeros(probs.shape[0], 1), probs.cumsum(-1)], dim=-1)  # (R, K+1)
    u = uniforms.double() * cdf[:, -1:]
    k = (torch.searchsorted(cdf.contiguous(), u.contiguous(), right=True) - 1).clamp(0, weights.shape[-1] - 1)
    left = cdf.gather(1, k)
    mass = probs.gather(1, k)
    e = edges.double()
    within = ((u - left) / mass).clamp(0.0, 1.0)
    return (e[k] + within * (e[k + 1] - e[k])).to(histogram.dtype)


class RBFMemory(nn.Module):
    """The fixed geometry of an unbounded continuous memory (no parameters, only buffers).

    The memory signal lives on [0, 1]. An update ("contraction") takes the old signal, reads it
    at M points s_1 < ... < s_M of [0, 1], puts those values at evenly spaced positions of
    [0, τ], puts the L new vectors at evenly spaced positions of (τ, 1], and refits B. The
    positions of the refit never change, so its ridge operator is a buffer. With evenly spaced
    read points s_i the old signal is squeezed into [0, τ] with its shape intact; with sticky
    memories the s_i are drawn where attention put its mass, and those regions get more of
    [0, τ] (more basis functions) than the rest.
    """

    def __init__(self, n_basis: int, widths: Sequence[float], segment_len: int, n_samples: int,
                 tau: float, ridge_penalty: float, n_bins: int):
        super().__init__()
        if not 0.0 < tau < 1.0:
            raise ValueError(f"tau must lie in (0, 1), got {tau}")
        centres, sigma = rbf_basis(n_basis, widths)
        self.register_buffer("grid", centres[: n_basis // len(widths)].float(), persistent=False)
        self.register_buffer("group_widths", torch.tensor(list(widths), dtype=torch.float32), persistent=False)
        old = tau * (torch.arange(n_samples, dtype=torch.float64) + 0.5) / n_samples
        new = tau + (1 - tau) * (torch.arange(segment_len, dtype=torch.float64) + 0.5) / segment_len
        self.n_samples = n_samples
        self.register_buffer("centres", centres.float(), persistent=False)
        self.register_buffer("widths", sigma.float(), persistent=False)
        # (N, M + L): B_new = G [X̄_old(s); X_new]
        update = ridge_operator(torch.cat([old, new]), centres, sigma, ridge_penalty)
        self.register_buffer("update_operator", update.float(), persistent=False)
        # evenly spaced read points, the contraction without sticky memories
        even = (torch.arange(n_samples, dtype=torch.float64) + 0.5) / n_samples
        self.register_buffer("even_points", even.float(), persistent=False)
        self.register_buffer("bin_edges", torch.linspace(0.0, 1.0, n_bins + 1), persistent=False)

    def evaluate(self, coefficients: Tensor, t: Tensor) -> Tensor:
        """X̄(t) = Bᵀψ(t): coefficients (R, N, d), t (R, P) -> (R, P, d)."""
        return evaluate_basis(t, self.centres, self.widths) @ coefficients

    def expectation(self, mu: Tensor, sigma_sq: Tensor) -> Tensor:
        """E_{N(μ,σ²)}[ψ(t)]: mu, sigma_sq (...,) -> (..., N)."""
        return grid_gaussian_expectation(mu, sigma_sq, self.grid, self.group_widths)

    def bin_mass(self, mu: Tensor, sigma_sq: Tensor) -> Tensor:
        return gaussian_bin_mass(mu, sigma_sq, self.bin_edges)

    def sticky_points(self, histogram: Tensor, seeds: Tensor, stream: int) -> Tensor:
        """M sorted read points drawn from the attention histogram, deterministic in (seed, stream)."""
        uniforms = counter_uniforms(seeds, stream, self.n_samples).sort(dim=-1).values
        return sample_from_histogram(histogram, uniforms, self.bin_edges)

    def update(self, coefficients: Tensor, new: Tensor, read_points: Tensor) -> Tensor:
        """Contract the old signal into [0, τ], append `new` on (τ, 1], refit.
        coefficients (R, N, d), new (R, L, d), read_points (R, M) -> (R, N, d)."""
        old = self.evaluate(coefficients, read_points)  # (R, M, d)
        return self.update_operator @ torch.cat([old, new], dim=1)
