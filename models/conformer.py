"""The Conformer as a byte-level causal language model: macaron blocks of half-step
feed-forwards around windowed relative self-attention and a causal convolution module.

Paper: Anmol Gulati, James Qin, Chung-Cheng Chiu, Niki Parmar, Yu Zhang, Jiahui Yu, Wei Han,
Shibo Wang, Zhengdong Zhang, Yonghui Wu, Ruoming Pang, "Conformer: Convolution-augmented
Transformer for Speech Recognition", Interspeech 2020, arXiv:2005.08100.

The block (section 2.4, equation 1). For the input x of block i,

    x̃   = x  + ½ FFN(x)                 half-step feed-forward (macaron, as in Macaron-Net)
    x'  = x̃  + MHSA(x̃)                  multi-head self-attention with relative positions
    x'' = x' + Conv(x')                 the convolution module
    y   = LayerNorm(x'' + ½ FFN(x''))   the second half-step feed-forward, then a final LayerNorm

where every module normalises its own input first (pre-norm, as the paper's figures 2-4 show):

    FFN(x)  = Dropout(W_2 Dropout(Swish(W_1 LayerNorm(x) + b_1)) + b_2)        (section 2.3)
    MHSA(x) = Dropout(Attention(LayerNorm(x)))                                 (section 2.1)
    Conv(x) = Dropout(Pointwise_2(Swish(Norm(Depthwise_K(GLU(Pointwise_1(LayerNorm(x))))))))
                                                                               (section 2.2)

Pointwise_1 widens d_model to 2·d_model and the GLU halves it back (a ⊙ σ(b)); Depthwise_K is a
depthwise convolution over time of kernel K; Pointwise_2 maps d_model to d_model. Swish is
x·σ(x) (F.silu). A pointwise convolution is a linear map of each position's channels, so both
are `Linear` layers here.

What changes for a causal language model over a served stream:

- The depthwise convolution is causal: position t reads its own input and the K − 1 before it,
  with zero padding on the left only (models/layers/causal_conv.py). The speech model pads both
  sides and sees the future.
- Norm is a LayerNorm over the channels of each position, not the paper's BatchNorm over the
  batch and time. Batch statistics would make a token's output depend on the other rows of its
  batch (another session's text) and, through the mean and variance over time, on the positions
  after it in its chunk: the log-probability of a byte would change with whatever it is batched
  with and would leak the bytes it is meant to predict. Running statistics frozen after training
  would remove both at serving time but not in training, where the leak would teach the model to
  read the future. LayerNorm over channels uses one position's vector only.
- Attention is causal and windowed: query position i attends to key positions j with
  i − (mem_len − 1) ≤ j ≤ i, itself and the mem_len − 1 positions before it, whatever the
  chunking: Transformer-XL's memory with its `same_length` semantics (models/transformer_xl.py),
  so the window does not depend on where a chunk begins.
- Scores are relative, Transformer-XL's scheme, which is also the paper's ("relative sinusoidal
  positional encoding scheme ... from Transformer-XL", section 2.1), reused from
  models/layers/relative.py as models/adaptive_span.py does:

      s_ij = ((q_i + u) · k_j + (q_i + v) · W_kR R_{i−j}) / √D,    0 ≤ i − j ≤ mem_len − 1

  with k_j = W_kE h_j the content keys, R_d the sinusoid encoding of distance d, W_kR its
  projection (per layer), u and v learned per layer and head. Nothing depends on absolute
  positions, so the keys and values of past positions are reused as they are, and the model
  means the same after a million bytes as after ten. Only mem_len distances exist, so the table
  W_kR R_d has mem_len rows.
- No convolution subsampling front end: the input is a byte embedding, one position per byte.

Receptive field. Within a block the attention reaches mem_len − 1 positions back and the
convolution, which reads the attention's output, K − 1 more; stacked, the log-probabilities at
position t depend on bytes t − n_layer·(mem_len + K − 2) .. t (`receptive_field` of them).
`max_context` is nevertheless None: the model is served as a stream from its state, never by
recomputing windows of text.

State between calls (`ConvWindowMemory`, models/layers/causal_conv.py): per layer, the last
K − 1 inputs of the depthwise convolution (the GLU's outputs) and the keys and values of the last
C = mem_len − 1 positions in a ring buffer (models/layers/ring_buffer.py), plus the number of
positions seen. Keys and values rather than the layer's inputs: they are what attention reads, so
decoding a token projects only the new position. Every shape is fixed by the config:

    nbytes = 8·B + B·Σ_l ((K − 1)·d_model + 2·H·(mem_len − 1)·D)·4      (float32)

the same after 4 KB and after 64 KB of history; ring slots and convolution inputs that no position
has reached yet are zeros, masked by `position`, so rows of any histories batch together. Decoding
a token costs attention over mem_len keys and a convolution over K inputs per layer.

Chunking: which keys a query sees, with which distance, and which inputs the convolution reads
depend on absolute positions only, and the state keeps exactly what a later position can still
reach. So feeding a text in one call, token by token, or in chunks of any size gives the same
log-probabilities, to float rounding (`chunking_invariant`). A long call runs in pieces of at most
`max_piece_positions` positions internally (the attention scores of a piece are T × (mem_len − 1 + T)),
which by the same argument changes nothing but the memory a call needs.

Training: the standard next-byte loss over segments, the state carried from one segment of a lane
to the next and detached (no gradient through it), as Transformer-XL carries its memory: a
segment's first positions see the end of the previous one through the window and the convolution,
exactly as when serving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import LanguageModel, TransformerConfig
from xlserve.models.layers.block import forward_in_pieces
from xlserve.models.layers.causal_conv import ConvWindowMemory, causal_depthwise_conv
from xlserve.models.layers.feedforward import FeedForward
from xlserve.models.layers.init import init_weights
from xlserve.models.layers.relative import RelativeKeys, relative_scores
from xlserve.models.layers.ring_buffer import ring_positions, ring_write

HALF_STEP = 0.5  # the macaron feed-forwards' residual weight (the paper's ½)


@dataclass
class ConformerConfig(TransformerConfig):
    """vocab_size, n_layer, d_model, n_head, d_head and d_inner: TransformerConfig's
    (models/interface.py), narrower here by default (the paper's Conformer (S))."""

    d_model: int = 144  # width of the residual stream (the paper's Conformer (S))
    d_head: int = 36  # per-head width D
    d_inner: int = 576  # width of each of the two macaron feed-forwards (4 · d_model, as the paper)
    kernel_size: int = 15  # K: the depthwise convolution reads a position and the K − 1 before it
    mem_len: int = 128  # a query attends to itself and the mem_len − 1 positions before it
    dropout: float = 0.0  # on embeddings, every module's output, inside the feed-forwards, relative encodings
    dropatt: float = 0.0  # on attention probabilities
    layer_norm_epsilon: float = 1e-5
    tie_embedding: bool = True  # the next-byte softmax shares the input embedding matrix


# -- the modules of a block ------------------------------------------------------------------------


def swish_feed_forward(d_model: int, d_inner: int, dropout: float) -> FeedForward:
    """The paper's feed-forward module without its LayerNorm: Linear, Swish, dropout, Linear,
    dropout. The shared FeedForward with its ReLU replaced (same parameter names)."""
    ff = FeedForward(d_model, d_inner, dropout)
    ff[1] = nn.SiLU()  # Swish
    return ff


class WindowedRelativeAttention(nn.Module):
    """The MHSA module: LayerNorm, causal multi-head attention over the window of the query and
    the mem_len − 1 positions before it with Transformer-XL's relative scores, dropout. The keys
    and values of the last mem_len − 1 positions live in a ring buffer between calls."""

    def __init__(self, config: ConformerConfig):
        super().__init__()
        c = config
        self.config = c
        self.capacity = c.mem_len - 1  # C: positions before a query that it still sees
        self.norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.qkv_net = nn.Linear(c.d_model, 3 * c.n_head * c.d_head, bias=False)  # W_q, W_kE, W_v
        self.r_net = nn.Linear(c.d_model, c.n_head * c.d_head, bias=False)  # W_kR
        self.o_net = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)
        self.drop = nn.Dropout(c.dropout)
        self.dropatt = nn.Dropout(c.dropatt)
        self.scale = 1.0 / math.sqrt(c.d_head)

    def window(self, position: Tensor, T: int) -> tuple[Tensor, Tensor]:
        """For T queries after `position` (B,) positions, against the ring's C keys then the T
        new ones: the distance of each (query, key) pair clamped into [0, C] (an index into the
        relative table), (B, 1, T, C + T), and whether the query sees the key, (B, 1, T, C + T):
        0 ≤ distance ≤ C and the key holds a position (not an unwritten ring slot)."""
        C = self.capacity
        query_positions = position[:, None] + torch.arange(T, device=position.device)[None, :]  # (B, T)
        key_positions = torch.cat([ring_positions(position, C), query_positions], dim=1)  # (B, C + T)
        distance = query_positions[:, :, None] - key_positions[:, None, :]  # (B, T, C + T)
        sees = (distance >= 0) & (distance <= C) & (key_positions >= 0)[:, None, :]
        return distance.clamp(0, C)[:, None], sees[:, None]

    def forward(self, x: Tensor, position: Tensor, ring_keys: Tensor, ring_values: Tensor, rel_keys: Tensor,
                u: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, d_model) at positions position[b] .. position[b] + T − 1, this layer's ring
        (B, H, C, D) of keys and of values before x, rel_keys (mem_len, H, D) = W_kR R_d for
        d = 0 .. mem_len − 1, u and v (H, D) -> the module's output (B, T, d_model) and the
        rings after x."""
        c = self.config
        B, T, _ = x.shape
        q, k, v_new = self.qkv_net(self.norm(x)).view(B, T, 3, c.n_head, c.d_head).unbind(dim=2)  # (B, T, H, D)
        keys = torch.cat([ring_keys.transpose(1, 2), k], dim=1)  # (B, C + T, H, D): the ring's slots, then x
        values = torch.cat([ring_values.transpose(1, 2), v_new], dim=1)
        distance, sees = self.window(position, T)  # (B, 1, T, C + T) each
        scores = relative_scores(q, keys, rel_keys, distance, u, v) * self.scale  # (B, H, T, C + T)
        # every query sees itself, so no row is all −inf
        probs = self.dropatt(torch.softmax(scores.masked_fill(~sees, float("-inf")), dim=-1))
        attended = torch.einsum("bhtk,bkhd->bthd", probs, values)  # (B, T, H, D)
        out = self.drop(self.o_net(attended.reshape(B, T, c.n_head * c.d_head)))  # (B, T, d_model)
        ring_keys = ring_write(ring_keys, position, k.transpose(1, 2))  # the last C positions stay
        ring_values = ring_write(ring_values, position, v_new.transpose(1, 2))
        return out, ring_keys, ring_values


class ConvolutionModule(nn.Module):
    """The convolution module: LayerNorm, pointwise to 2·d_model, GLU, causal depthwise
    convolution of kernel K, LayerNorm over channels (not BatchNorm: see the module
    docstring), Swish, pointwise, dropout."""

    def __init__(self, config: ConformerConfig):
        super().__init__()
        c = config
        self.kernel_size = c.kernel_size
        self.norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.pointwise_in = nn.Linear(c.d_model, 2 * c.d_model)
        # depthwise filter: output t = Σ_s weight[:, s] · input[t − (K − 1) + s] + bias (tap K − 1 is t)
        self.depthwise_weight = nn.Parameter(torch.empty(c.d_model, c.kernel_size))
        self.depthwise_bias = nn.Parameter(torch.zeros(c.d_model))
        # per position, over channels: batch statistics would mix rows and reach future positions
        self.conv_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.pointwise_out = nn.Linear(c.d_model, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        # as nn.Conv1d draws a depthwise filter (±1/√fan-in, fan-in K): init_weights's N(0, 0.02²)
        # would leave the depthwise output near LayerNorm's epsilon
        bound = 1.0 / math.sqrt(c.kernel_size)
        nn.init.uniform_(self.depthwise_weight, -bound, bound)

    def forward(self, x: Tensor, recent: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, T, d_model) after `recent` (B, K − 1, d_model), the depthwise convolution's last
        K − 1 inputs -> the module's output (B, T, d_model) and the new `recent`."""
        gated = F.glu(self.pointwise_in(self.norm(x)), dim=-1)  # (B, T, d_model): a ⊙ σ(b)
        convolved, recent = causal_depthwise_conv(gated, recent, self.depthwise_weight, self.depthwise_bias)
        out = self.pointwise_out(F.silu(self.conv_norm(convolved)))  # (B, T, d_model)
        return self.drop(out), recent


