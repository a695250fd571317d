"""Reformer: LSH attention with shared queries and keys, local chunked attention, axial positions
and reversible layers, as a byte-level causal language model.

Paper: Nikita Kitaev, Łukasz Kaiser, Anselm Levskaya, "Reformer: The Efficient Transformer",
ICLR 2020 (arXiv:2001.04451), sections 2 (LSH attention), 3 (reversible layers, chunking) and
5 (enwik8). The semantics below are those of Hugging Face's `ReformerModelWithLMHead`
(transformers 4.37.2, a port of the authors' Trax code), so that its checkpoints, converted by
models/convert/reformer.py, give the same log-probabilities here (tests/models/
test_convert_reformer.py; the patterns against brute-force definitions: tests/models/test_reformer.py).

The network. Tokens x_t are embedded with an absolute position (axial, `AxialPositions`):
e_t = E[x_t] + pos(t). Two residual streams start equal, X1 = X2 = e, and each of the L layers
is reversible (`reversible_stack`):

    Y1 = X1 + Attn_l(LayerNorm(X2))      Attn_l: LSH or local attention, then W_O
    Y2 = X2 + FF_l(Y1)                   FF_l(y) = W_2 act(W_1 LayerNorm(y) + b_1) + b_2

and the output is log_softmax(W_out LayerNorm([Y1 ; Y2]) + b_out) over the 256 bytes.

LSH attention (shared QK). One projection gives each position a vector q_t = W_QK h_t that is
both its query and, normalised, its key k_t = q_t / rms(q_t); values v_t = W_V h_t. Hash round
r ∈ {0 .. R−1} puts t in bucket h_r(t) = argmax([q_t R_r ; −q_t R_r]) (random rotations R_r
fixed in the checkpoint; a factorised bucket count hashes per factor, `hash_buckets`).
In one pass over T tokens, padded to T' (below): each round sorts the positions by (bucket,
position) into T' slots, the rounds are laid end to end (R·T' slots) and cut into chunks of c
slots; the query in a slot attends to the keys of its chunk and of the n_b chunks before it
(cyclically over all R·T' slots) whose position is at most its own:

    V_r(t) = { s ∈ those chunks : pos(s) <= t },   a_t = Σ_r w_r(t) softmax_{s ∈ V_r(t)}(q_t·k_s/√D) v_s,
    w_r(t) = softmax_r( logsumexp_{s ∈ V_r(t)} q_t·k_s/√D ),

which is one softmax over the union of the R windows, a position counted as often as it
appears. A query's own key scores −1e5 instead of q_t·k_t/√D: it has weight 0 whenever any
other key is visible, and all the weight (the token attends to itself) only when nothing else
is (the paper's rule for shared QK). A text of T' <= c is one chunk: plain causal attention
with the same rule, no hashing.

Local attention. Separate q, k, v projections; positions in order, cut into chunks of c_loc;
the query at t attends to the positions <= t of its chunk and the n_loc chunks before it
(cyclically, so when n_loc >= T'/c_loc a chunk appears twice and counts twice).

Padding (the reference's, part of its semantics). A first call of T tokens with T > the
smallest chunk length and T not a multiple of the least common multiple m of the chunk
lengths is padded to T' = ⌈T/m⌉·m with tokens that nothing sees. They change nothing but the
slot layout: each LSH round then has T' − T empty slots at its end (they fall in the last
chunks and in the chunks the first chunks of the next round look back to), and the local
chunks count T'/c_loc. Padding tokens are never computed here; only their slots exist.

Decoding: the reference's cache semantics (its `past_buckets_states`), one token at a time.
After the first call, every later token t (the 1st of a call or the k-th, a call of many tokens
is exactly that many steps) sees positions 0 .. t:
- local: the positions lo(t) .. t, with s = (⌊t/c⌋ − n_loc)·c and lo(t) = s when s >= 0, else
  max(t + s, 0) (the reference slices its cache with a negative start there, so early in a text
  a decoded token can see fewer positions than in one pass);
- LSH, once the reference has hashed its cache (`hashed`): in each round the positions 0..t
  sorted by (bucket, position); u = the new query's slot (after every earlier position of its
  bucket); the window is the slots (⌊u/c⌋·c − n_b·c + k) mod (t+1), k < (n_b+1)·c, repeats
  counted (windows longer than the history wrap around it); the attention is then as above over
  the union of the R windows, with the self rule. No causal mask is needed: everything sorted
  is in the past;
- LSH before that: plain attention to every position 0..t (self rule). The reference hashes its
  cache at the first decoding step whose history (new token included) reaches c, or already in
  the first call when T' > c; `hashed` in the state records which.
Buckets are stored with the round offsets the reference stores (r·n_b, or r·(n_b+1) when the
first call was padded: the reference then adds a bucket for padding); a decoded token is hashed
with offset r·(n_b+1) when the stored buckets exceed R·n_b − 1 (the reference's test for a
padded cache), else r·n_b. Only the order within a round matters, so this changes nothing
except where the reference's test misjudges (a padded first call none of whose last-round
buckets is in the top R − 1), which it then reproduces. The reference takes that test over the
whole batch; here it is per row, so rows never influence each other.

Rounding, reproduced: the reference combines hash rounds as exp(lse_r − logsumexp_r lse_r) and
normalises within a round as exp(s − lse), not by a softmax; for a query whose windows hold only
itself the scores sit at −1e5, where float32 steps by 0.0078, and its output is v_t times about
0.998 rather than v_t. The same formulas here give the same numbers (`combine_rounds`).

Where this differs from the reference, on purpose: its cached LSH decoding of a batch reads the
first row's hidden states for every row (transformers 4.37.2: the batch offset in
`_get_relevant_hid_states_and_buckets` is always 0), and its offset test spans the batch; here
every row decodes as the reference decodes it alone. Its padding tokens are computed and masked;
here only their slots exist (they cannot change a real token's output). A null hash_seed makes
the reference draw new rotations at every call; here they are fixed in the checkpoint. The
reference's per-call `num_hashes` override does not exist here.

So the one pass and the token-by-token path are different functions: LSH chunks and the local
cache's start are part of the reference's semantics, and which applies depends on how the text
was fed. `chunking_invariant` is False. What is guaranteed, and tested against the reference:
a first call of T tokens gives its one-pass log-probabilities (reference: one forward of T
tokens); every later token gives the reference's cached decoding step (reference: generate()'s
`past_buckets_states` loop), whatever the sizes of the later calls (the server's prefill chunks
after the first give the same results as one token at a time).

State between calls (`LSHMemory`): per LSH layer every position's
key, value and R buckets; per local layer the last (n_loc + 1)·c_loc − 1 keys and values; the
position and `hashed`. It grows with the history,
    nbytes = 9 + Σ_lsh N·H·(2·D·4 + 4·R) + Σ_local 2·S·H·D·4   (float32, N positions seen),
up to `max_context`, the product of the axial shape (65,536 for the presets): there is no
position embedding beyond it, as in the reference, and a call that would pass it is refused.
Decoding a token costs one sort of the history's buckets per LSH layer and attention to
R·(n_b+1)·c keys, plus (n_loc+1)·c_loc keys per local layer: nothing is re-projected (the
reference re-projects the hidden states of every window position at every step). While the
history is short (at most DENSE_DECODE_HISTORY times the R·(n_b+1)·c keys a query attends to,
which covers every training segment) the LSH scores are taken from one product of the queries
with every stored key instead of gathering each query's windows: the same sums, and one
matrix product costs less than copying R·(n_b+1)·c key and value vectors per query until the
history is that many times longer.

Training: the standard loop with the state carried from segment to segment (detached), through
the same two paths (a lane's first segment is a one pass, its later ones decode); a lane whose
history would pass `train_context` restarts from an empty state, which bounds the state a batch
of lanes carries. Reversible layers keep one layer's activations at a time in the backward pass;
the feed-forward runs in pieces of `ff_chunk` positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function

from xlserve.models.interface import ArchConfig, LanguageModel, State
from xlserve.models.layers.buffers import extend_memory, left_pad
from xlserve.models.layers.feedforward import ACTIVATIONS
from xlserve.models.layers.init import init_weights

ATTENTION_KINDS = ("lsh", "local")

# the score that replaces a query's dot product with its own key (the reference's float32
# self-mask value): exp(-1e5 - s) is 0 in float32 beside any real score s, so a query's own key
# has weight exactly 0 whenever another key is visible, and all the weight when none is
SELF_SCORE = -1e5

# the one pass computes its chunks' scores in groups of chunks holding at most this many scores
CHUNK_GROUP_SCORES = 1 << 24

# decoding gathers each query's window; queries are processed in groups whose gathered keys
# and values stay below this many elements
DECODE_GROUP_ELEMENTS = 1 << 24

# decoding with a history of at most this many times the R·W keys a query attends to scores
# every entry by one matrix product instead of gathering the windows (attend_windows_dense)
DENSE_DECODE_HISTORY = 24


@dataclass
class ReformerConfig(ArchConfig):
    vocab_size: int = 256  # bytes
    attn_layers: list[str] = field(default_factory=lambda: ["local", "lsh", "local", "lsh"])
    d_model: int = 192  # width of each of the two residual streams
    n_head: int = 4
    d_head: int = 48
    d_inner: int = 768  # feed-forward width
    activation: str = "relu"
    lsh_chunk: int = 32  # c: slots per LSH chunk
    lsh_chunks_before: int = 1  # n_b: earlier chunks an LSH chunk attends to
    n_hashes: int = 2  # R: hash rounds
    n_buckets: int | list[int] = 32  # even; a list factorises the hash (n_b = product)
    local_chunk: int = 64  # c_loc
    local_chunks_before: int = 1  # n_loc
    axial_pos_shape: list[int] | None = field(default_factory=lambda: [256, 256])  # None: a learned table
    axial_pos_dims: list[int] | None = field(default_factory=lambda: [64, 128])  # sums to d_model
    max_positions: int = 65536  # the learned table's size when axial_pos_shape is None
    layer_norm_epsilon: float = 1e-12
    dropout: float = 0.0  # embeddings, attention output, feed-forward
    dropatt: float = 0.0  # attention probabilities
    ff_chunk: int = 0  # training: the feed-forward in pieces of this many positions (0: whole)
    train_context: int = 2048  # training: a lane restarts from an empty state before passing this

    def check(self) -> None:
        if not self.attn_layers or any(kind not in ATTENTION_KINDS for kind in self.attn_layers):
            raise ValueError(f"attn_layers must be a non-empty list of {ATTENTION_KINDS}, got {self.attn_layers}")
        for name in ("lsh_chunk", "local_chunk", "n_hashes", "d_model", "n_head", "d_head", "d_inner"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lsh_chunks_before < 0 or self.local_chunks_before < 0:
            raise ValueError("chunks_before must not be negative")
        bucket_count(self.n_buckets)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {sorted(ACTIVATIONS)}")
        if (self.axial_pos_shape is None) != (self.axial_pos_dims is None):
            raise ValueError("axial_pos_shape and axial_pos_dims go together")
        if self.axial_pos_dims is not None and sum(self.axial_pos_dims) != self.d_model:
            raise ValueError(f"axial_pos_dims {self.axial_pos_dims} must sum to d_model {self.d_model}")

    def chunk_lengths(self) -> tuple[int, int]:
        """(least common multiple, smallest) of the chunk lengths of the layer kinds present:
        the reference pads a first call to a multiple of the first when it is longer than the
        second."""
        lengths = [self.lsh_chunk if kind == "lsh" else self.local_chunk for kind in set(self.attn_layers)]
        return math.lcm(*lengths), min(lengths)

    def padded_length(self, T: int) -> int:
        multiple, smallest = self.chunk_lengths()
        if T > smallest and T % multiple:
            return T + multiple - T % multiple
        return T

    @property
    def local_window(self) -> int:
        """S: the earlier positions a decoded token's local attention can reach."""
        return (self.local_chunks_before + 1) * self.local_chunk - 1


