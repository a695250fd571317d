"""LogSparse attention: a causal byte-level transformer whose queries attend to a local window
and to positions at exponentially growing distances, restarting every R positions.

Paper: Shiyang Li, Xiaoyong Jin, Yao Xuan, Xiyou Zhou, Wenhu Chen, Yu-Xiang Wang, Xifeng Yan,
"Enhancing the Locality and Breaking the Memory Bottleneck of Transformer on Time Series
Forecasting", NeurIPS 2019 (section 3.3 and figure 3).

The pattern. The paper's LogSparse self-attention lets cell l attend to itself and to the cells
at exponentially growing distances before it,

    I_l = { l − 2^⌊log2 l⌋, l − 2^(⌊log2 l⌋−1), ..., l − 2^1, l − 2^0, l },

adds *local attention* (each cell densely attends to a window of its most recent cells, the
exponential steps resuming beyond it) and *restart attention* (the input is divided into
subsequences and the LogSparse pattern is applied to each of them, so l counts from the start of
the query's subsequence). Here, with positions i = 0, 1, 2, ... counted from a session's first
byte, R = `restart_len` (the subsequence length), w = `local_window`, and r = i mod R the
query's offset in its subsequence, query i attends to key j exactly when

    0 <= j <= i   and   ( i − j < w                          (local window)
                          or i − j = 2^k <= r for some k >= 0 )  (LogSparse inside the subsequence)

i.e. to the distances D(r) = {0, ..., w−1} ∪ {2^k : w <= 2^k <= r}
(`logsparse_distances`), with ordinary softmax weights
softmax(q kᵀ / √d_head) over those keys (no other weighting). The exponential steps stop at the
subsequence's start (2^k <= r): that is the restart. The local window is not cut at the start of
a subsequence (the paper does not say; a window cut there would leave the first byte of every
subsequence with no context at all, and across layers the window is what carries information
from one subsequence to the next). A query sees at most A = w + #{k : w <= 2^k <= R−1} keys,
so a layer costs O(T · A · d) for T queries, whatever the history.

Positions. Each byte's input is its embedding plus a learned embedding of its offset r = i mod R
in its subsequence (one (R, d_model) table). The offset is what the restarting pattern itself
depends on, it needs only the count of positions seen (a number in the state), and it is the
same whichever call a byte arrives in; absolute positions would need a table as long as the
longest session (unbounded) and relative encodings would add nothing the offset and the fixed
distance set do not already tell the query.

State between calls (`LookbackMemory`). No future query looks
further back than S = max(w − 1, 2^⌊log2(R−1)⌋) positions (the local window, or the longest
exponential step that fits in a subsequence), so the state keeps, per layer, the keys and
values of the last S positions and the count of positions seen: 2 · n_layer · S · n_head ·
d_head floats + 8 bytes per session, the same after 4 KB and after 64 KB of history (the
preset "small": S = 128, 786,440 bytes in float32). Keys and values are position-local
functions of the layer's input, so keeping them instead of the inputs gives the same result
without re-projecting them. Some of the S slots are not reachable by any future query (positions
of an earlier subsequence beyond the local window); the buffer keeps a fixed shape so that rows
of any histories batch together and a step writes nothing but the new positions.

Chunking. Every query's keys are fixed by its absolute position (the pattern above) and every
key is a function of the bytes up to it, so feeding a text in one call or in chunks of any size,
down to one byte at a time, gives the same log-probabilities (to float rounding). A decoding
step gathers its A keys from the state: its attention costs O(A · d) per layer; forming the new
state copies the S kept positions once per layer (a memory copy, no arithmetic per position).
A chunk of `dense_from_queries` or more queries (a prompt, a training segment) instead scores
all S + T keys in one matrix product under the same pattern as a mask: gathering A copies of
keys per query costs more than that once T is large, and both give the same weights.

Training uses the standard loop: segments of the stream in order, the state carried from one
segment to the next (detached, as Transformer-XL's memory), so training sees the pattern exactly
as serving does.
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


@dataclass
class LogSparseConfig(TransformerConfig):
    """vocab_size, n_layer, d_model, n_head, d_head and d_inner: TransformerConfig's (models/interface.py)."""

    local_window: int = 16  # w: each query sees itself and the w-1 positions before it
    restart_len: int = 256  # R: subsequence length; exponential steps stay inside a query's subsequence
    dropout: float = 0.0  # on embeddings, attention output and feed-forward
    dropatt: float = 0.0  # on attention probabilities
    layer_norm_epsilon: float = 1e-5
    tie_embedding: bool = True  # the next-byte softmax shares the input embedding matrix


