"""Longformer: causal sliding-window attention with per-head dilation and global prefix positions.

Paper: Iz Beltagy, Matthew E. Peters, Arman Cohan, "Longformer: The Long-Document Transformer",
arXiv:2004.05150, 2020 (sections 3.1 "Attention Pattern" and 4 "Autoregressive Language
Modeling", its character-level language model).

The attention pattern. Layer l has a window of w_l positions and head h of layer l a dilation
d_{l,h} (the paper's character LM widens the window with depth and dilates only a few heads of
the upper layers; the presets follow that). Query position i of head h sees

    window(i, h) = { i − k·d_h : k = 0 .. w − 1 } ∩ [0, i]        (dilated sliding window, causal)
    global(i)    = { 0 .. g − 1 } ∩ [0, i], less window(i, h)     (the g global positions)

and attends with

    Attention_h(i) = Σ_{j ∈ window ∪ global} softmax_j( q_i·k_j / √D + b_{h,j} ) v_j,
    b_{h,j} = r_h[(i − j) / d_h]  for j ∈ window(i, h)   (one learned bias per window slot)
    b_{h,j} = s_h[j]              for j ∈ global(i)      (one learned bias per global position)

The g global positions are the first g tokens of a session: every later query sees them, as
the paper's global attention lets every token see the task's global tokens (and as attention
sinks do). The paper's global tokens also attend to everything; under causal masking a global
position i < g already sees every earlier position (they are all global), so that holds here.
Simplification: the paper computes global attention with a second set of projections
(Q_g, K_g, V_g); here one set serves both, since causally the second set would only change the
outputs of the first g positions.

Positions are relative: a window key is told apart by its distance (i − j) / d_h, a global one
by its index j < g. No absolute position enters the network, so nothing depends on how far into
a session a query is (no position table to outgrow, no rotary angle to lose float precision at
position 10⁶), and the state need not hold anything but keys and values. (The paper's
character LM uses relative positions too, in the Transformer-XL way; a learned bias per window
slot is the smallest relative scheme that a bounded window allows.)

State between calls (`SlidingWindowMemory`): per layer, the keys and values of the last
C_l = w_l · max_h d_{l,h} positions in a ring buffer (models/layers/ring_buffer.py; the farthest
any head of the layer reaches back; every position among them is seen by some future query of
the most dilated head), the keys and values of the first g positions, and the number of
positions seen. Its size is fixed by the config,
    nbytes = 8·B + Σ_l 2·B·H·(C_l + g)·D·4   (float32),
the same after 4 KB and after 64 KB of history. Decoding a token attends to g + C_l keys per
layer and writes one ring slot: no recomputation of the context.

Chunking: which positions a query sees and with what bias depends only on the absolute
positions of the query and the key, and the state holds exactly the keys and values a future
query can still reach. So feeding a text in one call or in chunks of any size, down to one
token, gives the same log-probabilities (to float rounding). A long call is processed in pieces
of at most `max_piece_positions` positions internally, which by the same argument changes
nothing but the memory a call needs.

Training: the standard loop carries the state from one segment of a lane to the next (detached),
so a segment's first positions see the end of the previous one through the window, as when
serving; the lane's first g bytes are its global positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import FixedShapeState, LanguageModel, TransformerConfig
from xlserve.models.layers.block import PreNormBlock, forward_in_pieces
from xlserve.models.layers.init import init_weights
from xlserve.models.layers.ring_buffer import ring_positions, ring_write


@dataclass
class LongformerConfig(TransformerConfig):
    """vocab_size, n_layer, d_model, n_head, d_head and d_inner: TransformerConfig's (models/interface.py)."""

    # w per layer: one number for every layer, or a list of n_layer (the paper widens it with depth)
    window: int | list[int] = 64
    # d per layer and head: None for no dilation, else n_layer lists of n_head (the paper dilates
    # a few heads of the upper layers)
    dilation: list[list[int]] | None = None
    n_global: int = 4  # g: the first g positions of a session stay visible to every later query
    dropout: float = 0.0  # on embeddings, attention output and feed-forward
    dropatt: float = 0.0  # on attention probabilities
    layer_norm_epsilon: float = 1e-5
    tie_embedding: bool = True  # the next-byte softmax shares the input embedding matrix

    def layer_windows(self) -> list[int]:
        windows = [self.window] * self.n_layer if isinstance(self.window, int) else list(self.window)
        if len(windows) != self.n_layer or any(w < 1 for w in windows):
            raise ValueError(f"window must be a positive int or {self.n_layer} positive ints, got {self.window}")
        return windows

    def layer_dilations(self) -> list[list[int]]:
        if self.dilation is None:
            return [[1] * self.n_head for _ in range(self.n_layer)]
        rows = [list(r) for r in self.dilation]
        if len(rows) != self.n_layer or any(len(r) != self.n_head or min(r) < 1 for r in rows):
            raise ValueError(f"dilation must be {self.n_layer} lists of {self.n_head} positive ints, got {self.dilation}")
        return rows