# -- the state between calls -----------------------------------------------------------------------

LIST_FIELDS = ("lsh_keys", "lsh_values", "buckets", "local_keys", "local_values")
GROWING = ("lsh_keys", "lsh_values", "buckets")  # the fields that gain one position per token


@dataclass
class LSHMemory(State):
    """What the LSH layers and the local layers need to decode the next token as the reference
    does (the module docstring has the semantics).

    - LSH layers: every position's shared-QK key (unit-RMS, as attention uses it), its value and
      its bucket in every hash round (with the round offset the reference stored it under). A new
      query is hashed, sorted among these buckets and attends within its window: nothing of the
      history is recomputed. These tensors grow by one position per token, up to the model's
      `max_context` (its axial positions' product).
    - Local layers: the keys and values of the last S = (before + 1)·c − 1 positions, the most any
      later query can reach back (left-padded with zeros while fewer have been seen). Fixed size.
    - `position` (B,): tokens seen; `hashed` (B,): whether the reference would hold buckets by now
      (it hashes its cache only once the history reaches the LSH chunk length; before that a new
      token attends to every earlier one).

    Layout: batch first; LSH tensors (B, N, H, ·) with positions on dimension 1, so that decoding
    appends into spare room (models/layers/buffers.py) instead of copying the whole history at
    every step. Rows of a batch with different histories are left-padded to the longest (row b's
    entries are its last position[b]); `split` strips that padding again.
    """

    lsh_keys: list[Tensor]  # per LSH layer (B, N, H, D) float: unit-RMS shared-QK keys
    lsh_values: list[Tensor]  # per LSH layer (B, N, H, D)
    buckets: list[Tensor]  # per LSH layer (B, N, H, R) int32: bucket + round offset, per hash round
    local_keys: list[Tensor]  # per local layer (B, S, H, D): the last S positions, oldest first
    local_values: list[Tensor]  # per local layer (B, S, H, D)
    position: Tensor  # (B,) int64: tokens seen
    hashed: Tensor  # (B,) bool: the reference holds buckets for this history

    # a commit appends its positions to the LSH layers' tensors and slides the local windows
    # (State.delta_from); the buckets are rewritten whole the one time the history is first hashed
    delta_axes = {"lsh_keys": 1, "lsh_values": 1, "buckets": 1, "local_keys": 1, "local_values": 1}

    @classmethod
    def empty(cls, batch_size: int, n_lsh: int, n_local: int, n_head: int, d_head: int, n_hashes: int,
              window: int, like: Tensor) -> "LSHMemory":
        growing = lambda: like.new_zeros(batch_size, 0, n_head, d_head)  # noqa: E731
        fixed = lambda: like.new_zeros(batch_size, window, n_head, d_head)  # noqa: E731
        return cls(
            lsh_keys=[growing() for _ in range(n_lsh)], lsh_values=[growing() for _ in range(n_lsh)],
            buckets=[torch.zeros(batch_size, 0, n_head, n_hashes, dtype=torch.int32, device=like.device)
                     for _ in range(n_lsh)],
            local_keys=[fixed() for _ in range(n_local)], local_values=[fixed() for _ in range(n_local)],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
            hashed=torch.zeros(batch_size, dtype=torch.bool, device=like.device),
        )

    @property
    def length(self) -> int:
        """N: entries the LSH tensors hold per row (the longest row's history in a batch)."""
        return self.buckets[0].shape[1] if self.buckets else int(self.position.max()) if self.position.numel() else 0

    def check_consistent(self) -> None:
        """State.check_consistent: as many keys as values per kind of layer, every LSH tensor
        covering the same N positions, each row's history within them, `hashed` one per row."""
        for keys, values, name in ((self.lsh_keys, self.lsh_values, "lsh"), (self.local_keys, self.local_values, "local")):
            if len(keys) != len(values):
                raise ValueError(f"state has {name} keys for {len(keys)} layers and values for {len(values)}")
        if len(self.buckets) != len(self.lsh_keys):
            raise ValueError(f"state has buckets for {len(self.buckets)} LSH layers and keys for {len(self.lsh_keys)}")
        if self.position.dim() != 1 or tuple(self.hashed.shape) != tuple(self.position.shape):
            raise ValueError(f"state tensors 'position' {tuple(self.position.shape)} and 'hashed' "
                             f"{tuple(self.hashed.shape)} must be one value per batch row")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' is negative")
        growing = [(f"{kind}.{i}", t) for kind in GROWING for i, t in enumerate(getattr(self, kind))]
        if growing:
            n = growing[0][1].shape[1]
            for name, t in growing:
                if t.shape[1] != n:
                    raise ValueError(f"state tensor '{name}' covers {t.shape[1]} positions, "
                                     f"'{growing[0][0]}' {n}: every LSH tensor covers the same positions")
            if bool((self.position > n).any()):
                raise ValueError(f"state tensor 'position' says {int(self.position.max())} tokens, "
                                 f"the LSH tensors hold {n} positions")
        windows = {t.shape[1] for t in [*self.local_keys, *self.local_values]}
        if len(windows) > 1:
            raise ValueError(f"local keys and values hold windows of different lengths {sorted(windows)}")

    @classmethod
    def concat(cls, states: list["LSHMemory"]) -> "LSHMemory":
        """Rows of every state; the LSH tensors left-padded to the longest history."""
        longest = max(s.length for s in states)
        merged = {}
        for f in fields(cls):
            first = getattr(states[0], f.name)
            if isinstance(first, Tensor):
                merged[f.name] = torch.cat([getattr(s, f.name) for s in states])
            elif f.name in GROWING:
                merged[f.name] = [torch.cat([left_pad(getattr(s, f.name)[i], longest, 0) for s in states])
                                  for i in range(len(first))]
            else:
                merged[f.name] = [torch.cat([getattr(s, f.name)[i] for s in states]) for i in range(len(first))]
        return cls(**merged)

    def split(self) -> list["LSHMemory"]:
        """One batch-1 state per row, each LSH tensor holding exactly that row's positions."""
        rows = []
        n = self.length
        for b, row in enumerate(super().split()):
            start = n - int(self.position[b])
            rows.append(LSHMemory(
                lsh_keys=[t[:, start:] for t in row.lsh_keys], lsh_values=[t[:, start:] for t in row.lsh_values],
                buckets=[t[:, start:] for t in row.buckets], local_keys=row.local_keys,
                local_values=row.local_values, position=row.position, hashed=row.hashed,
            ))
        return rows

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "LSHMemory":
        """State.from_tensors, where a list may be empty (a Reformer without LSH layers, or
        without local ones, has no such tensors); `check_state` compares the names with a
        fresh state's."""
        values: dict = {}
        used = set()
        for f in fields(cls):
            if f.name not in LIST_FIELDS:
                if f.name not in tensors:
                    raise ValueError(f"state tensor '{f.name}' is missing")
                values[f.name] = tensors[f.name]
                used.add(f.name)
                continue
            items = []
            while f"{f.name}.{len(items)}" in tensors:
                used.add(f"{f.name}.{len(items)}")
                items.append(tensors[f"{f.name}.{len(items)}"])
            values[f.name] = items
        unexpected = sorted(set(tensors) - used)
        if unexpected:
            raise ValueError(f"unexpected state tensors {unexpected}")
        return cls(**values)


