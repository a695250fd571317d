"""The Performer: causal FAVOR+ attention, whose memory of the past is a fixed-size sum.

Paper: Krzysztof Choromanski, Valerii Likhosherstov, David Dohan, Xingyou Song, Andreea Gane,
Tamas Sarlos, Peter Hawkins, Jared Davis, Afroz Mohiuddin, Lukasz Kaiser, David Belanger, Lucy
Colwell, Adrian Weller, "Rethinking Attention with Performers", ICLR 2021.

Attention. Softmax attention weighs key j for query i by exp(q_iᵀk_j / √D). FAVOR+ replaces that
kernel by an unbiased estimate with m positive orthogonal random features (section 2.3-2.4,
`orthogonal_random_matrix`, `favor_features`):

    phi(x) = exp(wᵀx − |x|²/2) / sqrt(m),    x = q / D^¼ or k / D^¼,    E[phi(q)ᵀphi(k)] = exp(qᵀk/√D)

over m orthogonal rows w of a matrix W (m × D), and computes causal (unidirectional) attention by
prefix sums (section 2.6):

    out_i = phi(q_i)ᵀ S_i / (phi(q_i)ᵀ z_i)
    S_i = Σ_{j≤i} phi(k_j) v_jᵀ  (m × D),    z_i = Σ_{j≤i} phi(k_j)  (m)

which is exactly the explicit causal attention with weights phi(q_i)ᵀphi(k_j), j ≤ i, each row
divided by its sum (tests/models/test_performer.py builds that T × T matrix and compares). A
call computes it block by block (`causal_favor_attention`): within a block of positions the
masked products phi(Q)phi(K)ᵀ, across blocks the running S and z; the same sums in another order.

Random features. W is drawn once per layer (shared by its heads) when the model is built and
saved in the checkpoint as a buffer (`features`). It is never redrawn, in training or serving:
the state's sums are sums over phi, so another W would give the stored sums another meaning.
(The paper also redraws W from time to time during training; a fixed W is what a server of
states needs.)

Overflow. The paper's phi(x) = exp(wᵀx − |x|²/2)/√m has the exponent |w|²/2 − |x − w|²/2: in
float32 it overflows for x near a long feature row (|w|²/2 > ~88) and underflows to 0 for every
feature of a long x, after which phi(q)ᵀz = 0 and the output is 0/0. So the product
phi_r(q) phi_r(k) is split into a key factor exp(−|k − w_r|²/2) and a query factor
exp(w_rᵀq + |w_r|²/2 − c_q) (`key_features` / `query_features`), each at most 1:
- the key factor is bounded by construction (wᵀk − |k|²/2 − |w|²/2 = −|k − w|²/2 <= 0) and uses
  no stabiliser that depends on other keys, so a key contributes the same numbers to S and z in
  every chunking: this is what keeps chunking exact (only the order of additions differs), with
  nothing in the state but the sums; each entry of z grows by at most 1 per token (after 100k
  tokens z <= 1e5, far inside float32);
- the query's own largest exponent c_q is subtracted (and |q|²/2 dropped): a factor common to the
  numerator and the denominator of out_i, which cancels exactly; its largest factor is 1.
(A running maximum over keys, the other usual stabiliser, would have to live in the state and
rescale S and z whenever it grows, and a per-chunk maximum would make a key's contribution
depend on the keys after it in its chunk; the fixed bound needs neither.)
The price is underflow of distant keys: a key farther than about 13 (√(2·87)) from every w_r, in
units of the scaled key, contributes nothing to S and z; its unnormalised weight would have been
at most m·e^−87 for any query, negligible beside any key near a feature row the query favours.
Only if every key so far is that far does a query have nothing to attend to; it then outputs 0
rather than NaN (the denominator is clamped at float32's smallest normal number).
All feature and sum arithmetic is float32 whatever the model's dtype. Float32 sums keep about
seven significant digits: after n tokens a new key's contribution to z is rounded to about
n·6e-8 (0.006 at 100k tokens), a limit of undecayed prefix sums in float32, not an overflow.

Positions. FAVOR+ has no positional bias, and the prefix sums forget the order of the past. Each
layer therefore passes its normalised input through a causal depthwise convolution of width K
(`conv_width`, a short-range token shift) before projecting q, k and v, so every key and value
describes its position together with the K − 1 positions before it, and the next layers build
longer-range order from that. Why this and not rotary embeddings before the feature map: the
convolution needs only the last K − 1 inputs per layer (constant state), depends on no absolute
position, so it means the same after 100k tokens as after ten (rotary angles of large float32
positions lose precision), and it is identical in every chunking. Absolute learned positions
would cap the context, which a constant-state model has no reason to do.

State between calls (`KernelSums`): per layer and head S (m × D)
and z (m), per layer the last K − 1 normalised inputs, and the token count. Its size depends on
the config only, never on the history: constant. Decoding one token costs O(H·m·D) per layer for
the attention, whatever the history's length.

Chunking: each output is a function of the tokens up to it only, the same function whatever the
chunking (the convolution reads the same K inputs, S and z hold the same sums), so feeding a
text in one call or in chunks of any size down to one token gives the same log-probabilities, to
float32 rounding (the sums are added in another order).

Training: the standard next-byte loss over segments, with the state carried from one segment to
the next and detached (no gradient through it), as Transformer-XL carries its memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import FixedShapeState, LanguageModel, TransformerConfig
from xlserve.models.layers.feedforward import FeedForward
from xlserve.models.layers.init import init_weights

BLOCK = 64  # positions whose causal products are formed explicitly at once (memory B·H·BLOCK² per layer)


@dataclass
class PerformerConfig(TransformerConfig):
    """vocab_size, n_layer, d_model, n_head, d_head and d_inner: TransformerConfig's (models/interface.py)."""

    n_features: int = 96  # m: random features per head (the state holds m × D + m numbers per head and layer)
    conv_width: int = 4  # K: the causal convolution before attention sees this position and K − 1 before it
    dropout: float = 0.0  # on embeddings, attention output and feed-forward
    layer_norm_epsilon: float = 1e-5
    tie_embedding: bool = True  # the next-byte softmax shares the input embedding matrix


