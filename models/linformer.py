"""Linformer, served causally: full attention inside the open segment, and every completed segment
compressed along the sequence by learned projections into a few slots of a bounded memory.

Paper: Sinong Wang, Belinda Z. Li, Madian Khabsa, Han Fang, Hao Ma, "Linformer: Self-Attention
with Linear Complexity", arXiv:2006.04768, 2020 (section 4, "Model", and its "Additional
Efficiency Techniques").

The paper's attention. Linformer projects the n keys and values of a sequence along the sequence
with learned matrices E, F (k × n) before attending, so each head attends to k slots instead of
n positions:

    head = softmax( Q (E K)ᵀ / √D ) · F V,        E K, F V: (k × D)

(with the parameter sharing of section 4; here E and F are shared by the heads of a layer, the
paper's "headwise" sharing, and each layer has its own). As published this is not causal: every
slot E K mixes the keys of the whole sequence, the future included, so a query would see tokens
after it. A language model that is served token by token cannot use it as it stands.

The causal adaptation (ours, not the paper's). The history is cut into segments of L =
`segment_len` positions at fixed absolute positions: segment s holds positions sL .. sL + L − 1
of the positions the state has seen. Only a *completed* segment is compressed: its keys K_s and
values V_s (L × D) become k = `compressed_len` slots E_l K_s and F_l V_s, with E_l, F_l (k × L)
the learned projections of layer l. A query at position i of segment s attends to

    the compressed slots of the M = `memory_segments` segments before its own, s − M .. s − 1,
    and the keys of its own segment up to itself, sL .. i (full causal attention, uncompressed):

    out_i = Σ_{a=1..M} Σ_{r<k} w_{i,a,r} (F V_{s−a})_r  +  Σ_{j=sL..i} w_{i,j} v_j
    w = softmax over all of them of  q_i·(E K_{s−a})_r / √D + b_h[M − a, r]   and   q_i·k_j / √D

with b_h (M × k) a learned bias per head, age and slot (the only thing that tells the query how
old a compressed segment is). A slot never mixes a key the query should not see: a segment is
compressed only once all its positions are in the past of every query that can see it. The
oldest compressed segment is dropped when a new one completes, so a query looks back at most
M·L positions in compressed form plus L in full, per layer (further over layers).

Positions. Each byte's input is its embedding plus a learned embedding of its offset i mod L in
its segment (one (L, d_model) table), and compressed slots carry their learned bias b_h[age, r]
and nothing else. Why: the offset is all the attention pattern depends on (which keys of the open
segment a query sees, which column of E and F a key is weighted by), and it is the same whichever
call a byte arrives in. The columns of E and F already tell positions inside a segment apart, the
age bias tells segments apart. An absolute position would need a table as long as the longest
session (unbounded) and would mean nothing to a slot that summarises L positions; the offset
needs only the count of positions seen, a number in the state.

State between calls (`CompressedSegmentMemory`): per layer
the open segment's keys and values (L slots, zeros past its offset) and the compressed slots of
the last M completed segments (M × k slots of keys and values), and the count of positions seen:

    nbytes = 8·B + Σ_l 2·B·H·(L + M·k)·D·4   (float32),

fixed by the config, the same after 4 KB and after 64 KB of history (the preset "small": L = 64,
M = 8, k = 16: 1,179,656 bytes). Decoding a token scores M·k + L + 1 keys per layer (the slots,
the open segment's L slots, itself; those not reached yet masked), and compresses one segment
(k × L × D per head) every L tokens.

Chunking. Segment boundaries sit at absolute multiples of L, a slot is a function of its
segment's keys only, and the state holds exactly the keys and slots a future query can see. So
which keys a query sees, and with which bias, depends only on absolute positions, and feeding a
text in one call or in chunks of any size, down to one token, gives the same log-probabilities
(to float rounding: only the order of additions differs). A call is processed in pieces of at
most `max_piece_positions` positions, which by the same argument changes nothing but the memory
a call needs: a piece of T positions attends with (M + G)·k + L + T keys per query (G ≤ ⌈T/L⌉
segments completed inside it), linear in the call's length overall.

`max_context` is None although a query's receptive field is bounded (about n_layer·M·L + L
positions): the boundaries are fixed by the session's history, so the model is not a window
that could be re-run from an empty state over the last N bytes with the same result.

Training: the standard loop, the state carried from one training segment to the next (detached,
as Transformer-XL carries its memory). E and F receive gradients only where a segment completes
inside a call and a later query of the same call attends to its slots (slots from an earlier
call are detached), so a training segment must span more than one model segment: the preset
"small" takes L = 64 with the standard recipe's 128-byte training segments, and every second
half of a step sees the first half compressed in the graph. E and F start as mean pooling over k
contiguous runs of the segment (the paper names pooling as one alternative to a learned
projection), which is a reasonable summary before they are learned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import FixedShapeState, LanguageModel, TransformerConfig
from xlserve.models.layers.block import PreNormBlock, forward_in_pieces
from xlserve.models.layers.init import init_weights


@dataclass
class LinformerConfig(TransformerConfig):
    """vocab_size, n_layer, d_model, n_head, d_head and d_inner: TransformerConfig's (models/interface.py)."""

    segment_len: int = 64  # L: positions per segment; full causal attention inside the open one
    compressed_len: int = 16  # k: slots a completed segment is compressed into (the paper's projected dimension)
    memory_segments: int = 8  # M: compressed segments kept; the oldest is dropped when one more completes
    dropout: float = 0.0  # on embeddings, attention output and feed-forward
    dropatt: float = 0.0  # on attention probabilities
    layer_norm_epsilon: float = 1e-5
    tie_embedding: bool = True  # the next-byte softmax shares the input embedding matrix


