"""Mamba: a language model of selective state spaces, whose memory of the past is a fixed-size state.

Paper: Albert Gu, Tri Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces",
2023 (arXiv:2312.00752). Served as Hugging Face's `MambaForCausalLM` computes it (the
state-spaces/mamba-*-hf checkpoints convert with `xlserve convert`, models/convert/mamba.py).

A block (section 3.4, figure 3) is pre-norm (RMSNorm) and residual around one mixer:

    x, gate = in_proj(h)                         two streams of width E = expand · d_model
    u = silu(causal depthwise conv_K(x))          a short convolution over the last K positions
    Δ, B, C = softplus(dt_proj(Δ_low)), B, C      from x_proj(u): the *selection*, per position
    h_t = exp(Δ_t A) ⊙ h_{t−1} + (Δ_t u_t) B_tᵀ   per channel e an N-dimensional state, A < 0 diagonal
    y_t = C_t · h_t + D ⊙ u_t
    out = out_proj(y ⊙ silu(gate))

with A = −exp(A_log) (E × N) and D (E) learned, Δ (E per position) through a low-rank
projection of width `dt_rank`. The paper's discretisation of B is the simplified Euler one,
Δ_t B_t, as the reference implementation and transformers use.

Prefill: a chunked scan in plain torch (`selective_scan`). Within a chunk of `chunk_size`
positions the recurrence unrolls to

    h_t = exp(P_t) ⊙ (h_0 + Σ_{s≤t} exp(−P_s) ⊙ Δ_s u_s B_s),    P_t = Σ_{s≤t} Δ_s A   (≤ 0)

two cumulative sums, no loop over positions; across chunks the state is carried sequentially.
exp(−P_s) grows as the chunk decays, so a chunk whose total decay |P| passes SCAN_EXPONENT_LIMIT
is split in two (down to single positions, the plain recurrence): every exponent stays inside
float32's range, and the rounding of each h_t stays relative to its own inputs (the terms of
the sum up to t are at most exp(−P_t) large, and are multiplied back by exp(P_t)). Decoding one
token is the recurrence itself.

State between calls (`SelectiveState`): per layer the last K − 1 inputs of the convolution and
the N-dimensional state h of every channel, plus the token count. Constant in size: a session
holds n_layer · ((K − 1) · E + E · N) numbers after ten tokens or a million, and every output is
a function of the tokens up to it only, the same in any chunking (to float32 rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import ArchConfig, FixedShapeState, LanguageModel
from xlserve.models.layers.causal_conv import causal_depthwise_conv
from xlserve.models.layers.init import init_weights


# the largest total decay |Σ Δ A| one piece of a chunk is scanned over with the two cumulative
# sums: exp(60) ≈ 1e26 leaves float32 (max 3e38) room for inputs of any sane size
SCAN_EXPONENT_LIMIT = 60.0


@dataclass
class MambaConfig(ArchConfig):
    vocab_size: int = 256
    n_layer: int = 4
    d_model: int = 128  # width of the residual stream
    d_inner: int = 256  # E: width of the mixer's streams (the paper's expand · d_model, 2 ×)
    d_state: int = 16  # N: state size per channel
    d_conv: int = 4  # K: width of the causal convolution
    dt_rank: int = 8  # width of Δ's low-rank projection (the paper: ceil(d_model / 16))
    conv_bias: bool = True
    proj_bias: bool = False  # biases on in_proj and out_proj
    layer_norm_epsilon: float = 1e-5
    tie_embedding: bool = True
    chunk_size: int = 16  # positions per piece of the prefill scan (speed only: a piece of B · 16 · E · N
    # floats stays in the CPU's cache at mamba-130m's width, where 64 does not)


# -- the state between calls -----------------------------------------------------------------------


@dataclass
class SelectiveState(FixedShapeState):
    """Per layer l (lists indexed by layer), batch on dimension 0:

    conv_inputs[l]: (B, K − 1, E) the last K − 1 inputs of layer l's causal convolution, oldest
        first; zeros before the first token (the convolution's left padding)
    ssm[l]: (B, E, N) float32, the selective state h after the last token
    position: (B,) int64, tokens seen

    Bytes per session: n_layer · ((K − 1) · E · element size + 4 · E · N) + 8, whatever the history.
    """

    conv_inputs: list[Tensor]
    ssm: list[Tensor]
    position: Tensor

    def check_consistent(self) -> None:
        if len(self.conv_inputs) != len(self.ssm):
            raise ValueError(f"state has conv_inputs for {len(self.conv_inputs)} layers and ssm for {len(self.ssm)}")
        if tuple(self.position.shape) != (self.batch_size,):
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, "
                             f"expected ({self.batch_size},)")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' holds a negative number of tokens")


# -- the selective scan ----------------------------------------------------------------------------


def scan_piece(h0: Tensor, dt: Tensor, A: Tensor, inputs: Tensor) -> Tensor:
    """h_t = exp(Δ_t A) ⊙ h_{t−1} + inputs_t for t in the piece, from h0 (B, E, N): dt (B, L, E),
    A (E, N) ≤ 0 and inputs (B, L, E, N) float32 -> every h_t (B, L, E, N). Two cumulative sums
    (module docstring): P_t = (Σ_{s≤t} Δ_s) A, since A does not depend on the position; a piece
    that decays by more than SCAN_EXPONENT_LIMIT somewhere is scanned as two halves."""
    L = dt.shape[1]
    if L == 1:
        return (torch.exp(dt[:, 0, :, None] * A) * h0 + inputs[:, 0]).unsqueeze(1)
    elapsed = dt.cumsum(dim=1)  # (B, L, E) Σ Δ, non-decreasing
    # the most negative exponent of the piece: the longest elapsed time of a channel times its fastest decay
    if float((elapsed[:, -1].detach() * A.detach().amin(dim=1)).min()) < -SCAN_EXPONENT_LIMIT:
        half = L // 2
        first = scan_piece(h0, dt[:, :half], A, inputs[:, :half])
        return torch.cat([first, scan_piece(first[:, -1], dt[:, half:], A, inputs[:, half:])], dim=1)
    exponent = elapsed[..., None] * A  # (B, L, E, N) P_t ≤ 0
    # exp(−P_s) multiplied, never exp(P_s) divided: the gradient of a quotient holds 1 / exp(P_s)²,
    # which leaves float32's range once |P| passes about 44 (exp(−88)), and training went NaN
    return torch.exp(exponent) * (h0.unsqueeze(1) + (inputs * torch.exp(-exponent)).cumsum(dim=1))


def selective_scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h: Tensor,
                   chunk_size: int) -> tuple[Tensor, Tensor]:
    """y_t = C_t · h_t with h_t = exp(Δ_t A) h_{t−1} + Δ_t u_t B_t, for u, dt (B, T, E), A (E, N),
    B, C (B, T, N), h (B, E, N) float32 the state before -> y (B, T, E) float32 and the state after."""
    if u.shape[1] == 1:  # decoding: the recurrence itself, in as few operations as it takes
        h = torch.addcmul(torch.exp(dt[:, 0, :, None] * A) * h, (dt[:, 0] * u[:, 0])[:, :, None], B[:, 0, None, :])
        return (h @ C[:, 0, :, None]).transpose(1, 2), h  # (B, 1, E)
    outputs = []
    for start in range(0, u.shape[1], chunk_size):
        piece = slice(start, start + chunk_size)
        inputs = (dt[:, piece] * u[:, piece])[..., None] * B[:, piece, None, :]  # (B, L, E, N) Δ_t u_t B_t
        states = scan_piece(h, dt[:, piece], A, inputs)  # (B, L, E, N)
        outputs.append((states @ C[:, piece, :, None]).squeeze(-1))  # (B, L, E)
        h = states[:, -1]
    return torch.cat(outputs, dim=1), h


# -- the model -------------------------------------------------------------------------------------


class MambaMixer(nn.Module):
    """The selective SSM block of the paper's figure 3 (module docstring)."""

    def __init__(self, config: MambaConfig):
        super().__init__()
        c = config
        self.config = c
        E, N = c.d_inner, c.d_state
        self.in_proj = nn.Linear(c.d_model, 2 * E, bias=c.proj_bias)
        # depthwise causal convolution: out_t = Σ_k conv_weight[:, k] · x_{t−K+1+k} + conv_bias
        self.conv_weight = nn.Parameter(torch.empty(E, c.d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(E)) if c.conv_bias else None
        self.x_proj = nn.Linear(E, c.dt_rank + 2 * N, bias=False)
        self.dt_proj = nn.Linear(c.dt_rank, E, bias=True)
        self.A_log = nn.Parameter(torch.empty(E, N))
        self.D = nn.Parameter(torch.ones(E))
        self.out_proj = nn.Linear(E, c.d_model, bias=c.proj_bias)

    def forward(self, h: Tensor, conv_inputs: Tensor, ssm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h (B, T, d_model) normalised -> (B, T, d_model), and the layer's state after."""
        c = self.config
        x, gate = self.in_proj(h).chunk(2, dim=-1)  # (B, T, E) each
        x, conv_inputs = causal_depthwise_conv(x, conv_inputs, self.conv_weight, self.conv_bias)
        u = F.silu(x)  # (B, T, E)
        dt_low, B, C = self.x_proj(u).split([c.dt_rank, c.d_state, c.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt_low)).float()  # (B, T, E) Δ > 0
        A = self.decay_rates()  # (E, N) < 0: every channel's state decays
        y, ssm = selective_scan(u.float(), dt, A, B.float(), C.float(), ssm, c.chunk_size)
        y = torch.addcmul(y, u.float(), self.D.float()).to(h.dtype) * F.silu(gate)  # y + D ⊙ u
        return self.out_proj(y), conv_inputs, ssm

    def decay_rates(self) -> Tensor:
        """A = −exp(A_log) in float32. Outside autograd it depends on the weights alone, so it is
        kept until A_log changes (a new tensor, or its version counter moved by an in-place update):
        a decode step makes ~25 small operations per layer, and outside a micro-benchmark each
        costs tens of µs, so these two were 6 of a mamba-130m-shaped step's 42 ms. A cached
        weight, not a state: nothing of any request lives on the model."""
        if torch.is_grad_enabled() and self.A_log.requires_grad:
            return -torch.exp(self.A_log.float())
        # weights loaded under inference_mode have no version counter; no xlserve code writes a
        # loaded weight in place (a load or a conversion makes new tensors, which the pointer sees)
        version = -1 if self.A_log.is_inference() else self.A_log._version
        key = (self.A_log.data_ptr(), version, self.A_log.dtype, self.A_log.device)
        cached = self.__dict__.get("_decay_rates")
        if cached is None or cached[0] != key:
            cached = (key, -torch.exp(self.A_log.detach().float()))
            self.__dict__["_decay_rates"] = cached
        return cached[1]


class MambaBlock(nn.Module):
    def __init__(self, config: MambaConfig):
        super().__init__()
        self.norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.mixer = MambaMixer(config)

    def forward(self, x: Tensor, conv_inputs: Tensor, ssm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # x, the residual stream, is float32 whatever the weights' dtype (mamba_ssm's and
        # transformers' residual_in_fp32, set in every published checkpoint): in a 16-bit model
        # only what enters the block is rounded, not the sum over 24-64 layers
        out, conv_inputs, ssm = self.mixer(self.norm(x.to(self.norm.weight.dtype)), conv_inputs, ssm)
        return x + out, conv_inputs, ssm


class Mamba(LanguageModel):
    architecture = "mamba"
    config_class = MambaConfig
    state_class = SelectiveState
    state_kind = "linear"  # a fixed-size summary of the whole history (models/training/card.py's words)
    state_grows_with_context = False
    chunking_invariant = True  # module docstring: every output depends on the tokens up to it only

    def __init__(self, config: MambaConfig):
        super().__init__()
        c = config
        self.config = c
        if min(c.n_layer, c.d_model, c.d_inner, c.d_state, c.d_conv, c.dt_rank, c.chunk_size) < 1:
            raise ValueError("n_layer, d_model, d_inner, d_state, d_conv, dt_rank and chunk_size must be at least 1")
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(MambaBlock(c) for _ in range(c.n_layer))
        self.final_norm = nn.RMSNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        self._init_parameters()

    def _init_parameters(self) -> None:
        """The paper's initialisation (section 3.6 and its reference code): A = −(1 .. N) per
        channel (S4D-real), D = 1, Δ's bias such that softplus of it is log-uniform in
        [0.001, 0.1]; linear and embedding weights as every xlserve model's, out_proj scaled down
        by √n_layer so the residual stream does not grow with depth."""
        init_weights(self)
        c = self.config
        with torch.no_grad():
            for block in self.layers:
                m = block.mixer
                m.A_log.copy_(torch.log(torch.arange(1, c.d_state + 1, dtype=torch.float32)).expand(c.d_inner, -1))
                nn.init.uniform_(m.conv_weight, -1 / math.sqrt(c.d_conv), 1 / math.sqrt(c.d_conv))
                nn.init.uniform_(m.dt_proj.weight, -c.dt_rank ** -0.5, c.dt_rank ** -0.5)
                dt = torch.exp(torch.rand(c.d_inner) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
                m.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
                m.out_proj.weight.div_(math.sqrt(c.n_layer))

    @property
    def max_context(self) -> int | None:
        return None

    def init_state(self, batch_size: int) -> SelectiveState:
        c = self.config
        like = self.embedding.weight
        return SelectiveState(
            conv_inputs=[like.new_zeros(batch_size, c.d_conv - 1, c.d_inner) for _ in range(c.n_layer)],
            ssm=[torch.zeros(batch_size, c.d_inner, c.d_state, device=like.device) for _ in range(c.n_layer)],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    def _check_tokens(self, state: SelectiveState, tokens: int) -> None:
        """Before any token every state is zero; while fewer than K − 1 tokens have been seen,
        the convolution's padding rows are still zero."""
        padding = max(0, self.config.d_conv - 1 - tokens)
        for i, recent in enumerate(state.conv_inputs):
            if padding and bool(recent[:, :padding].any()):
                raise ValueError(f"state tensor 'conv_inputs.{i}' holds inputs before the first of {tokens} tokens")
        if tokens == 0:
            for i, h in enumerate(state.ssm):
                if bool(h.any()):
                    raise ValueError(f"state tensor 'ssm.{i}' is not 0 before the first token")

    def forward(self, tokens: Tensor, state: SelectiveState) -> tuple[Tensor, SelectiveState]:
        B, T = tokens.shape
        if T == 0:
            return torch.zeros(B, 0, self.vocab_size, device=tokens.device), state
        x = self.embedding(tokens).float()  # (B, T, d_model), the residual stream in float32 (MambaBlock)
        conv_inputs, ssm = [], []
        for i, block in enumerate(self.layers):
            x, recent, h = block(x, state.conv_inputs[i], state.ssm[i])
            conv_inputs.append(recent.detach())  # a state is a value: no gradient into the next call
            ssm.append(h.detach())
        h = self.final_norm(x.to(self.final_norm.weight.dtype))  # (B, T, d_model), in the weights' dtype
        log_probs = F.log_softmax(self.head(h).float(), dim=-1)  # (B, T, V)
        return log_probs, SelectiveState(conv_inputs, ssm, state.position + T)