# -- the state between calls -----------------------------------------------------------------------


@dataclass
class LookbackMemory(FixedShapeState):
    """The keys and values of the last S positions, per layer, and how many positions a session
    has seen: no query looks further back than S, so nothing older is needed.

    keys[l], values[l]: (B, S, H, D), layer l's keys and values of the last S positions seen,
    aligned to the end: slot S-1 holds the last position seen, slot S-1-d the position d before
    it; slots of positions before the session's first token hold zeros and are never attended to
    (the model masks them from `position`). position: (B,) int64, the number of positions each row
    has seen (its next token's absolute position). Every session's state has the same shape, so
    rows with different histories batch with the default `concat`, and `nbytes` is the same after
    4 KB and after 64 KB."""

    keys: list[Tensor]
    values: list[Tensor]
    position: Tensor

    # a commit slides the look-back window by the new positions (State.delta_from)
    delta_axes = {"keys": 1, "values": 1}

    @property
    def slots(self) -> int:
        """S: the positions kept per row."""
        return self.keys[0].shape[1] if self.keys else 0

    @classmethod
    def empty(cls, batch_size: int, n_layer: int, slots: int, n_head: int, d_head: int, like: Tensor) -> "LookbackMemory":
        """A memory that has seen nothing, with the dtype and device of `like`."""
        zeros = lambda: like.new_zeros(batch_size, slots, n_head, d_head)  # noqa: E731
        return cls(
            keys=[zeros() for _ in range(n_layer)],
            values=[zeros() for _ in range(n_layer)],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    def check_consistent(self) -> None:
        """State.check_consistent: as many layers of keys as of values, all of one shape with
        the rows of `position`; a position that is not negative; and zeros in every slot of a
        position before the row's first token (a forward never writes there)."""
        if len(self.keys) != len(self.values):
            raise ValueError(f"state has keys for {len(self.keys)} layers and values for {len(self.values)}")
        if self.position.dim() != 1:
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, expected (B,)")
        rows = self.position.shape[0]
        reference = self.keys[0].shape if self.keys else None
        for name, tensor in self._named_tensors():
            if name == "position":
                continue
            if tensor.shape != reference or tensor.shape[0] != rows:
                raise ValueError(f"state tensor '{name}' has shape {tuple(tensor.shape)}; 'keys.0' has "
                                 f"{tuple(reference)} and 'position' {rows} rows")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' holds a negative count of positions")
        S = self.slots
        # slot m of row b holds position position[b] - S + m: empty (zero) while that is negative
        unwritten = torch.arange(S, device=self.position.device)[None, :] < (S - self.position)[:, None]  # (B, S)
        if bool(unwritten.any()):
            for name, tensor in self._named_tensors():
                if name != "position" and bool(tensor[unwritten].ne(0).any()):
                    raise ValueError(f"state tensor '{name}' holds values in slots before the first position "
                                     f"('position' says they were never written)")


# -- the pattern, and attention over the keys it picks ---------------------------------------------
# A pattern whose shape depends only on where a query sits (its offset in a repeating block) is a
# table: row r lists the distances d (0 = the query itself) that a query at offset r looks back,
# padded to a common width A and flagged in `allowed`. Attention then gathers A keys per query
# instead of scoring every key, so a query costs O(A · d) whatever the history's length, and a
# chunk of queries is computed the same way as a single decoding query (which is what keeps
# results independent of how a text is split into calls). Long chunks use `pattern_mask` and
# `masked_attention` instead: the same attention as one dense product under the pattern's mask
# (B·T·A gathered key copies cost far more than scoring all S + T keys of a bounded look-back
# with one matrix product; the two agree to float rounding).


def logsparse_distances(restart_len: int, local_window: int) -> tuple[Tensor, Tensor]:
    """The LogSparse look-back distances of a query at each offset r = 0 .. R-1 of its
    subsequence (R = `restart_len`, w = `local_window`):

        D(r) = {0, 1, ..., w-1}  ∪  {2^k : k >= 0, w <= 2^k <= r}

    the local window (itself and the w-1 positions before it) and the exponential steps that
    stay inside the query's own subsequence (2^k <= r). Returns `distances` (R, A) int64, each
    row ascending and padded with 0, and `allowed` (R, A) bool, False on the padding; A is the
    largest |D(r)|. Distances that reach before the history's first position are the caller's
    to mask (they depend on the absolute position, not on r)."""
    if restart_len < 1 or local_window < 1:
        raise ValueError(f"restart_len ({restart_len}) and local_window ({local_window}) must be at least 1")
    rows = []
    for r in range(restart_len):
        steps = {1 << k for k in range(max(r, 1).bit_length()) if local_window <= (1 << k) <= r}
        rows.append(sorted(set(range(local_window)) | steps))
    width = max(len(row) for row in rows)
    distances = torch.zeros(restart_len, width, dtype=torch.long)
    allowed = torch.zeros(restart_len, width, dtype=torch.bool)
    for r, row in enumerate(rows):
        distances[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        allowed[r, : len(row)] = True
    return distances, allowed


def longest_distance(distances: Tensor, allowed: Tensor) -> int:
    """The largest distance any query of the pattern looks back (0 when only itself)."""
    return int(distances[allowed].max()) if bool(allowed.any()) else 0


def gathered_attention(
    q: Tensor,  # (B, T, H, D) queries
    keys: Tensor,  # (B, K, H, D)
    values: Tensor,  # (B, K, H, D)
    index: Tensor,  # (B, T, A) int64: which of the K keys query t may attend to
    allowed: Tensor,  # (B, T, A) bool: False where an entry of `index` is padding (ignored)
    dropatt: float = 0.0,
) -> Tensor:
    """softmax(q kᵀ / √D) v of each query over only its own A gathered keys -> (B, T, H, D).

    Every query must have at least one allowed entry (a causal pattern always lets a query see
    itself), so no row of the softmax is empty."""
    B, T, H, D = q.shape
    rows = torch.arange(B, device=q.device)[:, None, None]
    picked_keys = keys[rows, index]  # (B, T, A, H, D)
    picked_values = values[rows, index]  # (B, T, A, H, D)
    scores = torch.einsum("bthd,btahd->btha", q, picked_keys) / math.sqrt(D)  # (B, T, H, A)
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if dropatt > 0.0:
        weights = F.dropout(weights, p=dropatt, training=True)
    return torch.einsum("btha,btahd->bthd", weights, picked_values)  # (B, T, H, D)


def pattern_mask(index: Tensor, allowed: Tensor, n_keys: int) -> Tensor:
    """The pattern as a dense mask (B, 1, T, n_keys) bool: True where query t attends to key
    index[b, t, a] with allowed[b, t, a]. index and allowed (B, T, A) as for gathered_attention."""
    B, T, _ = index.shape
    target = torch.where(allowed, index, n_keys)  # padding lands in one spare column, dropped below
    mask = torch.zeros(B, T, n_keys + 1, dtype=torch.bool, device=index.device)
    mask.scatter_(2, target, True)
    return mask[:, None, :, :n_keys]


def masked_attention(
    q: Tensor,  # (B, T, H, D) queries
    keys: Tensor,  # (B, K, H, D)
    values: Tensor,  # (B, K, H, D)
    mask: Tensor,  # (B or 1, 1, T, K) bool from pattern_mask
    dropatt: float = 0.0,
) -> Tensor:
    """softmax(q kᵀ / √D) v over the keys `mask` allows, as one dense product -> (B, T, H, D).
    Equal to gathered_attention over the same pattern (to float rounding)."""
    attended = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                              attn_mask=mask, dropout_p=dropatt)  # (B, H, T, D)
    return attended.transpose(1, 2)


# -- the model -------------------------------------------------------------------------------------


class LogSparseLayer(nn.Module):
    """Pre-norm LogSparse self-attention + feed-forward."""

    def __init__(self, config: LogSparseConfig):
        super().__init__()
        c = config
        self.config = c
        self.attn_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.qkv_net = nn.Linear(c.d_model, 3 * c.n_head * c.d_head, bias=False)
        self.o_net = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)
        self.ff_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.ff = FeedForward(c.d_model, c.d_inner, c.dropout)
        self.drop = nn.Dropout(c.dropout)

    def forward(
        self,
        x: Tensor,  # (B, T, d_model)
        past_keys: Tensor,  # (B, S, H, D): the last S positions before x
        past_values: Tensor,  # (B, S, H, D)
        index: Tensor,  # (B, T, A): for each query, its keys' indices into past + new (S + T)
        allowed: Tensor,  # (B, T, A) bool
        mask: Tensor | None,  # (B or 1, 1, T, S + T) the same pattern as a dense mask, for long chunks
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The layer's output (B, T, d_model) and its keys and values over past + x (B, S + T, H, D)."""
        c = self.config
        B, T, _ = x.shape
        q, k, v = self.qkv_net(self.attn_norm(x)).view(B, T, 3, c.n_head, c.d_head).unbind(dim=2)  # (B, T, H, D)
        keys = torch.cat([past_keys, k], dim=1)  # (B, S + T, H, D)
        values = torch.cat([past_values, v], dim=1)
        dropatt = c.dropatt if self.training else 0.0
        if mask is None:  # a few queries: gather each one's A keys
            attended = gathered_attention(q, keys, values, index, allowed, dropatt)  # (B, T, H, D)
        else:  # a long chunk: score all S + T keys at once under the pattern's mask
            attended = masked_attention(q, keys, values, mask, dropatt)  # (B, T, H, D)
        x = x + self.drop(self.o_net(attended.reshape(B, T, -1)))
        x = x + self.ff(self.ff_norm(x))
        return x, keys, values


class LogSparseTransformer(LanguageModel):
    architecture = "logsparse"
    config_class = LogSparseConfig
    state_class = LookbackMemory
    state_kind = "window"
    state_grows_with_context = False  # the last S positions' keys and values, whatever the history
    # chunks of at least this many queries attend through one dense masked product (see forward)
    dense_from_queries = 16
    chunking_invariant = True  # the module docstring's chunking semantics

    def __init__(self, config: LogSparseConfig):
        super().__init__()
        c = config
        self.config = c
        distances, allowed = logsparse_distances(c.restart_len, c.local_window)
        # the pattern table, rebuilt from the config: not part of the checkpoint
        self.register_buffer("distances", distances, persistent=False)  # (R, A)
        self.register_buffer("pattern_allowed", allowed, persistent=False)  # (R, A)
        self.reach = longest_distance(distances, allowed)  # S: the positions the state keeps
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.offset_embedding = nn.Parameter(torch.zeros(c.restart_len, c.d_model))  # position r = i mod R
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(LogSparseLayer(c) for _ in range(c.n_layer))
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.head = nn.Linear(c.d_model, c.vocab_size)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        init_weights(self, [self.offset_embedding])

    @property
    def max_context(self) -> int | None:
        return None  # any history; it conditions on a bounded look-back of it (the pattern, over layers)

    # -- state --------------------------------------------------------------------------------

    def init_state(self, batch_size: int) -> LookbackMemory:
        c = self.config
        return LookbackMemory.empty(batch_size, c.n_layer, self.reach, c.n_head, c.d_head, self.embedding.weight)

    # -- the pattern --------------------------------------------------------------------------

    def visible(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """For queries at absolute `positions` (B, T) (consecutive in each row), the index of
        each one's keys into the past S positions followed by the T new ones (B, T, A) and
        whether each entry is attended (B, T, A): the table row of its offset i mod R, less the
        distances reaching before position 0."""
        S, T = self.reach, positions.shape[1]
        distance = self.distances[positions % self.config.restart_len]  # (B, T, A)
        allowed = self.pattern_allowed[positions % self.config.restart_len] & (distance <= positions[..., None])
        # query t sits at index S + t; every attended distance is <= S, so indices stay >= 0
        index = S + torch.arange(T, device=positions.device)[None, :, None] - distance
        return index.clamp_min(0), allowed

    # -- serving and training -------------------------------------------------------------------

    def forward(self, tokens: Tensor, state: LookbackMemory) -> tuple[Tensor, LookbackMemory]:
        c = self.config
        B, T = tokens.shape
        if T == 0:
            return tokens.new_zeros(B, 0, self.vocab_size, dtype=torch.float32), state
        S = self.reach
        positions = state.position[:, None] + torch.arange(T, device=tokens.device)[None, :]  # (B, T)
        index, allowed = self.visible(positions)
        mask = None
        if T >= self.dense_from_queries:
            # the pattern depends on positions alone: rows at one position share one mask
            rows = slice(0, 1) if B > 1 and bool((state.position == state.position[0]).all()) else slice(None)
            mask = pattern_mask(index[rows], allowed[rows], S + T)
        x = self.drop(self.embedding(tokens) + self.offset_embedding[positions % c.restart_len])  # (B, T, d_model)
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            x, keys, values = layer(x, state.keys[i], state.values[i], index, allowed, mask)
            new_keys.append(self._kept(keys, T))
            new_values.append(self._kept(values, T))
        log_probs = F.log_softmax(self.head(self.drop(self.final_norm(x))).float(), dim=-1)
        return log_probs, LookbackMemory(new_keys, new_values, state.position + T)

    def _kept(self, keys: Tensor, T: int) -> Tensor:
        """The last S of the S + T positions (B, S + T, H, D) -> (B, S, H, D), detached: the
        state is carried, never back-propagated through. A copy when the chunk is long, so the
        state does not hold the whole chunk's keys alive."""
        kept = keys.detach()[:, T:]
        return kept.clone() if T > self.reach else kept