# -- positions -------------------------------------------------------------------------------------


class AxialPositions(nn.Module):
    """Axial position embeddings (the paper and the Trax code it comes with): a learned absolute
    position embedding for n_1·n_2·…·n_k positions stored as k small tables instead of one large
    one. Position p is unravelled row-major over the shape (n_1, …, n_k),

        p = Σ_i p_i · Π_{j>i} n_j,    0 <= p_i < n_i,

    and its embedding is the concatenation of one row per axis,

        e(p) = [E_1[p_1] ; E_2[p_2] ; … ; E_k[p_k]],    E_i ∈ R^{n_i × d_i},  Σ_i d_i = d_model.

    For the enwik8 Reformer's shape (128, 512) with widths (256, 768) that is 128·256 + 512·768
    parameters for 65,536 positions instead of 65,536·1024. The number of positions, Π_i n_i, is
    the longest history such a model can condition on: there is no embedding beyond it.

    positions (B, T) int64 -> (B, T, Σ d_i). Parameters `weights.i` (n_i, d_i)."""

    def __init__(self, shape: list[int], dims: list[int]):
        super().__init__()
        if len(shape) != len(dims) or not shape or min(shape) < 1 or min(dims) < 1:
            raise ValueError(f"axial shape {shape} and widths {dims} must be non-empty lists of positive ints "
                             "of the same length")
        self.shape = [int(n) for n in shape]
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(n, d)) for n, d in zip(shape, dims))

    @property
    def max_positions(self) -> int:
        return math.prod(self.shape)

    def forward(self, positions: Tensor) -> Tensor:
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.max_positions):
            raise ValueError(f"position {int(positions.max())} is beyond the {self.max_positions} axial positions "
                             f"{tuple(self.shape)}")
        parts, stride = [], self.max_positions
        for n, table in zip(self.shape, self.weights):
            stride //= n
            parts.append(table[torch.div(positions, stride, rounding_mode="floor") % n])  # (B, T, d_i)
        return torch.cat(parts, dim=-1)


class LearnedPositions(nn.Module):
    """One learned vector per absolute position (the Reformer without axial embeddings):
    positions (B, T) -> (B, T, d_model). Parameter `table.weight` (max_positions, d_model)."""

    def __init__(self, max_positions: int, d_model: int):
        super().__init__()
        self.table = nn.Embedding(max_positions, d_model)

    @property
    def max_positions(self) -> int:
        return self.table.num_embeddings

    def forward(self, positions: Tensor) -> Tensor:
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the {self.max_positions} learned positions")
        return self.table(positions)


# -- LSH arithmetic: hashing, chunked attention, decoding windows ----------------------------------
# Hashing (`hash_buckets`): angular LSH with a random rotation per head and hash round. With
# rotations R_r ∈ R^{D × n_b/2} (fixed in the checkpoint),
#
#     h_r(x) = argmax([x R_r ; −x R_r])  ∈ {0 .. n_b − 1},
#
# and for a factorised bucket count n_b = f_1·f_2·…, one such argmax per factor over its own
# columns of R_r, combined as h = h_1 + f_1·h_2 + f_1·f_2·h_3 + …. Round r's buckets are offset by
# r·n_b so rounds never mix when sorted (by r·(n_b + 1) where the reference added a bucket for
# padding; see the module docstring).
#
# Chunked attention (`chunked_attention`): a sequence of S slots (S a multiple of the chunk
# length c) split into S/c chunks; chunk k attends to itself and the `before` chunks before it,
# cyclically (chunk k − m mod S/c), to the keys whose position is at most the query's (causal);
# a key at the query's own position gets the score SELF_SCORE instead of its dot product, so a
# query attends to itself only when nothing else is visible. For LSH the slots are the positions
# sorted by bucket; for local attention they are the positions in order.
#
# Decoding (`decode_windows`): the slots of one query among the positions it can see, computed
# without re-sorting the history once per query.


def bucket_factors(n_buckets: int | list[int]) -> list[int]:
    """The factors of a bucket count: [n] for an int, the list itself for a factorised one."""
    factors = [n_buckets] if isinstance(n_buckets, int) else [int(f) for f in n_buckets]
    if not factors or any(f < 2 or f % 2 for f in factors):
        raise ValueError(f"num_buckets must be an even int >= 2 or a list of them, got {n_buckets}")
    return factors


def bucket_count(n_buckets: int | list[int]) -> int:
    count = 1
    for f in bucket_factors(n_buckets):
        count *= f
    return count


