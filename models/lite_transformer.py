"""Lite Transformer: Long-Short Range Attention (LSRA), half attention for global context and
half convolution for local context, with a flattened feed-forward; a byte-level causal LM.

Paper: Zhanghao Wu, Zhijian Liu, Ji Lin, Yujun Lin, Song Han, "Lite Transformer with Long-Short
Range Attention", ICLR 2020, arXiv:2004.11886 (its sections on the bottleneck design and on
LSRA). The convolution is the dynamic convolution of Felix Wu, Angela Fan, Alexei Baevski, Yann
Dauphin, Michael Auli, "Pay Less Attention with Lightweight and Dynamic Convolutions", ICLR 2019.

LSRA. The normalised input x of a block (d channels) is split along its channels into two halves,
x = [x_a ; x_c], d/2 channels each (the paper's split: each branch sees half the channels, which
halves its cost; what the halves learn apart is mixed again by the projection after them and by
the feed-forward):

    LSRA(x) = W_o [ Attention(x_a) ; Convolution(x_c) ] + b_o          (d/2 + d/2 -> d)

The attention branch (global context) is causal multi-head attention, H heads of width
D = d / (2H), over a bounded window of M = `mem_len` positions, itself included:

    Attention_h(i) = Σ_{j = i−M+1 .. i, j ≥ 0} softmax_j( q_i·k_j / √D + r_h[i − j] ) v_j
    q, k, v = x_a W_q, x_a W_k, x_a W_v

with r_h[0 .. M − 1] a learned bias per head and distance. The convolution branch (local
context) is the paper's: a linear layer with a GLU, then a causal convolution of width K (one K
per layer, `conv_kernel`), over positions i − K + 1 .. i only (left padding with zeros, so no
position sees the future):

    u = GLU(x_c W_g + b_g) = (x_c W_g1 + b_g1) ⊙ σ(x_c W_g2 + b_g2)      (d/2 -> 2·d/2 -> d/2)
    Convolution(x_c)_{i,c} = Σ_{k=0}^{K−1} w_{i, g(c), k} · u_{i−K+1+k, c},   u_{<0} = 0

The channels are in H_c groups (`n_conv_head`, the paper's and Wu et al.'s "heads") of d/(2·H_c)
consecutive channels, g(c) the group of channel c; every channel of a group shares one kernel,
normalised over its K taps by a softmax, so each group's weights are positive and sum to 1:

    dynamic (`conv_type` "dynamic", the default and what the paper's released configurations
    use):  w_{i,g,·} = softmax_k( (u_i W_w)_{g,·} ),  W_w (d/2 -> H_c·K): the kernel is predicted
    from the current position's own input, so it changes from position to position;
    lightweight ("lightweight"):  w_{i,g,·} = softmax_k( V_{g,·} ),  V (H_c × K) a parameter
    shared by every position.

Either way position i's kernel depends on u_i alone, never on later inputs, so the branch is
causal and needs nothing of the past but the last K − 1 values of u. Wu et al.'s DropConnect on
the normalised kernel is `weight_dropout` (0 in the presets, as every dropout here).

Block: pre-norm residual, x + LSRA(LN(x)), then x + FFN(LN(x)) (models/layers/block.py).

The flattened feed-forward. A standard block widens its FFN to 4·d (Transformer-base: 512 ->
2048 -> 512), which at small widths puts most of the block's computation in the FFN and leaves
the attention a narrow bottleneck. The paper argues that this bottleneck design does not pay for
one-dimensional attention and flattens it: its released configurations set the FFN's inner
width equal to the embedding width (496 -> 496 for translation, 896 -> 896 for WikiText-103),
spending the computation on LSRA instead, whose projections already mix channels. Here the
inner width is a config field (`d_inner`); the shipped preset halves the usual 4·d to 2·d
(192 -> 384 -> 192) rather than going down to 1·d. Why: the paper flattens at a fixed
computation budget and widens the embedding with what it saves, but our presets fix
d_model = 192 for every architecture, and at that width a six-layer model with a 1·d FFN has
1.07M parameters, below the ~1.5M the comparison's budget asks for (with 2·d: 1.51M). At 2·d
the FFN holds 148k of a block's 244k weights (at 4·d it would hold 295k of 391k). Setting
`d_inner` = `d_model` gives the paper's exact block.

Positions. No absolute position enters the network. The convolution gives local order: its K
taps are positions, so every output of the branch knows which of its last K inputs is which. The
attention branch gets relative positions through the learned bias r_h[i − j] per distance: its
window is bounded (M positions), so the table is bounded too (H × M numbers per layer), and it
means the same after a million tokens as after ten (no position table to outgrow, no rotary
angle to lose float precision). A query therefore tells its window's keys apart by their
distance, and the state needs nothing but keys, values, convolution inputs and a count.

State between calls (`ConvWindowMemory`, models/layers/causal_conv.py): per layer, the attention
branch's keys and values of the last M − 1 positions (a ring buffer: position p in slot
p mod (M − 1), models/layers/ring_buffer.py), as Transformer-XL's memory but of a fixed M − 1,
and the convolution branch's last K_l − 1 values of u (`causal_dynamic_conv`), plus the
number of positions seen. Its size is fixed by the config,

    nbytes = 8·B + Σ_l 4·B·(d/2)·(2·(M − 1) + K_l − 1)    (float32; H·D = d/2),

the same after 4 KB and after 64 KB of history. Decoding a token attends to M keys per layer and
convolves K inputs: no recomputation of the context. The model conditions on a bounded look-back
of 1 + Σ_l max(M − 1, K_l − 1) positions (`receptive_field`), but accepts any history: it is
served from its state like Transformer-XL, not re-run over a fixed window, so `max_context` is
None.

Chunking: what a query attends to (the positions i − M + 1 .. i, with the bias of their
distance) and what a convolution output reads (positions i − K + 1 .. i, zeros before 0) depend
only on absolute positions, and the state holds exactly the keys, values and inputs a later
position can still reach. So feeding a text in one call, token by token, or in chunks of any
size gives the same log-probabilities (to float rounding). A long call is processed in pieces
of at most `max_piece_positions` positions internally, which by the same argument changes
nothing but the memory a call needs.

Training: the standard loop carries the state from one segment of a lane to the next
(detached), so a segment's first positions see the end of the previous one through the
attention window and the convolution, as when serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import ArchConfig, LanguageModel
from xlserve.models.layers.block import PreNormBlock, forward_in_pieces
from xlserve.models.layers.causal_conv import ConvWindowMemory, causal_depthwise_conv, with_history
from xlserve.models.layers.init import init_weights
from xlserve.models.layers.ring_buffer import ring_positions, ring_write

CONV_TYPES = ("dynamic", "lightweight")


@dataclass
class LiteTransformerConfig(ArchConfig):
    vocab_size: int = 256  # bytes
    n_layer: int = 6
    d_model: int = 192  # width of the residual stream; LSRA gives half of its channels to each branch
    n_head: int = 4  # H: attention heads over the attention half (head width D = d_model / 2 / H)
    mem_len: int = 128  # M: a query attends to itself and the M − 1 positions before it
    conv_type: str = "dynamic"  # "dynamic" (kernel predicted from the position's input) or "lightweight"
    # H_c: channel groups of the convolution half, each sharing one kernel (8 of 96 channels: 12 per
    # kernel, between the 4 heads of the paper's released configurations and Wu et al.'s 16)
    n_conv_head: int = 8
    # K per layer: one number for every layer, or a list of n_layer (the output at i reads i − K + 1 .. i)
    conv_kernel: int | list[int] = 15
    # width of the feed-forward layer: flattened, narrower than the usual 4·d_model (module docstring)
    d_inner: int = 384
    dropout: float = 0.0  # on embeddings, LSRA output and feed-forward
    dropatt: float = 0.0  # on attention probabilities
    weight_dropout: float = 0.0  # DropConnect on the normalised convolution kernels
    layer_norm_epsilon: float = 1e-5
    tie_embedding: bool = True  # the next-byte softmax shares the input embedding matrix

    def layer_kernels(self) -> list[int]:
        kernels = [self.conv_kernel] * self.n_layer if isinstance(self.conv_kernel, int) else list(self.conv_kernel)
        if len(kernels) != self.n_layer or any(k < 1 for k in kernels):
            raise ValueError(f"conv_kernel must be a positive int or {self.n_layer} positive ints, got {self.conv_kernel}")
        return kernels


# -- the two branches of long-short range attention ------------------------------------------------


class WindowAttention(nn.Module):
    """The attention branch: causal multi-head attention of each query over itself and the
    M − 1 positions before it, with a learned bias per head and distance; the keys and values
    of the last M − 1 positions come from a ring buffer."""

    def __init__(self, config: LiteTransformerConfig):
        super().__init__()
        c = config
        self.config = c
        self.d_attn = c.d_model // 2  # the attention half of the channels
        self.d_head = self.d_attn // c.n_head
        self.capacity = c.mem_len - 1  # C: positions the ring keeps
        self.qkv_net = nn.Linear(self.d_attn, 3 * self.d_attn, bias=False)  # W_q, W_k, W_v
        self.distance_bias = nn.Parameter(torch.zeros(c.n_head, c.mem_len))  # r_h[i − j]

    def pattern(self, query_positions: Tensor, key_positions: Tensor, key_valid: Tensor) -> Tensor:
        """The additive attention bias (B, H, T, K): r_h[i − j] where query i may see key j
        (0 <= i − j < M), −inf elsewhere. query_positions (B, T) and key_positions (B, K) are
        absolute positions; key_valid (B, K) is False for a ring slot holding nothing yet."""
        M = self.config.mem_len
        dist = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # (B, 1, T, K)
        visible = (dist >= 0) & (dist < M) & key_valid[:, None, None, :]
        heads = torch.arange(self.config.n_head, device=dist.device)[None, :, None, None]
        bias = self.distance_bias[heads, dist.clamp(0, M - 1)]  # (B, H, T, K)
        return torch.where(visible, bias, float("-inf"))

    def forward(self, x: Tensor, position: Tensor, ring_keys: Tensor, ring_values: Tensor):
        """x (B, T, d/2) at positions position[b] .. position[b] + T − 1, after the ring of keys
        and values (B, H, C, D) -> the attention output (B, T, d/2) and the rings after x."""
        c = self.config
        B, T, _ = x.shape
        q, k, v = self.qkv_net(x).view(B, T, 3, c.n_head, self.d_head).permute(2, 0, 3, 1, 4)  # (B, H, T, D) each
        keys = torch.cat([ring_keys, k], dim=2)  # (B, H, C + T, D)
        values = torch.cat([ring_values, v], dim=2)

        device = x.device
        query_positions = position[:, None] + torch.arange(T, device=device)[None, :]  # (B, T)
        ring_at = ring_positions(position, self.capacity)  # (B, C)
        key_positions = torch.cat([ring_at, query_positions], dim=1)  # (B, C + T)
        key_valid = torch.cat([ring_at >= 0, torch.ones(B, T, dtype=torch.bool, device=device)], dim=1)
        # the pattern depends on positions alone: rows that all stand at one position (training
        # lanes, a batch of fresh prompts) share one (1, H, T, K) bias instead of B copies of it
        rows = slice(0, 1) if B > 1 and bool((position == position[0]).all()) else slice(None)
        bias = self.pattern(query_positions[rows], key_positions[rows], key_valid[rows])
        attended = self.attend(q, keys, values, bias.to(q.dtype))  # (B, H, T, D)
        out = attended.transpose(1, 2).reshape(B, T, self.d_attn)  # (B, T, d/2)
        return out, ring_write(ring_keys, position, k), ring_write(ring_values, position, v)

    # Copied from xlserve.models.longformer.SlidingWindowAttention.attend
    def attend(self, q: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
        """softmax(q kᵀ / √D + bias) v: q (B, H, T, D), keys and values (B, H, K, D), bias
        (B or 1, H, T, K) -> (B, H, T, D). Every query sees itself, so no row is all −inf."""
        dropatt = self.config.dropatt if self.training else 0.0
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, dropout_p=dropatt)


def causal_dynamic_conv(x: Tensor, recent: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """out[b, t, c] = Σ_k weights[b, t, g(c), k] · input[b, t − K + 1 + k, c] for x (B, T, C)
    after `recent` (B, K − 1, C), weights (B, T, G, K) with channel c in group g(c) = c div (C / G)
    -> out (B, T, C) and the buffer after x."""
    padded, recent = with_history(x, recent)
    B, T, C = x.shape
    G, K = weights.shape[2:]
    if K != recent.shape[1] + 1:
        raise ValueError(f"a kernel of width {K} needs {K - 1} buffered inputs, got {recent.shape[1]}")
    weights = weights.to(x.dtype)[..., None]  # (B, T, G, K, 1)
    # K shifted products rather than one batched product over (B, T, C, K) windows: that product
    # is B·T·G matrix-vector products of K taps each, and it copies the windows (and again in its
    # backward); these read shifted views of the inputs and copy nothing
    out = x.new_zeros(B, T, G, C // G)
    for k in range(K):
        out = out + padded[:, k : k + T].view(B, T, G, C // G) * weights[:, :, :, k]
    return out.flatten(2), recent  # (B, T, C)


class ConvolutionBranch(nn.Module):
    """The convolution branch: linear + GLU, then a causal dynamic or lightweight convolution of
    width K whose softmax-normalised kernel is shared by the channels of each of H_c groups."""

    def __init__(self, config: LiteTransformerConfig, kernel: int):
        super().__init__()
        c = config
        self.config = c
        self.kernel = kernel  # K
        self.d_conv = c.d_model - c.d_model // 2  # the convolution half of the channels
        self.glu_net = nn.Linear(self.d_conv, 2 * self.d_conv)  # W_g, b_g: value and gate halves
        if c.conv_type == "dynamic":
            self.kernel_net = nn.Linear(self.d_conv, c.n_conv_head * kernel, bias=False)  # W_w: u_i -> kernel logits
            self.kernel_logits = None
        else:
            self.kernel_net = None
            self.kernel_logits = nn.Parameter(torch.zeros(c.n_conv_head, kernel))  # V

    def kernels(self, u: Tensor) -> Tensor:
        """The normalised kernels: (B, T, H_c, K) for the dynamic convolution (one per position,
        from u (B, T, d/2)), (H_c, K) for the lightweight one; each sums to 1 over K."""
        if self.kernel_net is not None:
            logits = self.kernel_net(u).unflatten(-1, (self.config.n_conv_head, self.kernel))  # (B, T, H_c, K)
        else:
            logits = self.kernel_logits
        return logits.float().softmax(dim=-1).to(u.dtype)

    def forward(self, x: Tensor, recent: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, T, d/2) after `recent` (B, K − 1, d/2), the last K − 1 values of u before x ->
        the convolution (B, T, d/2) and the last K − 1 values of u after x."""
        c = self.config
        u = F.glu(self.glu_net(x), dim=-1)  # (B, T, d/2)
        weights = F.dropout(self.kernels(u), c.weight_dropout, self.training)  # DropConnect (Wu et al.)
        if self.kernel_net is None:
            per_channel = weights.repeat_interleave(self.d_conv // c.n_conv_head, dim=0)  # (d/2, K): channel c, group g(c)
            return causal_depthwise_conv(u, recent, per_channel)
        return causal_dynamic_conv(u, recent, weights)  # weights (B, T, H_c, K), one kernel per position


class LongShortRangeAttention(nn.Module):
    """LSRA: half the channels through the attention branch, half through the convolution
    branch, concatenated and projected back to d."""

    def __init__(self, config: LiteTransformerConfig, kernel: int):
        super().__init__()
        c = config
        self.d_attn = c.d_model // 2
        self.attention = WindowAttention(c)
        self.convolution = ConvolutionBranch(c, kernel)
        self.o_net = nn.Linear(c.d_model, c.d_model)  # W_o, b_o over [global ; local]

    def forward(self, x: Tensor, position: Tensor, memory: tuple[Tensor, Tensor, Tensor]):
        """x (B, T, d) and this layer's (ring keys, ring values, convolution inputs) -> output
        (B, T, d) and the memory after x."""
        ring_keys, ring_values, recent = memory
        x_a, x_c = x[..., : self.d_attn], x[..., self.d_attn :]  # (B, T, d/2) each
        global_context, ring_keys, ring_values = self.attention(x_a, position, ring_keys, ring_values)
        local_context, recent = self.convolution(x_c, recent)
        out = self.o_net(torch.cat([global_context, local_context], dim=-1))  # (B, T, d)
        return out, (ring_keys, ring_values, recent)


# -- the model -------------------------------------------------------------------------------------


class LiteTransformer(LanguageModel):
    architecture = "lite-transformer"
    config_class = LiteTransformerConfig
    state_class = ConvWindowMemory
    state_kind = "window"
    state_grows_with_context = False  # per layer M − 1 keys and values and K − 1 inputs, whatever the history
    max_piece_positions = 1024  # a longer call runs in pieces of this many positions (bounds its memory)
    departures_from_the_paper = (
        "The attention branch (the paper's global context) is causal and sees a window of `mem_len` positions with "
        "a learned relative bias, so a session's state stays bounded; the convolution branch is causal (left "
        "padding only); the model is a byte-level language model, not the paper's encoder-decoder "
        "(models/lite_transformer.py).")
    chunking_invariant = True  # the module docstring's chunking semantics

    def __init__(self, config: LiteTransformerConfig):
        super().__init__()
        c = config
        self.config = c
        if c.d_model % 2 or (c.d_model // 2) % c.n_head or (c.d_model // 2) % c.n_conv_head:
            raise ValueError(f"d_model ({c.d_model}) must be even, and its half divisible by n_head ({c.n_head}) "
                             f"and by n_conv_head ({c.n_conv_head})")
        if c.mem_len < 1:
            raise ValueError("mem_len must be at least 1 (a query always sees itself)")
        if c.conv_type not in CONV_TYPES:
            raise ValueError(f"conv_type must be one of {CONV_TYPES}, got {c.conv_type!r}")
        kernels = c.layer_kernels()
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(PreNormBlock(LongShortRangeAttention(c, k), c.d_model, c.d_inner, c.dropout,
                                                 c.layer_norm_epsilon) for k in kernels)
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.head = nn.Linear(c.d_model, c.vocab_size)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        extra = []
        for layer in self.layers:
            extra.append(layer.attention.attention.distance_bias)
            if layer.attention.convolution.kernel_logits is not None:
                extra.append(layer.attention.convolution.kernel_logits)
        init_weights(self, extra)

    @property
    def kernels(self) -> list[int]:
        """K_l: each layer's convolution width."""
        return [layer.attention.convolution.kernel for layer in self.layers]

    @property
    def receptive_field(self) -> int:
        """Positions an output can depend on, itself included: each layer reaches back
        max(M − 1, K_l − 1) positions (its two branches side by side)."""
        return 1 + sum(max(self.config.mem_len - 1, k - 1) for k in self.kernels)

    @property
    def max_context(self) -> int | None:
        return None  # any history; it conditions on a bounded look-back of it (`receptive_field`), from its state

    # -- state --------------------------------------------------------------------------------

    def init_state(self, batch_size: int) -> ConvWindowMemory:
        c = self.config
        attention = self.layers[0].attention.attention
        return ConvWindowMemory.empty(batch_size, self.kernels, self.layers[0].attention.convolution.d_conv,
                                      attention.capacity, c.n_head, attention.d_head, like=self.embedding.weight)

    # -- serving and training -----------------------------------------------------------------

    def forward(self, tokens: Tensor, state: ConvWindowMemory) -> tuple[Tensor, ConvWindowMemory]:
        B, T = tokens.shape
        if T == 0:
            return tokens.new_zeros(B, 0, self.vocab_size, dtype=torch.float32), state
        memories = list(zip(state.keys, state.values, state.conv_inputs))

        def piece(chunk: Tensor, position: Tensor) -> Tensor:
            x = self.drop(self.embedding(chunk))  # (B, t, d)
            for i, layer in enumerate(self.layers):
                x, memories[i] = layer(x, position, memories[i])
            return F.log_softmax(self.head(self.drop(self.final_norm(x))).float(), dim=-1)  # (B, t, V)

        log_probs, position = forward_in_pieces(tokens, state.position, self.max_piece_positions, piece)
        detached = [[t.detach() for t in m] for m in memories]  # the next call never backpropagates into this one
        new_state = ConvWindowMemory(keys=[m[0] for m in detached], values=[m[1] for m in detached],
                               conv_inputs=[m[2] for m in detached], position=position)
        return log_probs, new_state