# -- the state between calls -----------------------------------------------------------------------


@dataclass
class SlidingWindowMemory(FixedShapeState):
    """What a sliding-window model with global prefix positions keeps between calls, per layer
    (lists indexed by layer):

    ring_keys[l], ring_values[l]: (B, H, C_l, D) the keys and values of the last C_l positions,
        position p in slot p mod C_l; slots not written yet are zero
    global_keys[l], global_values[l]: (B, H, G, D) the keys and values of the first G positions
        of the history (slot j = position j); slots not reached yet are zero
    position: (B,) int64, the number of positions seen

    Every shape is fixed by the model's config, so rows of any histories concatenate with the
    default `State.concat` and the byte size is the same whatever the history:
    nbytes = 8·B + Σ_l 2·B·H·(C_l + G)·D·itemsize.
    """

    ring_keys: list[Tensor]
    ring_values: list[Tensor]
    global_keys: list[Tensor]
    global_values: list[Tensor]
    position: Tensor

    # a commit overwrites the ring slots (and global slots) of its new positions (State.delta_from)
    delta_axes = {"ring_keys": 2, "ring_values": 2, "global_keys": 2, "global_values": 2}

    @classmethod
    def empty(cls, batch_size: int, capacities: list[int], n_global: int, n_head: int, d_head: int,
              like: Tensor) -> "SlidingWindowMemory":
        """A memory that has seen nothing, with the dtype and device of `like`."""
        ring = lambda c: like.new_zeros(batch_size, n_head, c, d_head)  # noqa: E731
        return cls(
            ring_keys=[ring(c) for c in capacities],
            ring_values=[ring(c) for c in capacities],
            global_keys=[ring(n_global) for _ in capacities],
            global_values=[ring(n_global) for _ in capacities],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    def check_consistent(self) -> None:
        """State.check_consistent: as many layers of every kind, keys and values of one shape,
        `position` (B,) and not negative, and zeros in every slot no position has reached (a
        model never writes there, so anything else did not come from one)."""
        layers = {len(self.ring_keys), len(self.ring_values), len(self.global_keys), len(self.global_values)}
        if len(layers) != 1:
            raise ValueError(f"state has ring keys for {len(self.ring_keys)} layers, ring values for "
                             f"{len(self.ring_values)}, global keys for {len(self.global_keys)} and global "
                             f"values for {len(self.global_values)}")
        B = self.position.shape[0] if self.position.dim() == 1 else -1
        if self.position.dim() != 1:
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, expected (B,)")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' holds a negative number of positions")
        for kind in ("ring", "global"):
            for i, (keys, values) in enumerate(zip(getattr(self, f"{kind}_keys"), getattr(self, f"{kind}_values"))):
                if keys.shape != values.shape or keys.shape[0] != B:
                    raise ValueError(f"state tensors '{kind}_keys.{i}' {tuple(keys.shape)} and '{kind}_values.{i}' "
                                     f"{tuple(values.shape)} must have one shape with {B} rows")
                if kind == "ring":
                    unwritten = ring_positions(self.position, keys.shape[2]) < 0  # (B, C)
                else:
                    unwritten = torch.arange(keys.shape[2], device=keys.device)[None, :] >= self.position[:, None]
                for name, tensor in ((f"{kind}_keys.{i}", keys), (f"{kind}_values.{i}", values)):
                    if bool((tensor != 0).any(dim=-1).logical_and(unwritten[:, None, :]).any()):
                        raise ValueError(f"state tensor '{name}' holds values in slots that no position has "
                                         f"reached (position {self.position.tolist()})")


def prefix_write(prefix: Tensor, seen: Tensor, new: Tensor) -> Tensor:
    """A new prefix store (B, H, G, D) holding the first G positions of a history: `prefix` after
    `seen` (B,) positions, with the T positions `new` (B, H, T, D) that follow them written where
    they fall among the first G. Out of place."""
    G, T = prefix.shape[2], new.shape[2]
    if G == 0 or T == 0:
        return prefix
    source = torch.arange(G, device=seen.device)[None, :] - seen[:, None]  # (B, G): index into new
    lands = (source >= 0) & (source < T)
    index = source.clamp(0, T - 1)[:, None, :, None].expand(-1, prefix.shape[1], -1, prefix.shape[3])
    written = new.gather(2, index).to(prefix.dtype)
    return torch.where(lands[:, None, :, None], written, prefix)


