"""Mamba-2: the state space duality (SSD) form of a selective state space model.

Paper: Tri Dao, Albert Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality", ICML 2024 (arXiv:2405.21060). Served as Hugging Face's
`Mamba2ForCausalLM` computes it without its CUDA kernels (models/convert/mamba2.py imports it),
but for the gated RMSNorm, below.

What changes from Mamba (models/mamba.py): A is one scalar per head instead of a diagonal per
channel, so a head's whole (P × N) state decays by one number per position, and B and C are
shared by the heads of a group (like grouped keys and queries). A block (section 7, figure 6):

    z, xBC, Δ = in_proj(h)                        gate (E), conv stream (E + 2·G·N), one Δ per head
    x, B, C = silu(causal depthwise conv_K(xBC))   x split into H heads of width P
    h_t = exp(Δ_t A) · h_{t−1} + Δ_t x_t B_tᵀ       per head: a (P × N) state, A < 0 a scalar
    y_t = h_t C_t + D x_t
    out = out_proj(RMSNorm(y ⊙ silu(z)))

with Δ = clamp(softplus(Δ_raw + dt_bias), dt_min, dt_max).

Prefill (`ssd_scan`): the paper's chunked SSD algorithm (section 6). With the per-head decay a
scalar, the outputs of a chunk of L positions are a masked "attention" inside the chunk plus
the carried state's contribution:

    y_t = Σ_{s≤t in chunk} (C_t · B_s) exp(c_t − c_s) Δ_s x_s  +  exp(c_t) h_0 C_t,   c_t = Σ_{r≤t} Δ_r A

and the state after the chunk is exp(c_L) h_0 + Σ_s exp(c_L − c_s) Δ_s x_s B_sᵀ. Every exponent
is ≤ 0 (a difference of a non-increasing sum, the future masked before exp), so nothing
overflows; the state is carried sequentially across chunks. Decoding one token is the recurrence.

The gated RMSNorm normalises each group of E / G channels (the heads sharing one B and C) on its
own, as the original code (mamba_ssm), which trained the published checkpoints, does in its CUDA
kernel and its reference alike. transformers' torch path normalises over all E channels: the two
agree when G = 1 (mamba2-130m … 2.7b) and differ when G > 1 (Mamba-Codestral-7B: G = 8).

State (`SSDState`): per layer the last K − 1 inputs of the convolution and the (H, P, N) state,
plus the token count: constant in size, and every output is a function of the tokens up to it
only, the same in any chunking (to float32 rounding).
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


@dataclass
class Mamba2Config(ArchConfig):
    vocab_size: int = 256
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4  # H
    head_dim: int = 64  # P; E = n_head · head_dim (the paper: expand · d_model)
    d_state: int = 32  # N
    n_groups: int = 1  # G: heads in a group share B and C
    d_conv: int = 4  # K
    conv_bias: bool = True
    proj_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    dt_min: float = 0.0  # Δ is clamped to [dt_min, dt_max] (transformers' time_step_limit)
    dt_max: float | None = None  # None: no upper limit
    tie_embedding: bool = False
    chunk_size: int = 64  # positions per chunk of the SSD prefill (speed only, not the result)

    @property
    def d_inner(self) -> int:
        return self.n_head * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state


@dataclass
class SSDState(FixedShapeState):
    """Per layer l (lists indexed by layer), batch on dimension 0:

    conv_inputs[l]: (B, K − 1, E + 2·G·N) the last K − 1 inputs of layer l's causal convolution,
        oldest first; zeros before the first token
    ssm[l]: (B, H, P, N) float32, every head's state after the last token
    position: (B,) int64, tokens seen

    Bytes per session: n_layer · ((K − 1)·(E + 2GN)·element size + 4·H·P·N) + 8, whatever the history.
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


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h: Tensor,
             chunk_size: int) -> tuple[Tensor, Tensor]:
    """y_t = h_t C_t with h_t = exp(Δ_t A) h_{t−1} + Δ_t x_t B_tᵀ per head, for x (B, T, H, P),
    dt (B, T, H), A (H,), B, C (B, T, H, N) (already repeated per head), h (B, H, P, N), all
    float32 -> y (B, T, H, P) and the state after (module docstring: the chunked SSD form)."""
    xdt = x * dt[..., None]  # (B, T, H, P) Δ_t x_t
    if x.shape[1] == 1:  # decoding: the recurrence itself
        h = torch.exp(dt[:, 0] * A)[..., None, None] * h + xdt[:, 0, :, :, None] * B[:, 0, :, None, :]
        return (h @ C[:, 0, :, :, None]).squeeze(-1).unsqueeze(1), h  # (B, 1, H, P)
    outputs = []
    for start in range(0, x.shape[1], chunk_size):
        piece = slice(start, start + chunk_size)
        Bc, Cc, xc = B[:, piece], C[:, piece], xdt[:, piece]
        decay = (dt[:, piece] * A).cumsum(dim=1)  # (B, L, H) c_t, non-increasing
        L = decay.shape[1]
        between = decay[:, :, None, :] - decay[:, None, :, :]  # (B, L_t, L_s, H) c_t − c_s
        future = torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1)[None, :, :, None]
        weights = torch.exp(between.masked_fill(future, float("-inf")))  # (B, L, L, H), 0 where s > t
        scores = torch.einsum("bthn,bshn->btsh", Cc, Bc) * weights  # (B, L, L, H)
        inside = torch.einsum("btsh,bshp->bthp", scores, xc)  # (B, L, H, P)
        carried = torch.einsum("bthn,bhpn->bthp", Cc, h) * torch.exp(decay)[..., None]  # (B, L, H, P)
        outputs.append(inside + carried)
        to_end = torch.exp(decay[:, -1:] - decay)  # (B, L, H) exp(c_L − c_s)
        h = h * torch.exp(decay[:, -1])[..., None, None] + torch.einsum("bshn,bshp->bhpn", Bc * to_end[..., None], xc)
    return torch.cat(outputs, dim=1), h