# -- the state between calls -----------------------------------------------------------------------


@dataclass
class CompressedSegmentMemory(FixedShapeState):
    """The open segment's keys and values as they are, and the last M completed segments
    compressed into k slots each. What every slot holds follows from the number of positions
    seen alone, so every shape is fixed by the config: rows of any histories batch with the
    default `State.concat`. Completing a segment shifts the groups by one, dropping the oldest.
    The field names are the tensors' names when saved ("open_keys.0", "slot_values.1", "position").

    Per layer l (lists indexed by layer), batch on dimension 0:

    open_keys[l], open_values[l]: (B, H, L, D) the keys and values of the open segment, slot j
        = offset j in it; zeros from offset `position mod L` on
    slot_keys[l], slot_values[l]: (B, H, M, k, D) the compressed slots (E·K, F·V) of the last M
        completed segments, oldest first (group M − 1 is the segment just before the open one);
        zeros in the first M − min(position div L, M) groups (segments that do not exist)
    position: (B,) int64, the number of positions seen

    Bytes per session: 8 + Σ_l 2·H·(L + M·k)·D·itemsize, whatever the history.
    """

    open_keys: list[Tensor]
    open_values: list[Tensor]
    slot_keys: list[Tensor]
    slot_values: list[Tensor]
    position: Tensor

    @classmethod
    def empty(cls, batch_size: int, n_layer: int, n_head: int, d_head: int, segment_len: int,
              memory_segments: int, compressed_len: int, like: Tensor) -> "CompressedSegmentMemory":
        """A memory that has seen nothing, with the dtype and device of `like`."""
        opened = lambda: like.new_zeros(batch_size, n_head, segment_len, d_head)  # noqa: E731
        slots = lambda: like.new_zeros(batch_size, n_head, memory_segments, compressed_len, d_head)  # noqa: E731
        return cls(
            open_keys=[opened() for _ in range(n_layer)],
            open_values=[opened() for _ in range(n_layer)],
            slot_keys=[slots() for _ in range(n_layer)],
            slot_values=[slots() for _ in range(n_layer)],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    def check_consistent(self) -> None:
        """State.check_consistent: as many layers of every list, keys and values of one shape
        with the rows of `position`, a position that is not negative, and zeros wherever no
        position has been written yet (open slots past the open segment's offset, memory groups
        of segments that do not exist): a forward never writes there."""
        layers = {len(self.open_keys), len(self.open_values), len(self.slot_keys), len(self.slot_values)}
        if len(layers) != 1:
            raise ValueError(f"state has open keys for {len(self.open_keys)} layers, open values for "
                             f"{len(self.open_values)}, slot keys for {len(self.slot_keys)} and slot values "
                             f"for {len(self.slot_values)}")
        if self.position.dim() != 1:
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, expected (B,)")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' holds a negative number of positions")
        rows = self.position.shape[0]
        for kind, dims in (("open", 4), ("slot", 5)):
            for i, (keys, values) in enumerate(zip(getattr(self, f"{kind}_keys"), getattr(self, f"{kind}_values"))):
                if keys.shape != values.shape or keys.dim() != dims or keys.shape[0] != rows:
                    raise ValueError(f"state tensors '{kind}_keys.{i}' {tuple(keys.shape)} and '{kind}_values.{i}' "
                                     f"{tuple(values.shape)} must have one shape of {dims} dims with {rows} rows")
        for i, (keys, values) in enumerate(zip(self.open_keys, self.open_values)):
            L = keys.shape[2]
            # (B, L): slot j is past the open segment's offset
            unwritten = torch.arange(L, device=keys.device)[None, :] >= (self.position % max(L, 1))[:, None]
            self._refuse_written(f"open_keys.{i}", keys, unwritten)
            self._refuse_written(f"open_values.{i}", values, unwritten)
        if self.open_keys:
            L = max(self.open_keys[0].shape[2], 1)
            for i, (keys, values) in enumerate(zip(self.slot_keys, self.slot_values)):
                M = keys.shape[2]
                completed = torch.div(self.position, L, rounding_mode="floor").clamp(max=M)  # (B,)
                # (B, M): group m holds a segment only once M − m segments are complete
                unwritten = torch.arange(M, device=keys.device)[None, :] < (M - completed)[:, None]
                self._refuse_written(f"slot_keys.{i}", keys, unwritten)
                self._refuse_written(f"slot_values.{i}", values, unwritten)

    def _refuse_written(self, name: str, tensor: Tensor, unwritten: Tensor) -> None:
        """Raise unless `tensor` (B, H, S, ...) is zero in every slot s where unwritten (B, S)."""
        written = tensor.ne(0).flatten(3).any(dim=-1)  # (B, H, S)
        if bool((written & unwritten[:, None, :]).any()):
            raise ValueError(f"state tensor '{name}' holds values in slots that no position has reached "
                             f"(position {self.position.tolist()})")


