"""∞-former: a decoder-only language model with an unbounded continuous long-term memory.

Paper: Pedro Henrique Martins, Zita Marinho, André F. T. Martins, "∞-former: Infinite Memory
Transformer", ACL 2022.

Every layer attends to two memories and sums the two results before the residual connection:

- Short-term memory (Transformer-XL style): ordinary multi-head attention over the previous
  segment and the current segment up to the query, with relative positions
  (q_i + u)·k_j + (q_i + v)·W_kR R_{i-j} exactly as in models/transformer_xl.py
  (models/layers/relative.py).
- Long-term memory: the layer's (normalised) inputs of every earlier segment, kept as a
  continuous signal X̄(t) = Bᵀψ(t) over t ∈ [0, 1] with N Gaussian radial basis functions ψ
  (`RBFMemory`). Per head, keys K = B W_K and values V = B W_V are projections
  of the coefficients; a query q (the same query as the short-term attention's, as in the
  authors' code) defines a Gaussian density N(μ, σ²) over t with

      μ = sigmoid(w_μᵀ K q / √D),    σ² = softplus(w_σᵀ K q / √D)  (+ a floor of sigma_sq_min)

  and reads z = E_{N(μ,σ²)}[ψ(t)]ᵀ V, the expectation taken in closed form.

At the end of each segment the long-term memory is updated: the old signal is contracted into
[0, τ] (read at M points, placed evenly on [0, τ]), the segment's L states are appended on
(τ, 1], and B is refitted by ridge regression. With sticky memories (on by default, as in the
paper) the M read points are drawn from a histogram of where this segment's attention
densities put their mass, so what was attended to keeps more resolution. Training adds the KL
regulariser KL(N(μ, σ²) || N(μ₀, σ₀²)) on every density, averaged, times `kl_weight`.

Serving notes
- The state (`ContinuousMemory`) has a fixed size whatever the history: per layer B (N × d),
  the long-term keys and values derived from it, a 2L-slot buffer of short-term keys and values
  (previous segment | current segment), the current segment's inputs (to be appended to the
  long-term memory at its end), the sticky-memory histogram of the current segment, and one
  position counter per row. Decoding a token costs O((2L + N) · d) per layer, plus an update
  of O(N · (M + L) · d) once every L tokens: flat in the length of the history.
- K and V of the long-term memory are recomputed from B only when B changes (at a boundary)
  and kept in the state, the way Transformer-XL keeps projected keys instead of hidden states.
  In training they are recomputed from B in every call so that W_K and W_V get gradients; B
  itself, like Transformer-XL's memory, carries no gradient.
- Sticky-memory sampling uses a counter-based generator keyed by (segment index, layer): the
  same history always gives the same memory, on any device, in any batch, after any eviction.
- Differences from the paper's code: the memory is updated at the end of a segment, so a
  segment's own states enter the long-term memory only after the segment (while they are in
  the short-term memory); the first update contracts an empty (zero) signal. Only pre-norm
  layers.

Chunking semantics (what `forward` promises about splitting a text into calls)
- Segment boundaries sit at absolute positions k · segment_len of the history a state has
  seen, whatever the calls look like; a call may cover part of a segment or many segments, and
  the model splits it internally at those boundaries.
- Within a segment, feeding tokens one at a time gives the same log-probabilities as one pass:
  the short-term attention is causal and the long-term memory is fixed until the segment ends.
- The long-term memory is updated at segment boundaries only. Because every chunking crosses
  the boundaries at the same positions, any chunking (one call, chunks of any size, token by
  token) gives the same log-probabilities, to float tolerance (the sticky histogram is a sum
  whose order depends on the chunking).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import LanguageModel, State, TransformerConfig
from xlserve.models.layers.feedforward import FeedForward
from xlserve.models.layers.init import init_weights
from xlserve.models.layers.relative import RelativeKeys, relative_scores


@dataclass
class InfinityFormerConfig(TransformerConfig):
    """vocab_size, n_layer, d_model, n_head, d_head and d_inner: TransformerConfig's
    (models/interface.py); the n_head heads serve both the short-term and the continuous attention."""

    dropout: float = 0.0  # on embeddings, attention outputs and feed-forward
    dropatt: float = 0.0  # on short-term attention probabilities
    segment_len: int = 128  # L: long-term memory update period; short-term memory = previous segment
    n_basis: int = 128  # N: Gaussian RBFs of the long-term signal
    basis_widths: list[float] = field(default_factory=lambda: [0.01, 0.05])  # one set of centres per width
    ridge_penalty: float = 0.5  # λ of the ridge regression
    tau: float = 0.5  # the old signal is contracted into [0, tau]; the new segment fills (tau, 1]
    n_samples: int = 128  # M: points at which the old signal is read when contracting
    sticky_memories: bool = True  # read points drawn from the attention histogram (else evenly spaced)
    sticky_bins: int = 128  # bins of the sticky-memory histogram over [0, 1]
    sigma_sq_min: float = 1e-4  # floor on the variance of the attention densities
    long_term_memory: bool = True  # False switches the continuous attention off (an ablation)
    kl_weight: float = 1e-3  # weight of the mean KL regulariser in training
    kl_sigma0: float = 0.05  # σ₀ of the KL target
    kl_mu0: float | None = None  # μ₀ of the KL target; None regularises the width only
    tie_embedding: bool = True  # output softmax shares the input embedding matrix
    layer_norm_epsilon: float = 1e-5


# -- the state between calls -----------------------------------------------------------------------


@dataclass
class ContinuousMemory(State):
    """Per layer (lists indexed by layer), every tensor with the batch on dimension 0:

    coefficients[l]: (B, N, d_model) B, the long-term signal of layer l's inputs
    ltm_values[l]: (B, H, N, D) B W_V per head
    ltm_density_keys[l]: (B, H, 2, D) K_hᵀ w_μ,h and K_hᵀ w_σ,h (μ and σ² are linear in q)
    stm_keys[l], stm_values[l]: (B, H, 2L, D) slots 0..L-1 the previous segment, L..2L-1 the
        current one (filled up to position % L; the rest zero)
    segment_inputs[l]: (B, L, d_model) the current segment's normalised layer inputs
    histogram[l]: (B, sticky_bins) attention mass of the current segment's queries per bin
    position: (B,) int64, tokens seen

    Shapes never change, so sessions at different positions batch with the default concat.
    """

    coefficients: list[Tensor]
    ltm_values: list[Tensor]
    ltm_density_keys: list[Tensor]
    stm_keys: list[Tensor]
    stm_values: list[Tensor]
    segment_inputs: list[Tensor]
    histogram: list[Tensor]
    position: Tensor

    def layer(self, i: int) -> "LayerMemory":
        """Layer i's slice of the state."""
        return LayerMemory(**{f.name: getattr(self, f.name)[i] for f in fields(LayerMemory)})

    @classmethod
    def from_layers(cls, layers: list["LayerMemory"], position: Tensor) -> "ContinuousMemory":
        return cls(
            **{f.name: [getattr(m, f.name) for m in layers] for f in fields(LayerMemory)},
            position=position,
        )