# -- the state between calls -----------------------------------------------------------------------


@dataclass
class KernelSums(FixedShapeState):
    """The prefix sums of causal kernel attention over every position seen so far, and the last
    few normalised inputs of each layer's causal convolution. Every shape is set by the config,
    never by the history's length, so rows of any histories batch with the default `concat`, and
    a session's bytes are the same after ten tokens or a million.

    Per layer l (lists indexed by layer), batch on dimension 0:

    value_sums[l]: (B, H, m, D) float32, S = Σ_j phi(k_j) v_jᵀ over every position seen
    key_sums[l]: (B, H, m) float32, z = Σ_j phi(k_j)
        (phi is the key factor of `key_features`: every entry in [0, 1], so each
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
    def stored_dtype(cls, name: str, dtype: torch.dtype) -> torch.dtype:
        """The running sums stay float32 in a float16 store: most entries of z are far below
        float16's smallest normal number (phi's entries are tiny), and 57-77% of them rounded to 0
        at a commit, taking their values' sums with them (held-out 1.91 -> 2.29-2.55 bits per
        byte on performer-stdlib). bfloat16 has float32's range: there they are halved as every
        state is (within 0.001 bits per byte)."""
        if dtype == torch.float16 and name.split(".")[0] in ("value_sums", "key_sums"):
            return torch.float32
        return super().stored_dtype(name, dtype)

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


# -- positive orthogonal random features (FAVOR+) --------------------------------------------------
# The softmax kernel SM(x, y) = exp(xᵀy) is the expectation over w ~ N(0, I_d) of
#
#     phi(x)ᵀ phi(y),    phi(x) = exp(wᵀx − |x|²/2) / sqrt(m)    (m features w_1 .. w_m)
#
# (the paper's Lemma 1, the positive features: every feature is > 0, so attention weights built
# from them are positive and their row sums never cancel to 0). Drawing the w_r *orthogonal* to
# each other (blocks of d exactly orthogonal directions, each row's length drawn as the length of
# a Gaussian vector, so every row is still marginally N(0, I_d)) lowers the estimator's variance
# (their Theorem 2): `orthogonal_random_matrix`.
#
# `favor_features` is the paper's phi itself; it overflows and underflows in float32 (module
# docstring, "Overflow"), so the layer uses the same product split into two factors that are each
# at most 1:
#
#     phi_r(q) phi_r(k) · m = exp(w_rᵀq + |w_r|²/2 − |q|²/2) · exp(−|k − w_r|²/2)
#
# since w_rᵀk − |k|²/2 − |w_r|²/2 = −|k − w_r|²/2 (`key_features`, `query_features`).


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


# -- the model -------------------------------------------------------------------------------------


def causal_favor_attention(
    query_phi: Tensor,  # (B, H, T, m) float32, non-negative
    key_phi: Tensor,  # (B, H, T, m) float32, non-negative
    values: Tensor,  # (B, H, T, D) float32
    value_sums: Tensor,  # (B, H, m, D) S before these positions
    key_sums: Tensor,  # (B, H, m) z before these positions
    block: int = BLOCK,
) -> tuple[Tensor, Tensor, Tensor]:
    """out_i = phi(q_i)ᵀ S_i / phi(q_i)ᵀ z_i with S_i, z_i the prefix sums up to and including
    position i. -> outputs (B, H, T, D), S and z after the last position."""
    T = query_phi.shape[2]
    outputs = []
    for start in range(0, T, block):
        q = query_phi[:, :, start : start + block]  # (B, H, C, m)
        k = key_phi[:, :, start : start + block]
        v = values[:, :, start : start + block]  # (B, H, C, D)
        within = (q @ k.transpose(-1, -2)).tril()  # (B, H, C, C): phi(q_i)ᵀphi(k_j), j <= i in the block
        numerator = q @ value_sums + within @ v  # (B, H, C, D)
        denominator = (q @ key_sums.unsqueeze(-1)).squeeze(-1) + within.sum(-1)  # (B, H, C)
        # >= 0; exactly 0 only if every key's features underflowed: output 0, not NaN
        outputs.append(numerator / denominator.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1))
        value_sums = value_sums + k.transpose(-1, -2) @ v  # (B, H, m, D)
        key_sums = key_sums + k.sum(dim=2)  # (B, H, m)
    return torch.cat(outputs, dim=2), value_sums, key_sums


class PerformerLayer(nn.Module):
    """Pre-norm layer: causal depthwise convolution of the normalised input, FAVOR+ causal
    attention, feed-forward."""

    def __init__(self, config: PerformerConfig):
        super().__init__()
        c = config
        self.config = c
        self.attn_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        # depthwise causal convolution: output t = Σ_s conv_weight[:, s] * input[t − (K − 1) + s] + conv_bias
        self.conv_weight = nn.Parameter(torch.zeros(c.d_model, c.conv_width))
        self.conv_bias = nn.Parameter(torch.zeros(c.d_model))
        self.qkv_net = nn.Linear(c.d_model, 3 * c.n_head * c.d_head, bias=False)
        self.o_net = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)
        self.ff_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.ff = FeedForward(c.d_model, c.d_inner, c.dropout)
        self.drop = nn.Dropout(c.dropout)
        # W: the random features, part of the checkpoint, never redrawn (see the module docstring)
        self.register_buffer("features", orthogonal_random_matrix(c.n_features, c.d_head), persistent=True)

    def convolve(self, h: Tensor, recent: Tensor) -> tuple[Tensor, Tensor]:
        """h (B, T, d_model) normalised inputs after `recent` (B, K − 1, d_model) -> the causal
        convolution (B, T, d_model) and the last K − 1 inputs for the next call."""
        K = self.config.conv_width
        T = h.shape[1]
        padded = torch.cat([recent, h], dim=1)  # (B, K − 1 + T, d_model)
        out = self.conv_bias + sum(padded[:, s : s + T] * self.conv_weight[:, s] for s in range(K))
        return out, padded[:, padded.shape[1] - (K - 1) :]

    def forward(self, x: Tensor, value_sums: Tensor, key_sums: Tensor, recent: Tensor):
        """x (B, T, d_model) and this layer's state -> output (B, T, d_model), S, z, recent inputs."""
        c = self.config
        B, T, _ = x.shape
        mixed, recent = self.convolve(self.attn_norm(x), recent)
        q, k, v = self.qkv_net(mixed).view(B, T, 3, c.n_head, c.d_head).permute(2, 0, 3, 1, 4)  # (B, H, T, D) each
        scale = c.d_head ** -0.25  # phi(q / D^¼)ᵀphi(k / D^¼) estimates exp(qᵀk / √D)
        query_phi = query_features(q * scale, self.features)  # (B, H, T, m)
        key_phi = key_features(k * scale, self.features)  # (B, H, T, m)
        attended, value_sums, key_sums = causal_favor_attention(query_phi, key_phi, v.float(), value_sums, key_sums)
        attended = attended.to(x.dtype).transpose(1, 2).reshape(B, T, c.n_head * c.d_head)  # (B, T, H·D)
        x = x + self.drop(self.o_net(attended))
        x = x + self.ff(self.ff_norm(x))
        return x, value_sums, key_sums, recent