# -- the model -------------------------------------------------------------------------------------


class SlidingWindowAttention(nn.Module):
    """Causal dilated sliding-window attention over a ring buffer of past keys and values, plus
    the g global prefix positions (the pattern of the module docstring)."""

    def __init__(self, config: LongformerConfig, window: int, dilations: list[int]):
        super().__init__()
        c = config
        self.config = c
        self.window = window  # w: window slots per head
        self.capacity = window * max(dilations)  # C: positions the ring keeps
        self.register_buffer("dilation", torch.tensor(dilations, dtype=torch.long), persistent=False)  # (H,)
        self.qkv_net = nn.Linear(c.d_model, 3 * c.n_head * c.d_head, bias=False)
        self.o_net = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)
        self.window_bias = nn.Parameter(torch.zeros(c.n_head, window))  # r_h[k], k = (i − j) / d_h
        self.global_bias = nn.Parameter(torch.zeros(c.n_head, c.n_global)) if c.n_global > 0 else None  # s_h[j]

    def pattern(self, query_positions: Tensor, key_positions: Tensor, key_valid: Tensor,
                windowed: Tensor, global_kind: Tensor) -> Tensor:
        """The additive attention bias (B, H, T, K): r_h or s_h where query i may see key j,
        −inf elsewhere. query_positions (B, T) and key_positions (B, K) are absolute positions;
        key_valid (B, K) is False for a slot holding nothing; a key may serve the window when
        `windowed` (K,) and the global positions when `global_kind` (K,) (the ring holds the
        window's keys, the global store the first g, the current chunk both)."""
        g = self.config.n_global
        dist = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # (B, 1, T, K)
        dilation = self.dilation[None, :, None, None]  # (1, H, 1, 1)
        near = (dist >= 0) & (torch.remainder(dist, dilation) == 0) & (dist < self.window * dilation)  # (B, H, T, K)
        valid = key_valid[:, None, None, :]
        in_window = near & valid & windowed[None, None, None, :]
        slot = torch.div(dist.clamp(min=0), dilation, rounding_mode="floor").clamp(max=self.window - 1)  # (B, H, T, K)
        heads = torch.arange(self.config.n_head, device=dist.device)[None, :, None, None]
        bias = torch.where(in_window, self.window_bias[heads, slot], float("-inf"))
        if self.global_bias is not None:
            is_global = (~near) & (dist >= 0) & valid & global_kind[None, None, None, :] \
                & (key_positions < g)[:, None, None, :]
            index = key_positions.clamp(0, g - 1)  # (B, K)
            global_bias = self.global_bias[:, index].permute(1, 0, 2)[:, :, None, :]  # (B, H, 1, K)
            bias = torch.where(is_global, global_bias, bias)
        return bias

    def forward(self, x: Tensor, position: Tensor, memory: tuple[Tensor, Tensor, Tensor, Tensor]):
        """x (B, T, d_model) at positions position[b] .. position[b] + T − 1; memory = this
        layer's (ring keys, ring values, global keys, global values) before x. Returns the
        attention output (B, T, d_model) and the memory after x."""
        c = self.config
        B, T, _ = x.shape
        ring_keys, ring_values, global_keys, global_values = memory
        q, k, v = self.qkv_net(x).view(B, T, 3, c.n_head, c.d_head).permute(2, 0, 3, 1, 4)  # (B, H, T, D) each
        keys = torch.cat([global_keys, ring_keys, k], dim=2)  # (B, H, g + C + T, D)
        values = torch.cat([global_values, ring_values, v], dim=2)

        g, C, device = c.n_global, self.capacity, x.device
        offsets = torch.arange(T, device=device)
        query_positions = position[:, None] + offsets[None, :]  # (B, T)
        ring_at = ring_positions(position, C)  # (B, C)
        global_at = torch.arange(g, device=device).expand(B, g)
        key_positions = torch.cat([global_at, ring_at, query_positions], dim=1)  # (B, K)
        key_valid = torch.cat([global_at < position[:, None], ring_at >= 0,
                               torch.ones(B, T, dtype=torch.bool, device=device)], dim=1)
        kinds = lambda a, b, t: torch.cat([torch.full((n,), flag, dtype=torch.bool, device=device)  # noqa: E731
                                           for n, flag in ((g, a), (C, b), (T, t))])
        # the pattern depends on positions alone: rows that all stand at one position (training
        # lanes, a batch of fresh prompts) share one (1, H, T, K) bias instead of B copies of it
        rows = slice(0, 1) if B > 1 and bool((position == position[0]).all()) else slice(None)
        bias = self.pattern(query_positions[rows], key_positions[rows], key_valid[rows],
                            windowed=kinds(False, True, True), global_kind=kinds(True, False, True))
        attended = self.attend(q, keys, values, bias.to(q.dtype))  # (B, H, T, D)
        out = self.o_net(attended.transpose(1, 2).reshape(B, T, -1))  # (B, T, d_model)
        memory = (ring_write(ring_keys, position, k), ring_write(ring_values, position, v),
                  prefix_write(global_keys, position, k), prefix_write(global_values, position, v))
        return out, memory

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
        """softmax(q kᵀ / √D + bias) v: q (B, H, T, D), keys and values (B, H, K, D), bias
        (B or 1, H, T, K) -> (B, H, T, D). Every query sees itself, so no row is all −inf."""
        dropatt = self.config.dropatt if self.training else 0.0
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, dropout_p=dropatt)