def rotation_columns(n_buckets: int | list[int]) -> int:
    """Columns of one round's rotation: n_b/2, or Σ f_i/2 for a factorised count."""
    return sum(f // 2 for f in bucket_factors(n_buckets))


def hash_buckets(vectors: Tensor, rotations: Tensor, n_buckets: int | list[int]) -> Tensor:
    """vectors (B, H, T, D), rotations (H, D, R, n_b/2) -> buckets (B, H, R, T) int64 in
    [0, n_b), without round offsets."""
    rotated = torch.einsum("bhtd,hdrk->bhrtk", vectors.detach(), rotations.to(vectors.dtype))  # (B, H, R, T, cols)
    buckets, start, scale = None, 0, 1
    for f in bucket_factors(n_buckets):
        part = rotated[..., start : start + f // 2]
        index = torch.argmax(torch.cat([part, -part], dim=-1), dim=-1)  # (B, H, R, T)
        buckets = index if buckets is None else buckets + scale * index
        start, scale = start + f // 2, scale * f
    return buckets


def unit_rms(x: Tensor, epsilon: float = 1e-6) -> Tensor:
    """x / sqrt(mean(x²) + ε) over the last dimension: the shared-QK key normalisation (a key is
    the query's direction at a fixed length, so a query's dot product with itself is not
    automatically the largest)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)


def self_score_for(dtype: torch.dtype) -> float:
    """SELF_SCORE, or the reference's half-precision value (−1e3) where −1e5 does not fit."""
    return -1e3 if dtype == torch.float16 else SELF_SCORE


def chunked_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, chunk: int, before: int,
                      self_score: float | None, dropout: float = 0.0, training: bool = False) -> tuple[Tensor, Tensor]:
    """Attention of every slot to its chunk and the `before` chunks before it (cyclically).

    q, k, v (B, H, S, D) in slot order (keys already scaled), positions (B, H, S) int64 the
    position each slot holds, negative for an empty slot (never visible). Key j is visible to
    query i when 0 <= pos_j <= pos_i; with `self_score`, pos_j == pos_i scores `self_score`.
    Returns the outputs (B, H, S, D) and each slot's log-sum-exp of its scores (B, H, S).
    Chunks are processed in groups (CHUNK_GROUP_SCORES), which changes nothing but memory."""
    B, H, S, D = q.shape
    n = S // chunk
    width = (before + 1) * chunk
    qc, kc, vc = (t.reshape(B, H, n, chunk, D) for t in (q, k, v))
    pc = positions.reshape(B, H, n, chunk)
    group = max(1, CHUNK_GROUP_SCORES // max(1, B * H * chunk * width))
    back = torch.arange(before, -1, -1, device=q.device)  # chunk k sees chunks k − before .. k (mod n)
    outs, lses = [], []
    for first in range(0, n, group):
        g = min(group, n - first)
        window = torch.remainder(torch.arange(first, first + g, device=q.device)[:, None] - back[None, :], n)  # (g, before+1)
        keys = kc[:, :, window].reshape(B, H, g, width, D)
        values = vc[:, :, window].reshape(B, H, g, width, D)
        key_pos = pc[:, :, window].reshape(B, H, g, 1, width)
        query_pos = pc[:, :, first : first + g, :, None]  # (B, H, g, c, 1)
        scores = torch.einsum("bhncd,bhnkd->bhnck", qc[:, :, first : first + g], keys)  # (B, H, g, c, width)
        visible = (key_pos >= 0) & (key_pos <= query_pos)
        if self_score is not None:
            scores = torch.where(key_pos == query_pos, torch.full_like(scores, self_score), scores)
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # every real query sees at least itself
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # an empty slot's query: no keys
        probs = torch.exp(scores - lse)  # the reference's exp(s − lse), not softmax (see combine_rounds)
        if training and dropout > 0:
            probs = torch.nn.functional.dropout(probs, p=dropout)
        outs.append(torch.matmul(probs, values))  # (B, H, g, c, D)
        lses.append(lse[..., 0])
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=2) if len(lses) > 1 else lses[0]
    return out.reshape(B, H, S, D), lse.reshape(B, H, S)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, self_score: float | None, dropout: float = 0.0,
                     training: bool = False) -> Tensor:
    """Plain causal attention over T positions (what the chunked forms become when the whole
    sequence fits in one chunk): q, k, v (B, H, T, D), keys already scaled -> (B, H, T, D)."""
    T = q.shape[2]
    scores = torch.matmul(q, k.transpose(-1, -2))  # (B, H, T, T)
    index = torch.arange(T, device=q.device)
    if self_score is not None:
        scores = torch.where(index[:, None] == index[None, :], torch.full_like(scores, self_score), scores)
    scores = scores.masked_fill(index[None, :] > index[:, None], float("-inf"))
    probs = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))  # as the reference rounds it
    if training and dropout > 0:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    return torch.matmul(probs, v)


def sorted_slots(buckets: Tensor, padded_length: int) -> Tensor:
    """The LSH slots of one pass: buckets (B, H, R, T) -> positions (B, H, R·T'), round by round
    the positions sorted by (bucket, position), each round followed by T' − T empty slots (−1),
    where the reference sorts its padding tokens (which see and are seen by nothing)."""
    B, H, R, T = buckets.shape
    order = torch.argsort(buckets, dim=-1, stable=True)  # (B, H, R, T): positions in bucket order
    if padded_length > T:
        order = torch.cat([order, order.new_full((B, H, R, padded_length - T), -1)], dim=-1)
    return order.reshape(B, H, R * padded_length)


def sort_entries(values: Tensor) -> tuple[Tensor, Tensor]:
    """values (B, H, R, N) sort keys in position order -> (order, rank): the entry at each
    global index of a stable sort (by value, then position), and each entry's global index."""
    order = torch.argsort(values, dim=-1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(values.shape[-1], device=values.device).expand_as(order))
    return order, rank


def decode_windows(order: Tensor, rank: Tensor, new_count: int, first: int, seen: Tensor, chunk: int,
                   before: int) -> Tensor:
    """The LSH windows of a call's new queries first .. first + Tq − 1, as the reference's
    cached decoding defines them for one new token at a time.

    order, rank (B, H, R, N): `sort_entries` of the sort keys of every entry in position order
    (stored bucket values; the call's `new_count` new entries last; entries that hold nothing
    with a key above every real one, so they sort last). seen (B, Tq) int64: n = position + 1
    of each query processed. Returns entry indices (B, H, R, Tq, (before + 1)·chunk).

    Query t sees positions 0 .. t and nothing after. In round r they are sorted by (value,
    position); the query's slot u there comes after every earlier position of its value; its
    window is the slots (⌊u/c⌋·c − before·c + k) mod n for k = 0 .. (before+1)·c − 1, with
    repeats when the window is longer than n.

    Without a sort per query: one stable sort of all N entries gives each a global index. The
    entries query t must not see are the new ones after it (and the empty ones, which sort after
    every real entry and are never reached); with e_0 < e_1 < … their global indices, the ρ-th
    entry the query sees (in sorted order) is the global entry ρ + #{k : e_k − k <= ρ}, and the
    query's own slot is its global index less #{k : e_k < its global index}.
    """
    B, H, R, N = order.shape
    Tq, T, device = seen.shape[1], new_count, order.device
    new_rank = rank[..., N - T :]  # (B, H, R, T): global index of each new entry
    big = 4 * (N + T) + 16  # above every global index and every rho
    later = torch.arange(T, device=device)[None, :] > torch.arange(first, first + Tq, device=device)[:, None]  # (Tq, T)
    excluded = torch.where(later, new_rank[..., None, :], torch.full_like(new_rank[..., None, :], big))  # (B, H, R, Tq, T)
    excluded = torch.sort(excluded, dim=-1).values.contiguous()
    query_rank = new_rank[..., first : first + Tq]  # (B, H, R, Tq)
    slot = query_rank - torch.searchsorted(excluded, query_rank[..., None].contiguous()).squeeze(-1)  # u
    width = (before + 1) * chunk
    start = (torch.div(slot, chunk, rounding_mode="floor") - before) * chunk
    rho = torch.remainder(start[..., None] + torch.arange(width, device=device),
                          seen[:, None, None, :, None])  # (B, H, R, Tq, W): the window's slots among what t sees
    shifted = torch.where(excluded < big, excluded - torch.arange(T, device=device), excluded)  # e_k − k
    global_index = rho + torch.searchsorted(shifted.contiguous(), rho.contiguous(), right=True)
    return order.gather(-1, global_index.reshape(B, H, R, Tq * width)).reshape(B, H, R, Tq, width)