class Performer(LanguageModel):
    architecture = "performer"
    config_class = PerformerConfig
    state_class = KernelSums
    state_kind = "linear"
    state_grows_with_context = False  # S, z and K − 1 inputs per layer, whatever the history
    chunking_invariant = True  # the module docstring's chunking semantics

    def __init__(self, config: PerformerConfig):
        super().__init__()
        c = config
        self.config = c
        if c.n_features < 1 or c.conv_width < 1:
            raise ValueError("n_features and conv_width must be at least 1")
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(PerformerLayer(c) for _ in range(c.n_layer))
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.head = nn.Linear(c.d_model, c.vocab_size)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        init_weights(self, [layer.conv_weight for layer in self.layers])
        with torch.no_grad():
            for layer in self.layers:  # start near the identity: each position mostly sees itself
                layer.conv_weight[:, -1] += 1.0

    @property
    def max_context(self) -> int | None:
        return None  # every past token is in the sums

    # -- state --------------------------------------------------------------------------------

    def init_state(self, batch_size: int) -> KernelSums:
        c = self.config
        return KernelSums.empty(batch_size, c.n_layer, c.n_head, c.n_features, c.d_head, c.conv_width, c.d_model,
                                like=self.embedding.weight)

    def _check_tokens(self, state: KernelSums, tokens: int) -> None:
        """After t tokens every entry of z lies in [0, t] (each key feature is in [0, 1]); before
        any token every sum is 0; while fewer than K − 1 tokens have been seen, the convolution's
        padding rows are still 0."""
        for i, z in enumerate(state.key_sums):
            if bool((z < 0).any()) or float(z.max()) > tokens * (1 + 1e-4) + 1e-4:
                raise ValueError(f"state tensor 'key_sums.{i}' holds values outside [0, {tokens}], "
                                 f"impossible after {tokens} tokens")
        if tokens == 0:
            for i, s in enumerate(state.value_sums):
                if bool(s.any()):
                    raise ValueError(f"state tensor 'value_sums.{i}' is not 0 before the first token")
        padding = max(0, self.config.conv_width - 1 - tokens)
        for i, recent in enumerate(state.recent_inputs):
            if padding and bool(recent[:, :padding].any()):
                raise ValueError(f"state tensor 'recent_inputs.{i}' holds inputs before the first of {tokens} tokens")

    # -- serving ------------------------------------------------------------------------------

    def forward(self, tokens: Tensor, state: KernelSums) -> tuple[Tensor, KernelSums]:
        B, T = tokens.shape
        if T == 0:
            return torch.zeros(B, 0, self.vocab_size, device=tokens.device), state
        x = self.drop(self.embedding(tokens))  # (B, T, d_model)
        value_sums, key_sums, recent_inputs = [], [], []
        for i, layer in enumerate(self.layers):
            x, s, z, recent = layer(x, state.value_sums[i], state.key_sums[i], state.recent_inputs[i])
            # a state is a value: no gradient flows into the next call (truncated as in Transformer-XL)
            value_sums.append(s.detach())
            key_sums.append(z.detach())
            recent_inputs.append(recent.detach())
        log_probs = F.log_softmax(self.head(self.drop(self.final_norm(x))).float(), dim=-1)  # (B, T, V)
        return log_probs, KernelSums(value_sums, key_sums, recent_inputs, state.position + T)