# -- segments and their compression ----------------------------------------------------------------


def pooling_projection(compressed_len: int, segment_len: int) -> Tensor:
    """(k, L): row r averages the offsets r·L div k .. (r + 1)·L div k − 1 (k ≤ L, none empty)."""
    offsets = torch.arange(segment_len)
    run = offsets * compressed_len // segment_len  # (L,): the run each offset falls in
    rows = (run[None, :] == torch.arange(compressed_len)[:, None]).float()  # (k, L)
    return rows / rows.sum(dim=1, keepdim=True)


def gather_along_slots(x: Tensor, index: Tensor) -> Tensor:
    """x (B, H, N, ...) at `index` (B or 1, S) along dimension 2 -> (B, H, S, ...)."""
    B, H, rest = x.shape[0], x.shape[1], x.shape[3:]
    expanded = index.view(index.shape[0], 1, index.shape[1], *([1] * len(rest))).expand(B, H, index.shape[1], *rest)
    return x.gather(2, expanded)


@dataclass
class PieceLayout:
    """Where a piece of T positions falls on the segment grid; the same for every layer, since
    absolute positions alone decide it. "Aligned" indices u count positions from the start of
    the segment that was open before the piece (the piece's first position is at u = offset);
    "raw" keys are the L open slots followed by the piece's T positions; compressed groups are
    the state's M, followed by the G segments that complete inside the piece (G: the most over
    the rows). Tensors with B' rows are shared by all rows when they stand at one position."""

    slot_visible: Tensor  # (B', T, M + G) bool: the query sees compressed group c
    slot_group: Tensor  # (B', T, M + G) long: the bias group of c for it (M − age), clamped where unseen
    raw_visible: Tensor  # (B', T, L + T) bool: the query sees raw key r
    compress_source: Tensor  # (B', G·L): the raw key at aligned index u, for the segments completed here
    open_source: Tensor  # (B', L): the raw key that becomes slot j of the open segment after the piece
    open_written: Tensor  # (B', L) bool: slot j is within the open segment's offset after the piece
    memory_source: Tensor  # (B', M): the compressed group that becomes group m of the memory after the piece

    @property
    def completed_positions(self) -> int:
        """G·L: the positions of the segments that complete inside the piece (0 for most decode steps)."""
        return self.compress_source.shape[1]

    @classmethod
    def of(cls, position: Tensor, T: int, segment_len: int, memory_segments: int) -> "PieceLayout":
        """The layout of the T positions after `position` (B',) positions seen."""
        L, M, device = segment_len, memory_segments, position.device
        offset = position % L  # (B',): o, where the piece starts in the open segment
        completed = torch.div(position, L, rounding_mode="floor")  # (B',) segments complete before the piece
        end = offset + T  # (B',) aligned index after the piece
        done = torch.div(end, L, rounding_mode="floor")  # (B',) segments completed inside the piece
        G = int(done.max())
        u = offset[:, None] + torch.arange(T, device=device)[None, :]  # (B', T) aligned index of each query
        block = torch.div(u, L, rounding_mode="floor")[..., None]  # (B', T, 1): its segment, 0 = the one open before
        # compressed group c holds segment c − M (the state's, c < M, then the piece's); query in
        # segment g sees segments g − M .. g − 1, i.e. groups g .. g + M − 1, of which the state's
        # exist only once that many segments completed
        groups = torch.arange(M + G, device=device)[None, None, :]  # (1, 1, M + G)
        slot_visible = (groups >= block) & (groups < block + M) & (groups >= (M - completed)[:, None, None])
        slot_group = (groups - block).clamp(0, M - 1)  # age a = M − (c − g): bias group c − g
        r = torch.arange(L + T, device=device)[None, :]  # (1, L + T)
        raw_u = torch.where(r < L, r, offset[:, None] + r - L)  # (B', L + T)
        raw_written = (r >= L) | (r < offset[:, None])  # open slots past the offset hold nothing
        raw_visible = raw_written[:, None, :] & (raw_u[:, None, :] <= u[..., None]) \
            & (torch.div(raw_u, L, rounding_mode="floor")[:, None, :] == block)  # causal, own segment only

        def source(aligned: Tensor) -> Tensor:  # aligned indices (B', S) -> raw indices
            raw = torch.where(aligned < offset[:, None], aligned, L + aligned - offset[:, None])
            return raw.clamp(0, L + T - 1)  # past the piece (a row that completes fewer): never used

        slots = torch.arange(L, device=device)[None, :]
        return cls(
            slot_visible=slot_visible,
            slot_group=slot_group,
            raw_visible=raw_visible,
            compress_source=source(torch.arange(G * L, device=device)[None, :].expand(position.shape[0], -1)),
            open_source=source(done[:, None] * L + slots),
            open_written=slots < (end % L)[:, None],
            memory_source=done[:, None] + torch.arange(M, device=device)[None, :],
        )