def combine_rounds(out: Tensor, lse: Tensor) -> Tensor:
    """Σ_r exp(lse_r − logsumexp_r lse_r) · out_r over hash rounds (dimension 2): out (B, H, R,
    T, D), lse (B, H, R, T) -> (B, H, T, D). The weights are computed as the reference computes
    them, not by a softmax: for a query whose windows hold only itself every lse_r is about
    SELF_SCORE = −1e5, where float32 has a spacing of 0.0078, and the rounded weights sum to a
    little less than 1 (0.9978 for two rounds). The reference's outputs carry that factor;
    computing it the same way reproduces them. One round: out_0 itself."""
    if out.shape[2] == 1:
        return out[:, :, 0]
    return (round_weights(lse, dim=2)[..., None] * out).sum(dim=2)


def round_weights(lse: Tensor, dim: int) -> Tensor:
    """The hash rounds' weights exp(lse_r − logsumexp_r lse_r) over `dim`, rounded as the
    reference rounds them (`combine_rounds`)."""
    return torch.exp(lse - torch.logsumexp(lse, dim=dim, keepdim=True))


# -- the two kinds of attention --------------------------------------------------------------------


@dataclass
class FirstCall:
    """Context of a layer in a first call (a one pass): the padded length T'."""

    padded: int


@dataclass
class LaterCall:
    """Context of a layer in a later call: its memory, and per row the positions seen and
    whether the reference has hashed its cache."""

    memory: tuple
    position: Tensor
    hashed: Tensor


