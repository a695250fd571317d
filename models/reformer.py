"""Reformer: LSH attention with shared queries and keys, local chunked attention, axial positions
and reversible layers, as a byte-level causal language model.

Paper: Nikita Kitaev, Łukasz Kaiser, Anselm Levskaya, "Reformer: The Efficient Transformer",
ICLR 2020 (arXiv:2001.04451), sections 2 (LSH attention), 3 (reversible layers, chunking) and
5 (enwik8). The semantics below are those of Hugging Face's `ReformerModelWithLMHead`
(transformers 4.37.2, a port of the authors' Trax code), so that its checkpoints, converted by
models/convert/reformer.py, give the same log-probabilities here (tests/models/
test_convert_reformer.py; the patterns against brute-force definitions: tests/models/test_reformer.py).

The network. Tokens x_t are embedded with an absolute position (axial, models/layers/
axial_positions.py): e_t = E[x_t] + pos(t). Two residual streams start equal, X1 = X2 = e, and
each of the L layers is reversible (models/layers/reversible.py):

    Y1 = X1 + Attn_l(LayerNorm(X2))      Attn_l: LSH or local attention, then W_O
    Y2 = X2 + FF_l(Y1)                   FF_l(y) = W_2 act(W_1 LayerNorm(y) + b_1) + b_2

and the output is log_softmax(W_out LayerNorm([Y1 ; Y2]) + b_out) over the 256 bytes.

LSH attention (shared QK). One projection gives each position a vector q_t = W_QK h_t that is
both its query and, normalised, its key k_t = q_t / rms(q_t); values v_t = W_V h_t. Hash round
r ∈ {0 .. R−1} puts t in bucket h_r(t) = argmax([q_t R_r ; −q_t R_r]) (random rotations R_r
fixed in the checkpoint; a factorised bucket count hashes per factor, models/layers/lsh.py).
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

State between calls (`LSHMemory`, models/layers/lsh_state.py): per LSH layer every position's
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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import ArchConfig, LanguageModel
from xlserve.models.layers.axial_positions import AxialPositions, LearnedPositions
from xlserve.models.layers.buffers import extend_memory
from xlserve.models.layers.feedforward import ACTIVATIONS
from xlserve.models.layers.init import init_weights
from xlserve.models.layers.linear import Linear
from xlserve.models.layers.lsh import (
    bucket_count, causal_attention, chunked_attention, decode_windows, hash_buckets, rotation_columns,
    self_score_for, sort_entries, sorted_slots, unit_rms,
)
from xlserve.models.layers.lsh_state import GROWING, LSHMemory
from xlserve.models.layers.reversible import reversible_stack

ATTENTION_KINDS = ("lsh", "local")
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


class LSHAttention(nn.Module):
    """Shared-QK attention over LSH buckets (module docstring): one pass, or decoding from the
    stored keys, values and buckets."""

    kind = "lsh"

    def __init__(self, config: ReformerConfig):
        super().__init__()
        c = self.config = config
        self.query_key = Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.value = Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.out = Linear(c.n_head * c.d_head, c.d_model, bias=False)
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
        self.query = Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.key = Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.value = Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.out = Linear(c.n_head * c.d_head, c.d_model, bias=False)

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


class ReformerLayer(nn.Module):
    """One reversible layer: F = attention behind a LayerNorm, G = the feed-forward behind one."""

    def __init__(self, config: ReformerConfig, kind: str):
        super().__init__()
        c = config
        self.attn_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.attention = LSHAttention(c) if kind == "lsh" else LocalAttention(c)
        self.ff_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.ff_in = Linear(c.d_model, c.d_inner)
        self.ff_out = Linear(c.d_inner, c.d_model)
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
        self.head = Linear(2 * c.d_model, c.vocab_size)
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