@dataclass
class LayerMemory:
    """One layer's slice of a ContinuousMemory (a plain bundle, not a State)."""

    coefficients: Tensor
    ltm_values: Tensor
    ltm_density_keys: Tensor
    stm_keys: Tensor
    stm_values: Tensor
    segment_inputs: Tensor
    histogram: Tensor


# -- continuous signals over [0, 1] ----------------------------------------------------------------
# A sequence of L vectors X ∈ R^{L×d}, placed at positions t_1 < ... < t_L in [0, 1], becomes a
# continuous signal X̄(t) = Bᵀ ψ(t), where ψ(t) ∈ R^N holds N Gaussian radial basis functions
#
#     ψ_j(t) = N(t; c_j, s_j²)        (a Gaussian density: centre c_j, width s_j)
#
# with centres spread evenly over [0, 1], one set of centres per width. The coefficients
# B ∈ R^{N×d} come from ridge regression,
#
#     B = (Ψ Ψᵀ + λ I)⁻¹ Ψ X,        Ψ = [ψ(t_1), ..., ψ(t_L)] ∈ R^{N×L},
#
# and (ΨΨᵀ + λI)⁻¹Ψ depends only on the positions, so it is computed once (`ridge_operator`).
#
# Continuous attention reads the signal through a Gaussian density p = N(μ, σ²) over t:
# E_p[X̄(t)] = E_p[ψ(t)]ᵀ B, and the expectation of a Gaussian basis function under a Gaussian is
# again a Gaussian, E_p[ψ_j(t)] = N(μ; c_j, σ² + s_j²) (`gaussian_expectation`). As σ → 0 this
# is ψ(μ): the read-out becomes the signal's value at μ.
#
# Everything here is a pure function of tensors; `RBFMemory` bundles the buffers one
# configuration needs (basis, the ridge operator of the memory update, histogram bins).


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