class LSHAttention(nn.Module):
    """Shared-QK attention over LSH buckets (module docstring): one pass, or decoding from the
    stored keys, values and buckets."""

    kind = "lsh"

    def __init__(self, config: ReformerConfig):
        super().__init__()
        c = self.config = config
        self.query_key = nn.Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.value = nn.Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.out = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)
        rotations = torch.randn(c.n_head, c.d_head, c.n_hashes, rotation_columns(c.n_buckets))
        self.register_buffer("rotations", rotations, persistent=True)  # (H, D, R, n_b/2): fixed in the checkpoint

    def forward(self, x: Tensor, context) -> tuple[Tensor, tuple]:
        """x (B, T, d_model), normalised -> output (B, T, d_model) and the memory after x."""
        c = self.config
        B, T, _ = x.shape
        qk = self.query_key(x).view(B, T, c.n_head, c.d_head).transpose(1, 2)  # (B, H, T, D)
        v = self.value(x).view(B, T, c.n_head, c.d_head).transpose(1, 2)
        keys = unit_rms(qk)
        raw = hash_buckets(qk, self.rotations, c.n_buckets)  # (B, H, R, T)
        if isinstance(context, FirstCall):
            attended, stored = self.one_pass(qk, keys, v, raw, context.padded)
            memory = (keys.transpose(1, 2), v.transpose(1, 2), stored)
        else:
            attended, memory = self.decode(qk, keys, v, raw, context)
        return self.out(attended.transpose(1, 2).reshape(B, T, -1)), memory

    def one_pass(self, qk, keys, v, raw, padded: int) -> tuple[Tensor, Tensor]:
        """The first call's LSH attention (B, H, T, D) and its buckets as stored (B, T, H, R)."""
        c = self.config
        B, H, T, D = qk.shape
        R, n_b = c.n_hashes, bucket_count(c.n_buckets)
        scale = D ** -0.5
        dropatt = c.dropatt
        if padded <= c.lsh_chunk:  # one chunk: causal attention, not hashed yet
            out = causal_attention(qk, keys * scale, v, self_score_for(qk.dtype), dropatt, self.training)
            stride = n_b
        else:
            slots = sorted_slots(raw, padded)  # (B, H, R·T') positions, −1 for padding slots
            index = slots.clamp(min=0)[..., None].expand(-1, -1, -1, D)
            gathered = [t.gather(2, index) for t in (qk, keys * scale, v)]  # (B, H, R·T', D)
            out_s, lse_s = chunked_attention(*gathered, slots, c.lsh_chunk, c.lsh_chunks_before, self_score_for(qk.dtype),
                                             dropatt, self.training)
            # back to positions, round by round: each round's first T slots hold its positions
            where = slots.view(B, H, R, padded)[..., :T]  # (B, H, R, T)
            out_r = torch.zeros(B, H, R, T, D, dtype=out_s.dtype, device=out_s.device).scatter(
                3, where[..., None].expand(-1, -1, -1, -1, D), out_s.view(B, H, R, padded, D)[..., :T, :])
            lse_r = torch.zeros(B, H, R, T, dtype=lse_s.dtype, device=lse_s.device).scatter(
                3, where, lse_s.view(B, H, R, padded)[..., :T])
            out = combine_rounds(out_r, lse_r)
            stride = n_b + 1 if padded > T else n_b  # the reference's padding bucket shifts its offsets
        offsets = torch.arange(R, device=raw.device)[None, None, :, None] * stride
        return out, (raw + offsets).permute(0, 3, 1, 2).to(torch.int32)  # (B, T, H, R)

    def decode(self, qk, keys, v, raw, context: LaterCall) -> tuple[Tensor, tuple]:
        """Each new token as a decoding step of the reference (module docstring)."""
        c = self.config
        B, H, T, D = qk.shape
        R, n_b, chunk = c.n_hashes, bucket_count(c.n_buckets), c.lsh_chunk
        old_keys, old_values, old_buckets = context.memory  # (B, N0, H, ·)
        position, hashed = context.position, context.hashed
        N0 = old_buckets.shape[1]
        N = N0 + T
        # entry e of row b holds position e − (N0 − position[b]); negative: left padding
        entry_position = torch.arange(N, device=qk.device)[None, :] - (N0 - position)[:, None]  # (B, N)
        # the offsets a new token's buckets get: r·(n_b + 1) where the stored ones say padded
        old_real = (entry_position[:, :N0] >= 0)[:, :, None, None]
        largest = torch.where(old_real, old_buckets, torch.full_like(old_buckets, -1)).amax(dim=(1, 2, 3)) \
            if N0 else torch.full((B,), -1, dtype=torch.int32, device=qk.device)
        stride = n_b + (largest > R * n_b - 1).long()  # (B,)
        new_buckets = raw + torch.arange(R, device=raw.device)[None, None, :, None] * stride[:, None, None, None]
        all_keys = extend_memory(old_keys, keys.transpose(1, 2))  # (B, N, H, D)
        all_values = extend_memory(old_values, v.transpose(1, 2))
        all_buckets = extend_memory(old_buckets, new_buckets.permute(0, 3, 1, 2).to(torch.int32))  # (B, N, H, R)

        query_position = position[:, None] + torch.arange(T, device=qk.device)[None, :]  # (B, T)
        # the reference's cache holds buckets for query t once it hashed in an earlier call or
        # at an earlier step of this one (a step hashes when its history reaches the chunk)
        use_lsh = hashed[:, None] | (query_position >= torch.clamp(position + 1, min=chunk)[:, None])  # (B, T)
        width = (c.lsh_chunks_before + 1) * chunk
        scale = D ** -0.5
        keys_h, values_h = all_keys.permute(0, 2, 1, 3), all_values.permute(0, 2, 1, 3)  # (B, H, N, D)
        positions_h = entry_position[:, None, :].expand(B, H, N)
        any_lsh, all_lsh = bool(use_lsh.any()), bool(use_lsh.all())
        if any_lsh:
            sort_key = all_buckets.permute(0, 2, 3, 1).long()  # (B, H, R, N)
            sort_key = torch.where(entry_position[:, None, None, :] >= 0, sort_key,
                                   torch.full_like(sort_key, 4 * R * (n_b + 1) + 4))  # padding sorts last
            order, rank = sort_entries(sort_key)
        dense = N <= DENSE_DECODE_HISTORY * R * width
        per_query = R * width + (0 if all_lsh else chunk + 1)  # keys gathered per query
        # elements held per query: gathered keys and values (dense: three N-wide rows in place of
        # the LSH windows' gathered ones) and decode_windows' working space
        held = 2 * D * per_query + R * (T + width) + (3 * N - 2 * D * R * width if dense else 0)
        group = max(1, DECODE_GROUP_ELEMENTS // max(1, B * H * held))
        outputs = []
        for first in range(0, T, group):
            tq = min(group, T - first)
            q_pos = query_position[:, first : first + tq]  # (B, tq)
            q = qk[:, :, first : first + tq]  # (B, H, tq, D)
            out = None
            if not all_lsh:  # every position 0 .. t (the reference before it hashes its cache)
                full = torch.arange(chunk + 1, device=qk.device)
                entries = (full[None, :] + (N0 - position)[:, None]).clamp(0, N - 1)  # (B, C+1): entry of position p
                entries = entries[:, None, None, :].expand(B, H, tq, chunk + 1)
                valid = (full[None, None, :] <= q_pos[..., None])[:, None]  # (B, 1, tq, C+1)
                out = self.attend_entries(q, q_pos, entries, valid, keys_h, values_h, positions_h, scale)[0][:, :, :, 0]
            if any_lsh:
                windows = decode_windows(order, rank, T, first, q_pos + 1, chunk, c.lsh_chunks_before)  # (B, H, R, tq, W)
                windows = windows.permute(0, 1, 3, 2, 4).reshape(B, H, tq, R * width)
                if dense:
                    hashed_out = self.attend_windows_dense(q, q_pos + (N0 - position)[:, None], windows, keys_h,
                                                           values_h, scale, rounds=R)
                else:
                    out_r, lse_r = self.attend_entries(q, q_pos, windows, None, keys_h, values_h, positions_h, scale,
                                                       rounds=R)
                    hashed_out = combine_rounds(out_r.transpose(2, 3), lse_r.transpose(2, 3))  # (B, H, tq, D)
                out = hashed_out if out is None else torch.where(use_lsh[:, None, first : first + tq, None],
                                                                  hashed_out, out)
            outputs.append(out)
        out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        return out, (all_keys, all_values, all_buckets)

    def attend_windows_dense(self, q: Tensor, own_entry: Tensor, windows: Tensor, keys: Tensor, values: Tensor,
                             scale: float, rounds: int) -> Tensor:
        """The LSH decoding attention of `attend_entries` + `combine_rounds`, for a short history:
        every query's scores against all N entries in one matrix product, its windows' scores
        picked from them, and the weights of the rounds' softmaxes added back into an N-wide row
        (an entry in several windows, or twice in one, counts as often as it appears) for a
        second product with the values. The same sums as gathering each window's keys and
        values, without copying R·W·D numbers per query, which costs more than the products
        while N is a small multiple of R·W (training: N <= train_context).
        q (B, H, tq, D), own_entry (B, tq) the entry of each query's own position, windows
        (B, H, tq, R·W) -> (B, H, tq, D)."""
        B, H, tq, D = q.shape
        N = keys.shape[2]
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # (B, H, tq, N)
        own = own_entry[:, None, :, None].expand(B, H, tq, 1)
        scores = scores.scatter(-1, own, self_score_for(q.dtype))  # the self rule
        picked = scores.gather(-1, windows).view(B, H, tq, rounds, -1)  # (B, H, tq, R, W)
        lse = torch.logsumexp(picked, dim=-1, keepdim=True)
        probs = torch.exp(picked - lse)  # as attend_entries rounds it
        if self.training and self.config.dropatt > 0:
            probs = F.dropout(probs, p=self.config.dropatt)
        if rounds > 1:  # combine_rounds' weights, folded into the probabilities
            probs = round_weights(lse[..., 0], dim=-1)[..., None] * probs
        weights = torch.zeros_like(scores).scatter_add(-1, windows, probs.reshape(B, H, tq, -1))  # (B, H, tq, N)
        return torch.matmul(weights, values)

    def attend_entries(self, q: Tensor, q_pos: Tensor, entries: Tensor, valid: Tensor | None, keys: Tensor,
                       values: Tensor, positions: Tensor, scale: float, rounds: int = 1) -> tuple[Tensor, Tensor]:
        """Decoding attention of queries q (B, H, tq, D) at positions q_pos (B, tq) to the stored
        entries `entries` (B, H, tq, rounds·L), `valid` (broadcastable) or all; keys, values
        (B, H, N, D), positions (B, H, N). One softmax per round (the self rule applies);
        returns outputs (B, H, tq, rounds, D) and log-sum-exps (B, H, tq, rounds)."""
        B, H, tq, D = q.shape
        flat = entries.reshape(B, H, -1)
        index = flat[..., None].expand(-1, -1, -1, D)
        shape = (B, H, tq, rounds, entries.shape[-1] // rounds)
        k_g = keys.gather(2, index).view(*shape, D)
        v_g = values.gather(2, index).view(*shape, D)
        key_pos = positions.gather(2, flat).view(shape)
        scores = torch.einsum("bhtd,bhtrld->bhtrl", q, k_g) * scale
        scores = torch.where(key_pos == q_pos[:, None, :, None, None], torch.full_like(scores, self_score_for(q.dtype)),
                             scores)
        if valid is not None:
            scores = scores.masked_fill(~valid.view(*valid.shape[:3], 1, -1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        probs = torch.exp(scores - lse)  # the reference's exp(s − lse), not softmax: see combine_rounds
        if self.training and self.config.dropatt > 0:
            probs = F.dropout(probs, p=self.config.dropatt)
        return torch.einsum("bhtrl,bhtrld->bhtrd", probs, v_g), lse[..., 0]


class LocalAttention(nn.Module):
    """Chunked attention to the same and the n_loc previous chunks (module docstring)."""

    kind = "local"

    def __init__(self, config: ReformerConfig):
        super().__init__()
        c = self.config = config
        self.query = nn.Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.key = nn.Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.value = nn.Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.out = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)

    def forward(self, x: Tensor, context) -> tuple[Tensor, tuple]:
        c = self.config
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, c.n_head, c.d_head).transpose(1, 2)  # noqa: E731  (B, H, T, D)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scale = c.d_head ** -0.5
        S = c.local_window
        if isinstance(context, FirstCall):
            attended = self.one_pass(q, k * scale, v, context.padded)
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # (B, T, H, D)
            if T >= S:
                memory = (keys[:, T - S :], values[:, T - S :])
            else:  # fewer than S positions: zeros before them
                pad = keys.new_zeros(B, S - T, c.n_head, c.d_head)
                memory = (torch.cat([pad, keys], dim=1), torch.cat([pad, values], dim=1))
        else:
            attended, memory = self.decode(q, k, v, context)
        return self.out(attended.transpose(1, 2).reshape(B, T, -1)), memory

    def one_pass(self, q: Tensor, k: Tensor, v: Tensor, padded: int) -> Tensor:
        c = self.config
        B, H, T, D = q.shape
        if padded <= c.local_chunk:
            return causal_attention(q, k, v, None, c.dropatt, self.training)
        pad = lambda t: F.pad(t, (0, 0, 0, padded - T))  # noqa: E731  zeros for the padding tokens
        positions = torch.arange(padded, device=q.device)
        positions = torch.where(positions < T, positions, -1).expand(B, H, padded)
        out, _ = chunked_attention(pad(q), pad(k), pad(v), positions, c.local_chunk, c.local_chunks_before, None,
                                   c.dropatt, self.training)
        return out[:, :, :T]

    def decode(self, q: Tensor, k: Tensor, v: Tensor, context: LaterCall) -> tuple[Tensor, tuple]:
        """Query t sees positions lo(t) .. t (module docstring) from the window of the last S
        positions and this call's."""
        c = self.config
        B, H, T, D = q.shape
        S, chunk = c.local_window, c.local_chunk
        window_keys, window_values = context.memory  # (B, S, H, D)
        position = context.position
        keys = torch.cat([window_keys, k.transpose(1, 2)], dim=1)  # (B, S + T, H, D)
        values = torch.cat([window_values, v.transpose(1, 2)], dim=1)
        key_pos = position[:, None] - S + torch.arange(S + T, device=q.device)[None, :]  # (B, S + T)
        q_pos = position[:, None] + torch.arange(T, device=q.device)[None, :]  # (B, T)
        start = (torch.div(q_pos, chunk, rounding_mode="floor") - c.local_chunks_before) * chunk
        lo = torch.where(start >= 0, start, torch.clamp(q_pos + start, min=0))
        visible = (key_pos[:, None, :] >= lo[..., None]) & (key_pos[:, None, :] <= q_pos[..., None])  # (B, T, S+T)
        scores = torch.matmul(q, keys.permute(0, 2, 3, 1)) * c.d_head ** -0.5  # (B, H, T, S + T)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        probs = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
        if self.training and c.dropatt > 0:
            probs = F.dropout(probs, p=c.dropatt)
        out = torch.matmul(probs, values.transpose(1, 2))  # (B, H, T, D)
        return out, (keys[:, T:], values[:, T:])


# -- reversible layers -----------------------------------------------------------------------------
# Reversible residual layers (Gomez et al. 2017, "The Reversible Residual Network"; the paper's
# section 3), with the feed-forward applied in pieces. A stack of layers carries two streams
# (x1, x2), and each layer is
#
#     y1 = x1 + F(x2)        (F: attention)
#     y2 = x2 + G(y1)        (G: feed-forward)
#
# which can be run backwards exactly: x2 = y2 − G(y1), x1 = y1 − F(x2). So training need not keep
# any layer's activations for the backward pass: only the last layer's outputs are stored, and the
# backward pass walks the stack from the top, reconstructing each layer's inputs from its outputs
# and recomputing F and G to get their gradients. Activation memory is then that of one layer,
# whatever the depth. The reconstruction is exact in real arithmetic; in float32 it is exact to
# rounding, so gradients agree with ordinary backpropagation to about 1e-6 relative.
#
# Chunking (the paper's 'chunking' of the feed-forward, section 3): G is position-wise, so it is
# computed over pieces of `ff_chunk` positions at a time, forward and backward, and only one
# piece's d_inner-wide activations exist at once. The result is the same.
#
# Dropout inside F or G draws the same random numbers when recomputed: the random generator's
# state before each F and G of the forward pass is restored for the recomputation.
#
# A block for `reversible_stack` (a ReformerLayer) has `attend(x2, context) -> (F(x2), memory)`
# (the memory is what the layer hands to the model's state; it never carries gradients),
# `feed_forward(y)` (G on a piece of positions) and `ff_chunk` (0: one piece).


def position_wise_in_pieces(function, x: Tensor, chunk: int) -> Tensor:
    """function(x) for a position-wise `function` of x (B, T, d), over pieces of `chunk` positions
    (0 or >= T: one piece)."""
    if chunk <= 0 or x.shape[1] <= chunk:
        return function(x)
    return torch.cat([function(x[:, s : s + chunk]) for s in range(0, x.shape[1], chunk)], dim=1)


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _recompute_rng(device: torch.device, state):
    """A context in which the random generators are at `state` (and are left as they were)."""
    cpu, cuda = state
    fork = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])

    class _Restore:
        def __enter__(self):
            fork.__enter__()
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, device)

        def __exit__(self, *exc):
            return fork.__exit__(*exc)

    return _Restore()