class ConformerBlock(nn.Module):
    """x̃ = x + ½FFN(x), x' = x̃ + MHSA(x̃), x'' = x' + Conv(x'), y = LayerNorm(x'' + ½FFN(x''))."""

    def __init__(self, config: ConformerConfig):
        super().__init__()
        c = config
        self.ff1_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.ff1 = swish_feed_forward(c.d_model, c.d_inner, c.dropout)
        self.attention = WindowedRelativeAttention(c)
        self.convolution = ConvolutionModule(c)
        self.ff2_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.ff2 = swish_feed_forward(c.d_model, c.d_inner, c.dropout)
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)

    def forward(self, x: Tensor, position: Tensor, recent: Tensor, ring_keys: Tensor, ring_values: Tensor,
                rel_keys: Tensor, u: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x (B, T, d_model) and this layer's state -> y (B, T, d_model), the convolution's
        recent inputs and the attention rings after x."""
        x = x + HALF_STEP * self.ff1(self.ff1_norm(x))  # x̃
        attended, ring_keys, ring_values = self.attention(x, position, ring_keys, ring_values, rel_keys, u, v)
        x = x + attended  # x'
        convolved, recent = self.convolution(x, recent)
        x = x + convolved  # x''
        x = self.final_norm(x + HALF_STEP * self.ff2(self.ff2_norm(x)))  # y
        return x, recent, ring_keys, ring_values


# -- the model -------------------------------------------------------------------------------------


class Conformer(LanguageModel):
    architecture = "conformer"
    config_class = ConformerConfig
    state_class = ConvWindowMemory
    state_kind = "window"  # a window of keys and values, and of convolution inputs
    state_grows_with_context = False  # per layer K − 1 inputs and mem_len − 1 keys and values
    max_piece_positions = 256  # a longer call runs in pieces of this many positions (bounds its memory)
    departures_from_the_paper = (
        "A causal language model over a stream, not the paper's speech encoder: the depthwise convolution pads on "
        "the left only; a LayerNorm over each position's channels replaces the paper's BatchNorm, whose batch and "
        "time statistics would mix sessions and leak the future; the relative-position attention sees a window of "
        "`mem_len` positions (Transformer-XL's memory); bytes come in through an embedding, without the "
        "subsampling front end (models/conformer.py).")
    chunking_invariant = True  # the module docstring's chunking semantics

    def __init__(self, config: ConformerConfig):
        super().__init__()
        c = config
        self.config = c
        if c.mem_len < 1 or c.kernel_size < 1:
            raise ValueError(f"mem_len and kernel_size must be at least 1, got {c.mem_len} and {c.kernel_size}")
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(ConformerBlock(c) for _ in range(c.n_layer))
        self.relative_keys = RelativeKeys(c.d_model, c.n_head, c.d_head, c.dropout)
        self.r_w_bias = nn.Parameter(torch.zeros(c.n_layer, c.n_head, c.d_head))  # u per layer
        self.r_r_bias = nn.Parameter(torch.zeros(c.n_layer, c.n_head, c.d_head))  # v per layer
        self.head = nn.Linear(c.d_model, c.vocab_size)  # after the last block's LayerNorm
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        init_weights(self, [self.r_w_bias, self.r_r_bias])  # the depthwise filters keep their own draw

    @property
    def receptive_field(self) -> int:
        """Bytes the log-probabilities at a position depend on, itself included:
        1 + n_layer · ((mem_len − 1) + (K − 1))."""
        c = self.config
        return 1 + c.n_layer * (c.mem_len + c.kernel_size - 2)

    @property
    def max_context(self) -> int | None:
        return None  # served as a stream from the state, never by recomputing windows of text

    # -- state --------------------------------------------------------------------------------

    def init_state(self, batch_size: int) -> ConvWindowMemory:
        c = self.config
        return ConvWindowMemory.empty(batch_size, [c.kernel_size] * c.n_layer, c.d_model, c.mem_len - 1, c.n_head,
                                      c.d_head, like=self.embedding.weight)

    def state_bytes(self, batch_size: int = 1) -> int:
        """The module docstring's formula: the bytes of a state, whatever its history."""
        c = self.config
        element = self.embedding.weight.element_size()
        per_layer = (c.kernel_size - 1) * c.d_model + 2 * c.n_head * (c.mem_len - 1) * c.d_head
        return batch_size * (8 + c.n_layer * per_layer * element)

    # -- serving and training -----------------------------------------------------------------

    def forward(self, tokens: Tensor, state: ConvWindowMemory) -> tuple[Tensor, ConvWindowMemory]:
        B, T = tokens.shape
        if T == 0:
            return tokens.new_zeros(B, 0, self.vocab_size, dtype=torch.float32), state
        c = self.config
        _, rel_keys = self.relative_keys([layer.attention.r_net for layer in self.layers], 0, c.mem_len - 1,
                                         like=self.r_w_bias)  # per layer (>= mem_len, H, D)
        rel_keys = [table[: c.mem_len] for table in rel_keys]
        recent, keys, values = list(state.conv_inputs), list(state.keys), list(state.values)

        def piece(chunk: Tensor, position: Tensor) -> Tensor:
            x = self.drop(self.embedding(chunk))  # (B, t, d_model)
            for l, layer in enumerate(self.layers):
                x, recent[l], keys[l], values[l] = layer(x, position, recent[l], keys[l], values[l], rel_keys[l],
                                                         self.r_w_bias[l], self.r_r_bias[l])
            return F.log_softmax(self.head(self.drop(x)).float(), dim=-1)  # (B, t, V)

        log_probs, position = forward_in_pieces(tokens, state.position, self.max_piece_positions, piece)
        # a state is a value: no gradient flows into the next call (truncated as in Transformer-XL);
        # the convolution inputs are copied out of the chunk they are a view of, which they would keep alive
        new_state = ConvWindowMemory(
            conv_inputs=[r.detach().clone() for r in recent], keys=[k.detach() for k in keys],
            values=[v.detach() for v in values], position=position,
        )
        return log_probs, new_state