class Longformer(LanguageModel):
    architecture = "longformer"
    config_class = LongformerConfig
    state_class = SlidingWindowMemory
    state_kind = "window"
    state_grows_with_context = False  # per layer C_l + g keys and values, whatever the history
    max_piece_positions = 1024  # a longer call runs in pieces of this many positions (bounds its memory)
    chunking_invariant = True  # the module docstring's chunking semantics

    def __init__(self, config: LongformerConfig):
        super().__init__()
        c = config
        self.config = c
        if c.n_global < 0:
            raise ValueError("n_global must not be negative")
        windows, dilations = c.layer_windows(), c.layer_dilations()
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(
            PreNormBlock(SlidingWindowAttention(c, w, d), c.d_model, c.d_inner, c.dropout, c.layer_norm_epsilon)
            for w, d in zip(windows, dilations))
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.head = nn.Linear(c.d_model, c.vocab_size)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        extra = []
        for layer in self.layers:
            extra.append(layer.attention.window_bias)
            if layer.attention.global_bias is not None:
                extra.append(layer.attention.global_bias)
        init_weights(self, extra)

    @property
    def capacities(self) -> list[int]:
        """C_l: positions each layer's ring keeps."""
        return [layer.attention.capacity for layer in self.layers]

    @property
    def max_context(self) -> int | None:
        """Unbounded with global positions (the first g tokens stay visible); else the
        receptive field of the stacked windows, 1 + Σ_l (w_l − 1)·max_h d_{l,h}."""
        if self.config.n_global > 0:
            return None
        return 1 + sum(layer.attention.capacity - max(layer.attention.dilation.tolist()) for layer in self.layers)

    # -- state --------------------------------------------------------------------------------

    def init_state(self, batch_size: int) -> SlidingWindowMemory:
        c = self.config
        return SlidingWindowMemory.empty(batch_size, self.capacities, c.n_global, c.n_head, c.d_head,
                                         like=self.embedding.weight)

    # -- serving and training -----------------------------------------------------------------

    def forward(self, tokens: Tensor, state: SlidingWindowMemory) -> tuple[Tensor, SlidingWindowMemory]:
        B, T = tokens.shape
        if T == 0:
            return tokens.new_zeros(B, 0, self.vocab_size, dtype=torch.float32), state
        memories = list(zip(state.ring_keys, state.ring_values, state.global_keys, state.global_values))

        def piece(chunk: Tensor, position: Tensor) -> Tensor:
            x = self.drop(self.embedding(chunk))  # (B, t, d_model)
            for i, layer in enumerate(self.layers):
                x, memories[i] = layer(x, position, memories[i])
            return F.log_softmax(self.head(self.drop(self.final_norm(x))).float(), dim=-1)  # (B, t, V)

        log_probs, position = forward_in_pieces(tokens, state.position, self.max_piece_positions, piece)
        detached = [[t.detach() for t in m] for m in memories]  # the next call never backpropagates into this one
        new_state = SlidingWindowMemory(
            ring_keys=[m[0] for m in detached], ring_values=[m[1] for m in detached],
            global_keys=[m[2] for m in detached], global_values=[m[3] for m in detached],
            position=position,
        )
        return log_probs, new_state