def reversible_stack(x1: Tensor, x2: Tensor, blocks, contexts: list) -> tuple[Tensor, Tensor, list]:
    """Run `blocks` as reversible layers from (x1, x2), each with its context; returns (y1, y2)
    of the last layer and every layer's memory. With autograd on, through `_Reversible` (one
    layer's activations at a time in the backward pass); otherwise a plain loop."""
    memories: list = []
    if not torch.is_grad_enabled():
        for block, context in zip(blocks, contexts):
            attended, memory = block.attend(x2, context)
            x1 = x1 + attended
            x2 = x2 + position_wise_in_pieces(block.feed_forward, x1, block.ff_chunk)
            memories.append(memory)
        return x1, x2, memories
    y1, y2 = _Reversible.apply(x1, x2, blocks, contexts, memories)
    return y1, y2, memories


class _Reversible(Function):
    @staticmethod
    def forward(ctx, x1, x2, blocks, contexts, memories):
        rng = []
        for block, context in zip(blocks, contexts):  # autograd is off inside Function.forward
            f_state = _rng_state(x2.device)
            attended, memory = block.attend(x2, context)
            x1 = x1 + attended
            g_state = _rng_state(x2.device)
            x2 = x2 + position_wise_in_pieces(block.feed_forward, x1, block.ff_chunk)
            memories.append(memory)
            rng.append((f_state, g_state))
        ctx.blocks, ctx.contexts, ctx.rng = blocks, contexts, rng
        ctx.save_for_backward(x1.detach(), x2.detach())
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        for block, context, (f_state, g_state) in reversed(list(zip(ctx.blocks, ctx.contexts, ctx.rng))):
            # G: y2 = x2 + G(y1), piece by piece; accumulates G's parameter gradients
            g_out, dy1_from_g = [], []
            chunk = block.ff_chunk if block.ff_chunk > 0 else y1.shape[1]
            with _recompute_rng(y1.device, g_state), torch.enable_grad():
                for s in range(0, y1.shape[1], chunk):
                    piece = y1[:, s : s + chunk].detach().requires_grad_(True)
                    out = block.feed_forward(piece)
                    torch.autograd.backward(out, dy2[:, s : s + chunk])
                    g_out.append(out.detach())
                    dy1_from_g.append(piece.grad)
            x2 = y2 - torch.cat(g_out, dim=1)
            dy1 = dy1 + torch.cat(dy1_from_g, dim=1)
            # F: y1 = x1 + F(x2); accumulates F's parameter gradients
            with _recompute_rng(y1.device, f_state), torch.enable_grad():
                x2 = x2.detach().requires_grad_(True)
                attended, _ = block.attend(x2, context)
                torch.autograd.backward(attended, dy1)
            x1 = y1 - attended.detach()
            dy2 = dy2 + x2.grad
            y1, y2 = x1, x2.detach()
        return dy1, dy2, None, None, None


# -- the model -------------------------------------------------------------------------------------


class ReformerLayer(nn.Module):
    """One reversible layer: F = attention behind a LayerNorm, G = the feed-forward behind one."""

    def __init__(self, config: ReformerConfig, kind: str):
        super().__init__()
        c = config
        self.attn_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.attention = LSHAttention(c) if kind == "lsh" else LocalAttention(c)
        self.ff_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.ff_in = nn.Linear(c.d_model, c.d_inner)
        self.ff_out = nn.Linear(c.d_inner, c.d_model)
        self.activation = ACTIVATIONS[c.activation]
        self.drop = nn.Dropout(c.dropout)
        self.ff_chunk = c.ff_chunk

    @property
    def kind(self) -> str:
        return self.attention.kind

    def attend(self, x2: Tensor, context) -> tuple[Tensor, tuple]:
        out, memory = self.attention(self.attn_norm(x2), context)
        return self.drop(out), memory

    def feed_forward(self, y: Tensor) -> Tensor:
        return self.drop(self.ff_out(self.drop(self.activation(self.ff_in(self.ff_norm(y))))))