_MASK32 = 0xFFFFFFFF  # the counter-based generator's arithmetic stays in 32 bits


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


# -- the model -------------------------------------------------------------------------------------


class InfinityLayer(nn.Module):
    """One ∞-former layer: short-term relative attention + continuous long-term attention,
    summed, then a position-wise feed-forward; pre-norm residual blocks."""

    def __init__(self, config: InfinityFormerConfig, memory: RBFMemory):
        super().__init__()
        self.config = config
        c = config
        hd = c.n_head * c.d_head
        self.memory = [memory]  # shared geometry; a list so it is not registered twice
        self.attn_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        # short-term (Transformer-XL) attention
        self.qkv_net = nn.Linear(c.d_model, 3 * hd, bias=False)  # W_q, W_kE, W_v
        self.r_net = nn.Linear(c.d_model, hd, bias=False)  # W_kR
        self.o_net = nn.Linear(hd, c.d_model, bias=False)
        # continuous long-term attention (its queries are the short-term attention's)
        self.ltm_k = nn.Linear(c.d_model, hd, bias=False)  # W_K, applied to B
        self.ltm_v = nn.Linear(c.d_model, hd, bias=False)  # W_V, applied to B
        self.ltm_density = nn.Parameter(torch.zeros(c.n_head, 2, c.n_basis))  # w_μ, w_σ per head
        self.ltm_o = nn.Linear(hd, c.d_model, bias=False)
        self.ff_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.ff = FeedForward(c.d_model, c.d_inner, c.dropout)
        self.drop = nn.Dropout(c.dropout)
        self.dropatt = nn.Dropout(c.dropatt)
        self.scale = 1.0 / math.sqrt(c.d_head)

    def forward(
        self,
        x: Tensor,  # (B, T, d_model), T <= L - offset for every row (one segment)
        memory: LayerMemory,
        offset: Tensor,  # (B,) position of x[:, 0] within its segment
        has_previous: Tensor,  # (B,) bool: a previous segment exists
        rel_keys: Tensor,  # (2L, H, D) W_kR R_d for distances 0 .. 2L-1
        r_w_bias: Tensor,  # (H, D) u
        r_r_bias: Tensor,  # (H, D) v
    ) -> tuple[Tensor, LayerMemory, Tensor | None, Tensor | None]:
        """The layer's output (B, T, d_model), its memory after x, and the long-term attention
        densities' μ and σ² (B, H, T) (None without long-term memory)."""
        c = self.config
        B, T, _ = x.shape
        L = c.segment_len
        h = self.attn_norm(x)
        q, k, v = self.qkv_net(h).view(B, T, 3, c.n_head, c.d_head).permute(2, 0, 3, 1, 4)  # (B, H, T, D)
        q = q * self.scale  # the 1/√D of every score, folded into the queries
        # the short-term memory's slots: [previous segment | current segment], this piece written in
        query_pos = offset[:, None] + torch.arange(T, device=x.device)  # (B, T) within the segment
        slots = (L + query_pos)[:, None, :, None].expand(B, c.n_head, T, c.d_head)
        keys = memory.stm_keys.scatter(2, slots, k)  # (B, H, 2L, D)
        values = memory.stm_values.scatter(2, slots, v)
        attended = self._short_term(q, keys, values, query_pos, has_previous, rel_keys, r_w_bias, r_r_bias)
        out = self.o_net(attended)

        histogram, mu, sigma_sq = memory.histogram, None, None
        if c.long_term_memory:
            context, mu, sigma_sq = self._long_term(q, memory)
            out = out + self.ltm_o(context)
            if c.sticky_memories:
                with torch.no_grad():
                    histogram = histogram + self.memory[0].bin_mass(mu.detach(), sigma_sq.detach()).sum(dim=(1, 2))

        x = x + self.drop(out)
        x = x + self.ff(self.ff_norm(x))
        return x, self._remember(memory, keys, values, h, query_pos, histogram), mu, sigma_sq

    def _short_term(self, q: Tensor, keys: Tensor, values: Tensor, query_pos: Tensor, has_previous: Tensor,
                    rel_keys: Tensor, r_w_bias: Tensor, r_r_bias: Tensor) -> Tensor:
        """Relative attention of queries q (B, H, T, D), scaled by 1/√D, over the short-term
        slots (B, H, 2L, D): slot s holds segment position s - L, so the query at segment
        position p sees the slots up to L + p, and those before L only when a previous segment
        exists. -> (B, T, H*D)"""
        B, H, T, _ = q.shape
        L = self.config.segment_len
        key_pos = torch.arange(-L, L, device=q.device)  # segment coordinate of each slot
        distance = query_pos[:, :, None] - key_pos  # (B, T, 2L)
        allowed = (distance >= 0) & ((key_pos >= 0) | has_previous[:, None, None])
        distance = distance.clamp(0, 2 * L - 1)
        # q holds the 1/√D of the scores, so u and v must hold it too
        scores = relative_scores(q.transpose(1, 2), keys.transpose(1, 2), rel_keys, distance[:, None],
                                 r_w_bias * self.scale, r_r_bias * self.scale)  # (B, H, T, 2L)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        probs = self.dropatt(torch.softmax(scores, dim=-1))
        return (probs @ values).transpose(1, 2).reshape(B, T, -1)

    @staticmethod
    def _remember(memory: LayerMemory, keys: Tensor, values: Tensor, h: Tensor, query_pos: Tensor,
                  histogram: Tensor) -> LayerMemory:
        """The layer's memory after this piece: the short-term slots with its keys and values
        (B, H, 2L, D), its normalised inputs h (B, T, d_model) at their segment positions (the
        long-term memory takes them in at the segment's end), and the updated histogram."""
        B, T, d_model = h.shape
        inputs_slots = query_pos[..., None].expand(B, T, d_model)
        return dataclasses.replace(
            memory,
            stm_keys=keys.detach(),
            stm_values=values.detach(),
            segment_inputs=memory.segment_inputs.scatter(1, inputs_slots, h.detach()),
            histogram=histogram,
        )

    def _long_term(self, q: Tensor, memory: LayerMemory) -> tuple[Tensor, Tensor, Tensor]:
        """Continuous attention of queries q (B, H, T, D), scaled by 1/√D: each query's density
        N(μ, σ²) over [0, 1] and what it reads, z = E[ψ(t)]ᵀ V. -> z (B, T, H*D), μ, σ² (B, H, T)."""
        c = self.config
        B, _, T, _ = q.shape
        if self.training:  # recompute from B so that W_K, W_V and w_μ, w_σ learn
            ltm_values, density_keys = self.long_term_projections(memory.coefficients)
        else:
            ltm_values, density_keys = memory.ltm_values, memory.ltm_density_keys
        logits = q @ density_keys.transpose(2, 3)  # (B, H, T, 2): w_μᵀ K q / √D and w_σᵀ K q / √D
        mu = torch.sigmoid(logits[..., 0])  # (B, H, T)
        sigma_sq = F.softplus(logits[..., 1]) + c.sigma_sq_min
        weights = self.memory[0].expectation(mu, sigma_sq)  # (B, H, T, N)
        return (weights @ ltm_values).transpose(1, 2).reshape(B, T, -1), mu, sigma_sq

    def long_term_projections(self, coefficients: Tensor) -> tuple[Tensor, Tensor]:
        """From B (R, N, d): values B W_V (R, H, N, D) and density keys (R, H, 2, D), the
        vectors K_hᵀw_μ,h and K_hᵀw_σ,h with K = B W_K, computed as W_K,hᵀ(Bᵀw) so that K itself
        is never formed (w_μᵀ K q = (Kᵀw_μ)·q)."""
        c = self.config
        R, N, _ = coefficients.shape
        values = self.ltm_v(coefficients).view(R, N, c.n_head, c.d_head).transpose(1, 2).contiguous()
        mixed = torch.einsum("hsn,rnd->rhsd", self.ltm_density, coefficients)  # (R, H, 2, d_model)
        w_k = self.ltm_k.weight.view(c.n_head, c.d_head, c.d_model)
        density_keys = torch.einsum("rhsd,hed->rhse", mixed, w_k)
        return values, density_keys

    @torch.no_grad()
    def end_segment(self, memory: LayerMemory, segment_index: Tensor, layer_index: int) -> LayerMemory:
        """The boundary update for rows whose segment is complete (all rows of `memory`):
        contract and refit the long-term signal, shift the short-term memory, clear the rest."""
        c = self.config
        L = c.segment_len
        geometry = self.memory[0]
        if c.sticky_memories:
            points = geometry.sticky_points(memory.histogram, segment_index, stream=layer_index)
        else:
            points = geometry.even_points.expand(memory.histogram.shape[0], -1)
        coefficients = geometry.update(memory.coefficients, memory.segment_inputs, points)
        ltm_values, density_keys = self.long_term_projections(coefficients)
        shift = lambda t: torch.cat([t[:, :, L:], torch.zeros_like(t[:, :, L:])], dim=2)  # noqa: E731
        return LayerMemory(
            coefficients=coefficients,
            ltm_values=ltm_values,
            ltm_density_keys=density_keys,
            stm_keys=shift(memory.stm_keys),
            stm_values=shift(memory.stm_values),
            segment_inputs=torch.zeros_like(memory.segment_inputs),
            histogram=torch.zeros_like(memory.histogram),
        )