class SegmentCompressedAttention(nn.Module):
    """Causal attention to the open segment's keys and to the compressed slots (E K, F V) of the
    M segments before it (the module docstring's equation)."""

    def __init__(self, config: LinformerConfig):
        super().__init__()
        c = config
        self.config = c
        self.qkv_net = nn.Linear(c.d_model, 3 * c.n_head * c.d_head, bias=False)
        self.o_net = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)
        self.key_projection = nn.Parameter(pooling_projection(c.compressed_len, c.segment_len))  # E (k, L)
        self.value_projection = nn.Parameter(pooling_projection(c.compressed_len, c.segment_len))  # F (k, L)
        self.slot_bias = nn.Parameter(torch.zeros(c.n_head, c.memory_segments, c.compressed_len))  # b_h[M − age, r]

    def compress(self, projection: Tensor, segments: Tensor) -> Tensor:
        """E K_s (or F V_s) of every segment: projection (k, L), segments (B, H, G, L, D) ->
        (B, H, G, k, D), the same projection for every head."""
        return torch.einsum("rl,bhgld->bhgrd", projection.to(segments.dtype), segments)

    def pattern(self, layout: PieceLayout) -> Tensor:
        """The additive attention bias (B', H, T, (M + G)·k + L + T): b_h[group, r] on the
        compressed slots a query sees, 0 on the raw keys it sees, −inf elsewhere."""
        bias = self.slot_bias[:, layout.slot_group].permute(1, 0, 2, 3, 4)  # (B', H, T, M + G, k)
        bias = torch.where(layout.slot_visible[:, None, :, :, None], bias, float("-inf")).flatten(3)
        raw = torch.full(layout.raw_visible.shape, float("-inf"), device=bias.device, dtype=bias.dtype)
        raw = raw.masked_fill(layout.raw_visible, 0.0)[:, None].expand(-1, bias.shape[1], -1, -1)  # (B', H, T, L + T)
        return torch.cat([bias, raw], dim=-1)

    def forward(self, x: Tensor, layout: PieceLayout, memory: tuple[Tensor, Tensor, Tensor, Tensor]):
        """x (B, T, d_model), the piece laid out by `layout`; memory = this layer's (open keys,
        open values, slot keys, slot values) before x. Returns the attention output (B, T,
        d_model) and the memory after x."""
        c = self.config
        B, T, _ = x.shape
        L = c.segment_len
        open_keys, open_values, slot_keys, slot_values = memory  # (B, H, L, D), (B, H, M, k, D)
        q, k, v = self.qkv_net(x).view(B, T, 3, c.n_head, c.d_head).permute(2, 0, 3, 1, 4)  # (B, H, T, D) each
        raw_keys = torch.cat([open_keys, k], dim=2)  # (B, H, L + T, D): the open slots, then the piece
        raw_values = torch.cat([open_values, v], dim=2)
        if layout.completed_positions > 0:  # segments completed inside the piece: compress them now
            G = layout.completed_positions // L
            segments = lambda raw: gather_along_slots(raw, layout.compress_source).view(B, c.n_head, G, L, c.d_head)  # noqa: E731
            slot_keys = torch.cat([slot_keys, self.compress(self.key_projection, segments(raw_keys))], dim=2)
            slot_values = torch.cat([slot_values, self.compress(self.value_projection, segments(raw_values))], dim=2)
        keys = torch.cat([slot_keys.flatten(2, 3), raw_keys], dim=2)  # (B, H, (M + G)·k + L + T, D)
        values = torch.cat([slot_values.flatten(2, 3), raw_values], dim=2)
        bias = self.pattern(layout).to(q.dtype)
        dropatt = c.dropatt if self.training else 0.0
        # every query sees itself, so no row of the bias is all −inf
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, dropout_p=dropatt)  # (B, H, T, D)
        out = self.o_net(attended.transpose(1, 2).reshape(B, T, -1))  # (B, T, d_model)

        written = layout.open_written[:, None, :, None]  # (B', 1, L, 1)
        memory = (
            torch.where(written, gather_along_slots(raw_keys, layout.open_source), 0.0),
            torch.where(written, gather_along_slots(raw_values, layout.open_source), 0.0),
            gather_along_slots(slot_keys, layout.memory_source),  # the last M compressed segments
            gather_along_slots(slot_values, layout.memory_source),
        )
        return out, memory