class GatedRMSNorm(nn.Module):
    """RMSNorm(y ⊙ silu(z)) over each of `groups` equal slices of the last dimension, computed in
    float32."""

    def __init__(self, width: int, eps: float, groups: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps
        self.groups = groups

    def forward(self, y: Tensor, gate: Tensor) -> Tensor:
        y = y.float() * F.silu(gate.float())
        y = y.unflatten(-1, (self.groups, -1))  # (..., G, E / G)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.flatten(-2).to(gate.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: Mamba2Config):
        super().__init__()
        c = config
        self.config = c
        self.in_proj = nn.Linear(c.d_model, c.d_inner + c.conv_dim + c.n_head, bias=c.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(c.conv_dim, c.d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(c.conv_dim)) if c.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(c.n_head))
        self.A_log = nn.Parameter(torch.empty(c.n_head))
        self.D = nn.Parameter(torch.ones(c.n_head))
        self.norm = GatedRMSNorm(c.d_inner, c.layer_norm_epsilon, groups=c.n_groups)
        self.out_proj = nn.Linear(c.d_inner, c.d_model, bias=c.proj_bias)

    def forward(self, h: Tensor, conv_inputs: Tensor, ssm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c = self.config
        Bsz, T, _ = h.shape
        gate, xBC, dt = self.in_proj(h).split([c.d_inner, c.conv_dim, c.n_head], dim=-1)
        xBC, conv_inputs = causal_depthwise_conv(xBC, conv_inputs, self.conv_weight, self.conv_bias)
        x, B, C = F.silu(xBC).float().split([c.d_inner, c.n_groups * c.d_state, c.n_groups * c.d_state], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=c.dt_min, max=c.dt_max)  # (B, T, H)
        per_group = c.n_head // c.n_groups
        B = B.view(Bsz, T, c.n_groups, c.d_state).repeat_interleave(per_group, dim=2)  # (B, T, H, N)
        C = C.view(Bsz, T, c.n_groups, c.d_state).repeat_interleave(per_group, dim=2)
        x = x.view(Bsz, T, c.n_head, c.head_dim)  # (B, T, H, P)
        A = self.decay_rates()  # (H,) < 0
        y, ssm = ssd_scan(x, dt, A, B, C, ssm, c.chunk_size)
        y = y + x * self.D.float()[:, None]  # (B, T, H, P)
        y = self.norm(y.reshape(Bsz, T, c.d_inner), gate)
        return self.out_proj(y.to(h.dtype)), conv_inputs, ssm

    # Copied from xlserve.models.mamba.MambaMixer.decay_rates
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


class Mamba2Block(nn.Module):
    def __init__(self, config: Mamba2Config):
        super().__init__()
        self.norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(config)

    # Copied from xlserve.models.mamba.MambaBlock.forward
    def forward(self, x: Tensor, conv_inputs: Tensor, ssm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # x, the residual stream, is float32 whatever the weights' dtype (mamba_ssm's and
        # transformers' residual_in_fp32, set in every published checkpoint): in a 16-bit model
        # only what enters the block is rounded, not the sum over 24-64 layers
        out, conv_inputs, ssm = self.mixer(self.norm(x.to(self.norm.weight.dtype)), conv_inputs, ssm)
        return x + out, conv_inputs, ssm


class Mamba2(LanguageModel):
    architecture = "mamba2"
    config_class = Mamba2Config
    state_class = SSDState
    state_kind = "linear"
    state_grows_with_context = False
    chunking_invariant = True

    def __init__(self, config: Mamba2Config):
        super().__init__()
        c = config
        self.config = c
        if min(c.n_layer, c.d_model, c.n_head, c.head_dim, c.d_state, c.n_groups, c.d_conv, c.chunk_size) < 1:
            raise ValueError("n_layer, d_model, n_head, head_dim, d_state, n_groups, d_conv and chunk_size "
                             "must be at least 1")
        if c.n_head % c.n_groups:
            raise ValueError(f"n_head {c.n_head} is not a multiple of n_groups {c.n_groups}")
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(Mamba2Block(c) for _ in range(c.n_layer))
        self.final_norm = nn.RMSNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        init_weights(self)
        with torch.no_grad():  # the paper's code: A uniform in [1, 16], Δ log-uniform in [0.001, 0.1]
            for block in self.layers:
                m = block.mixer
                m.A_log.copy_(torch.log(torch.empty(c.n_head).uniform_(1, 16)))
                dt = torch.exp(torch.rand(c.n_head) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
                m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
                nn.init.uniform_(m.conv_weight, -1 / math.sqrt(c.d_conv), 1 / math.sqrt(c.d_conv))
                m.out_proj.weight.div_(math.sqrt(c.n_layer))

    @property
    def max_context(self) -> int | None:
        return None

    def init_state(self, batch_size: int) -> SSDState:
        c = self.config
        like = self.embedding.weight
        return SSDState(
            conv_inputs=[like.new_zeros(batch_size, c.d_conv - 1, c.conv_dim) for _ in range(c.n_layer)],
            ssm=[torch.zeros(batch_size, c.n_head, c.head_dim, c.d_state, device=like.device) for _ in range(c.n_layer)],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    # Copied from xlserve.models.mamba.Mamba._check_tokens with SelectiveState->SSDState
    def _check_tokens(self, state: SSDState, tokens: int) -> None:
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

    # Copied from xlserve.models.mamba.Mamba.forward with SelectiveState->SSDState
    def forward(self, tokens: Tensor, state: SSDState) -> tuple[Tensor, SSDState]:
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
        return log_probs, SSDState(conv_inputs, ssm, state.position + T)