class InfinityFormer(LanguageModel):
    architecture = "infinity-former"
    config_class = InfinityFormerConfig
    state_class = ContinuousMemory
    state_kind = "continuous"
    state_grows_with_context = False  # fixed size, whatever the history
    chunking_invariant = True  # the module docstring's chunking semantics

    def __init__(self, config: InfinityFormerConfig):
        super().__init__()
        self.config = config
        c = config
        self.geometry = RBFMemory(
            c.n_basis, c.basis_widths, c.segment_len, c.n_samples, c.tau, c.ridge_penalty, c.sticky_bins
        )
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(InfinityLayer(c, self.geometry) for _ in range(c.n_layer))
        # W_kR R_d for the 2L distances the short-term memory spans, no more
        self.relative_keys = RelativeKeys(c.d_model, c.n_head, c.d_head, c.dropout, min_length=0)
        self.r_w_bias = nn.Parameter(torch.zeros(c.n_layer, c.n_head, c.d_head))  # u
        self.r_r_bias = nn.Parameter(torch.zeros(c.n_layer, c.n_head, c.d_head))  # v
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.head = nn.Linear(c.d_model, c.vocab_size)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        init_weights(self, [self.r_w_bias, self.r_r_bias, *(layer.ltm_density for layer in self.layers)])

    # --- state -------------------------------------------------------------------------------

    def init_state(self, batch_size: int) -> ContinuousMemory:
        c = self.config
        p = self.embedding.weight
        zeros = lambda *shape: p.new_zeros(batch_size, *shape)  # noqa: E731
        per_layer = lambda *shape: [zeros(*shape) for _ in range(c.n_layer)]  # noqa: E731
        L = c.segment_len
        return ContinuousMemory(
            coefficients=per_layer(c.n_basis, c.d_model),
            ltm_values=per_layer(c.n_head, c.n_basis, c.d_head),
            ltm_density_keys=per_layer(c.n_head, 2, c.d_head),
            stm_keys=per_layer(c.n_head, 2 * L, c.d_head),
            stm_values=per_layer(c.n_head, 2 * L, c.d_head),
            segment_inputs=per_layer(L, c.d_model),
            histogram=per_layer(c.sticky_bins),
            position=torch.zeros(batch_size, dtype=torch.int64, device=p.device),
        )

    def check_state(self, state: State, tokens: int | None = None) -> None:
        super().check_state(state, tokens)
        if (state.position < 0).any():
            raise ValueError("state position must be non-negative")

    def with_long_term_memory(self, enabled: bool) -> "InfinityFormer":
        """A view of this model (same parameters) with the continuous attention on or off."""
        view = copy.copy(self)
        view.config = dataclasses.replace(self.config, long_term_memory=enabled)
        view._modules = dict(self._modules)
        view._modules["layers"] = nn.ModuleList(copy.copy(layer) for layer in self.layers)
        for layer in view.layers:
            layer.config = view.config
        return view

    # --- forward -------------------------------------------------------------------------------

    def forward(self, tokens: Tensor, state: ContinuousMemory) -> tuple[Tensor, ContinuousMemory]:
        log_probs, state, _ = self._run(tokens, state, with_kl=False)
        return log_probs, state

    def training_loss(self, inputs: Tensor, targets: Tensor, state: ContinuousMemory, fraction_done: float):
        """Next-byte NLL + kl_weight * mean KL(N(μ, σ²) || N(μ₀, σ₀²)) over every density."""
        log_probs, state, kl = self._run(inputs, state, with_kl=True)
        nll = -log_probs.gather(-1, targets[..., None]).mean()
        return nll + self.config.kl_weight * kl, state

    def _run(self, tokens: Tensor, state: ContinuousMemory, with_kl: bool):
        """Log-probabilities (B, T, V), the state after `tokens` and, with `with_kl`, the mean KL
        regulariser over every density (None without)."""
        c = self.config
        L = c.segment_len
        B, T = tokens.shape
        if T == 0:
            return self.embedding.weight.new_zeros(B, 0, c.vocab_size).float(), state, None
        seen = state.position.tolist()  # tokens seen per row (one host sync per call)
        _, rel_keys = self.relative_keys([layer.r_net for layer in self.layers], 0, 2 * L - 1, like=self.embedding.weight)
        x_all = self.drop(self.embedding(tokens) * math.sqrt(c.d_model))  # (B, T, d_model)
        memories = [state.layer(i) for i in range(c.n_layer)]
        position = state.position
        outputs, kl_sum, kl_count = [], 0.0, 0
        for start, end in self._pieces(seen, T):
            offset = position % L
            has_previous = position >= L
            x = x_all[:, start:end]
            for i, layer in enumerate(self.layers):
                x, memories[i], mu, sigma_sq = layer(
                    x, memories[i], offset, has_previous, rel_keys[i], self.r_w_bias[i], self.r_r_bias[i]
                )
                if with_kl and mu is not None:
                    kl = kl_to_gaussian(mu, sigma_sq, c.kl_sigma0, c.kl_mu0)
                    kl_sum = kl_sum + kl.sum()
                    kl_count += kl.numel()
            outputs.append(x)
            position = position + (end - start)
            seen = [p + end - start for p in seen]
            done = [p % L == 0 for p in seen]
            if any(done):
                memories = self._end_segment(memories, done, position // L - 1)
        x = self.drop(self.final_norm(torch.cat(outputs, dim=1)))
        log_probs = F.log_softmax(self.head(x).float(), dim=-1)  # (B, T, V)
        kl_mean = kl_sum / kl_count if kl_count else None
        if with_kl and kl_mean is None:
            kl_mean = x.new_zeros(())
        return log_probs, ContinuousMemory.from_layers(memories, position), kl_mean

    def _pieces(self, seen: list[int], T: int) -> list[tuple[int, int]]:
        """(start, end) of the pieces of a call of T tokens cut wherever any row, having seen
        `seen[b]` tokens before, reaches a segment boundary: no piece crosses one."""
        L = self.config.segment_len
        cuts = {0, T}
        for p in seen:
            cuts.update(range(L - p % L, T, L))
        cuts = sorted(cuts)
        return list(zip(cuts[:-1], cuts[1:]))

    def _end_segment(self, memories: list[LayerMemory], done: list[bool], segment_index: Tensor) -> list[LayerMemory]:
        """Apply the boundary update to the rows where `done`, leave the others as they are."""
        if all(done):
            return [layer.end_segment(m, segment_index, i) for i, (layer, m) in enumerate(zip(self.layers, memories))]
        rows = torch.tensor([b for b, d in enumerate(done) if d], device=segment_index.device)
        updated = []
        for i, (layer, memory) in enumerate(zip(self.layers, memories)):
            picked = LayerMemory(**{k: v[rows] for k, v in vars(memory).items()})
            result = layer.end_segment(picked, segment_index[rows], i)
            updated.append(LayerMemory(**{
                k: getattr(memory, k).index_copy(0, rows, getattr(result, k).to(getattr(memory, k).dtype))
                for k in vars(memory)
            }))
        return updated