# -- the model -------------------------------------------------------------------------------------


class Linformer(LanguageModel):
    architecture = "linformer"
    config_class = LinformerConfig
    state_class = CompressedSegmentMemory
    state_kind = "window"  # the open segment's keys and values, and a bounded window of compressed segments
    state_grows_with_context = False  # per layer L + M·k slots of keys and values, whatever the history
    max_piece_positions = 256  # a longer call runs in pieces of this many positions (bounds its memory)
    chunking_invariant = True  # the module docstring's chunking semantics
    departures_from_the_paper = (
        "As published, Linformer projects the keys and values of a whole sequence, the future included, into k "
        "slots, which a causal language model cannot use. Served here causally (our adaptation): full causal "
        "attention inside the open segment of `segment_len` positions, and each completed segment's keys and values "
        "compressed by the learned projections E, F into `compressed_len` slots, kept for the last "
        "`memory_segments` segments with a learned bias per age. Segment boundaries sit at fixed positions of the "
        "history, so any chunking of a text gives the same log-probabilities (models/linformer.py).")

    def __init__(self, config: LinformerConfig):
        super().__init__()
        c = config
        self.config = c
        if c.segment_len < 1 or c.memory_segments < 1 or not 1 <= c.compressed_len <= c.segment_len:
            raise ValueError(f"need segment_len >= 1, memory_segments >= 1 and 1 <= compressed_len <= segment_len, "
                             f"got {c.segment_len}, {c.memory_segments}, {c.compressed_len}")
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.offset_embedding = nn.Parameter(torch.zeros(c.segment_len, c.d_model))  # offset i mod L
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(PreNormBlock(SegmentCompressedAttention(c), c.d_model, c.d_inner, c.dropout,
                                                 c.layer_norm_epsilon) for _ in range(c.n_layer))
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.head = nn.Linear(c.d_model, c.vocab_size)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        init_weights(self, [self.offset_embedding] + [layer.attention.slot_bias for layer in self.layers])
        # E and F keep their mean-pooling start (pooling_projection): init_weights draws neither

    @property
    def max_context(self) -> int | None:
        return None  # any history; a bounded look-back of it, on a grid fixed by the session (docstring)

    # -- state --------------------------------------------------------------------------------

    def init_state(self, batch_size: int) -> CompressedSegmentMemory:
        c = self.config
        return CompressedSegmentMemory.empty(batch_size, c.n_layer, c.n_head, c.d_head, c.segment_len,
                                             c.memory_segments, c.compressed_len, like=self.embedding.weight)

    # -- serving and training -----------------------------------------------------------------

    def forward(self, tokens: Tensor, state: CompressedSegmentMemory) -> tuple[Tensor, CompressedSegmentMemory]:
        c = self.config
        B, T = tokens.shape
        if T == 0:
            return tokens.new_zeros(B, 0, self.vocab_size, dtype=torch.float32), state
        memories = list(zip(state.open_keys, state.open_values, state.slot_keys, state.slot_values))

        def piece(chunk: Tensor, position: Tensor) -> Tensor:
            t = chunk.shape[1]
            # the layout depends on positions alone: rows that all stand at one position
            # (training lanes, a batch of fresh prompts) share one
            shared = B > 1 and bool((position == position[0]).all())
            layout = PieceLayout.of(position[:1] if shared else position, t, c.segment_len, c.memory_segments)
            offsets = (position[:, None] + torch.arange(t, device=tokens.device)[None, :]) % c.segment_len  # (B, t)
            x = self.drop(self.embedding(chunk) + self.offset_embedding[offsets])  # (B, t, d_model)
            for i, layer in enumerate(self.layers):
                x, memories[i] = layer(x, layout, memories[i])
            return F.log_softmax(self.head(self.drop(self.final_norm(x))).float(), dim=-1)  # (B, t, V)

        log_probs, position = forward_in_pieces(tokens, state.position, self.max_piece_positions, piece)
        detached = [[m.detach() for m in memory] for memory in memories]  # the next call never backpropagates into this one
        new_state = CompressedSegmentMemory(
            open_keys=[m[0] for m in detached], open_values=[m[1] for m in detached],
            slot_keys=[m[2] for m in detached], slot_values=[m[3] for m in detached],
            position=position,
        )
        return log_probs, new_state