class Reformer(LanguageModel):
    architecture = "reformer"
    config_class = ReformerConfig
    state_class = LSHMemory
    state_kind = "window"  # every position up to max_context: a window that never slides
    state_grows_with_context = True  # LSH layers keep every position's key, value and buckets
    chunking_invariant = False  # a first call is a one pass, later tokens decode (module docstring)
    departures_from_the_paper = (
        "The semantics are those of Hugging Face's `ReformerModelWithLMHead`, whose checkpoints convert: a first call "
        "hashes and sorts its positions into chunks in one pass, later tokens decode against the cached keys in their "
        "buckets, so how a text is split into calls changes its log-probabilities slightly (models/reformer.py). "
        "A session stops at max_context, the axial positions' product; the state keeps every position until then.")
    max_piece_positions = 256  # a later call runs in pieces of this many tokens (the same steps)

    def __init__(self, config: ReformerConfig):
        super().__init__()
        c = self.config = config
        c.check()
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        if c.axial_pos_shape is not None:
            self.positions = AxialPositions(c.axial_pos_shape, c.axial_pos_dims)
        else:
            self.positions = LearnedPositions(c.max_positions, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(ReformerLayer(c, kind) for kind in c.attn_layers)
        self.final_norm = nn.LayerNorm(2 * c.d_model, eps=c.layer_norm_epsilon)
        self.head = nn.Linear(2 * c.d_model, c.vocab_size)
        init_weights(self, list(self.positions.weights) if c.axial_pos_shape is not None else [])

    @property
    def max_context(self) -> int:
        """The positions there are embeddings for (the axial shape's product)."""
        return self.positions.max_positions

    @property
    def sliding_window(self) -> None:
        """No window slides: a history longer than max_context is refused."""
        return None

    @property
    def lsh_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.kind == "lsh"]

    @property
    def local_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.kind == "local"]

    # -- state --------------------------------------------------------------------------------

    def init_state(self, batch_size: int) -> LSHMemory:
        c = self.config
        return LSHMemory.empty(batch_size, len(self.lsh_layers), len(self.local_layers), c.n_head, c.d_head,
                               c.n_hashes, c.local_window, like=self.embedding.weight)

    def _fixed_state_dims(self, name: str, fresh: Tensor) -> range:
        """LSH tensors grow along dimension 1 (positions); every other dimension is fixed."""
        return range(2, fresh.dim()) if name.split(".")[0] in GROWING else range(1, fresh.dim())

    def _full_state_length(self, name: str) -> int | None:
        """The LSH tensors (the only ones of varying length) hold every position up to max_context."""
        return self.history_limit

    def check_state(self, state: LSHMemory, tokens: int | None = None) -> None:
        """LanguageModel.check_state, and every stored bucket within the range its round's
        offset allows: r·n_b <= value <= r·(n_b + 1) + n_b − 1."""
        super().check_state(state, tokens)
        R, n_b = self.config.n_hashes, bucket_count(self.config.n_buckets)
        rounds = torch.arange(R, device=state.position.device)
        n = state.length
        for i, buckets in enumerate(state.buckets):
            real = (torch.arange(n, device=buckets.device)[None, :] >= (n - state.position)[:, None])[:, :, None, None]
            low, high = rounds * n_b, rounds * (n_b + 1) + n_b - 1
            outside = real & ((buckets < low) | (buckets > high))
            if bool(outside.any()):
                raise ValueError(f"state tensor 'buckets.{i}' holds a bucket outside its round's range "
                                 f"(n_buckets {n_b}, {R} rounds)")

    def _check_tokens(self, state: LSHMemory, tokens: int) -> None:
        c = self.config
        if tokens > self.max_context:
            raise ValueError(f"a Reformer state holds at most max_context = {self.max_context} positions, not {tokens}")
        if state.buckets and state.length != tokens:
            raise ValueError(f"state tensor 'lsh_keys.0' holds {state.length} positions, the session has seen {tokens}")
        if state.buckets and not bool(state.hashed[0]) and tokens > c.lsh_chunk:
            raise ValueError(f"state tensor 'hashed' is false after {tokens} tokens: the reference hashes its cache "
                             f"once the history reaches {c.lsh_chunk}")
        empty = max(0, c.local_window - tokens)  # window slots no position has reached
        for name in ("local_keys", "local_values"):
            for i, t in enumerate(getattr(state, name)):
                if empty and bool(t[:, :empty].abs().sum() > 0):
                    raise ValueError(f"state tensor '{name}.{i}' holds values where no position has reached")

    # -- serving and training -----------------------------------------------------------------

    def forward(self, tokens: Tensor, state: LSHMemory) -> tuple[Tensor, LSHMemory]:
        B, T = tokens.shape
        if T == 0:
            return tokens.new_zeros(B, 0, self.vocab_size, dtype=torch.float32), state
        reach = int((state.position + T).max())
        if reach > self.max_context:
            raise ValueError(f"this call would take the history to {reach} tokens; a Reformer has position "
                             f"embeddings for max_context = {self.max_context}")
        fresh = state.position == 0
        if bool(fresh.all()):
            return self._first_call(tokens, state)
        if not bool(fresh.any()):
            return self._later_call(tokens, state)
        # rows of both kinds: each group its own way, put back in order
        rows_first = torch.nonzero(fresh).flatten().tolist()
        rows_later = torch.nonzero(~fresh).flatten().tolist()
        first, first_state = self._first_call(tokens[rows_first], state.take(rows_first))
        later, later_state = self._later_call(tokens[rows_later], state.take(rows_later))
        back = sorted(range(B), key=lambda i: (rows_first + rows_later)[i])
        index = torch.tensor(back, device=tokens.device)
        log_probs = torch.cat([first, later]).index_select(0, index)
        return log_probs, LSHMemory.concat([first_state, later_state]).take(back)

    def _run(self, tokens: Tensor, start: Tensor, contexts: list) -> tuple[Tensor, list]:
        """Embed tokens at positions start[b] + 0.., run the reversible stack and the head."""
        T = tokens.shape[1]
        positions = start[:, None] + torch.arange(T, device=tokens.device)[None, :]
        x = self.drop(self.embedding(tokens) + self.positions(positions))  # (B, T, d_model)
        y1, y2, memories = reversible_stack(x, x, self.layers, contexts)
        out = self.final_norm(torch.cat([y1, y2], dim=-1))  # (B, T, 2·d_model)
        return F.log_softmax(self.head(self.drop(out)).float(), dim=-1), memories

    def _first_call(self, tokens: Tensor, state: LSHMemory) -> tuple[Tensor, LSHMemory]:
        B, T = tokens.shape
        padded = self.config.padded_length(T)
        log_probs, memories = self._run(tokens, state.position, [FirstCall(padded)] * len(self.layers))
        hashed = torch.full((B,), padded > self.config.lsh_chunk, dtype=torch.bool, device=tokens.device)
        return log_probs, self._state_from(memories, state.position + T, hashed)

    def _later_call(self, tokens: Tensor, state: LSHMemory) -> tuple[Tensor, LSHMemory]:
        memories = self._memories_of(state)
        position, hashed = state.position, state.hashed
        pieces = []
        for s in range(0, tokens.shape[1], self.max_piece_positions):
            piece = tokens[:, s : s + self.max_piece_positions]
            contexts = [LaterCall(memory, position, hashed) for memory in memories]
            log_probs, memories = self._run(piece, position, contexts)
            pieces.append(log_probs)
            position = position + piece.shape[1]
            hashed = hashed | (position >= self.config.lsh_chunk)
        log_probs = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        return log_probs, self._state_from(memories, position, hashed)

    def _memories_of(self, state: LSHMemory) -> list[tuple]:
        lsh, local = iter(zip(state.lsh_keys, state.lsh_values, state.buckets)), iter(zip(state.local_keys, state.local_values))
        return [next(lsh) if layer.kind == "lsh" else next(local) for layer in self.layers]

    def _state_from(self, memories: list[tuple], position: Tensor, hashed: Tensor) -> LSHMemory:
        memories = [tuple(t.detach() for t in m) for m in memories]  # the next call never backpropagates into this one
        lsh = [memories[i] for i in self.lsh_layers]
        local = [memories[i] for i in self.local_layers]
        return LSHMemory(
            lsh_keys=[m[0] for m in lsh], lsh_values=[m[1] for m in lsh], buckets=[m[2] for m in lsh],
            local_keys=[m[0] for m in local], local_values=[m[1] for m in local],
            position=position, hashed=hashed,
        )

    def training_loss(self, inputs: Tensor, targets: Tensor, state: LSHMemory, fraction_done: float):
        """The standard next-byte loss from the carried state; lanes whose history would pass
        `train_context` (or max_context) start again from an empty state first."""
        limit = min(self.config.train_context, self.max_context)
        over = state.position + inputs.shape[1] > limit
        if bool(over.any()):
            rows = state.split()
            empty = self.init_state(1)
            state = LSHMemory.concat([empty if bool(over[i]) else row for i, row in enumerate(rows)])
        log_probs, state = self(inputs, state)
        return -log_probs.gather(-1, targets[..., None]).mean(), state
