"""Transformer-XL: a decoder-only language model with segment-level recurrence and relative
positional attention.

Paper: Zihang Dai, Zhilin Yang, Yiming Yang, Jaime Carbonell, Quoc V. Le, Ruslan Salakhutdinov,
"Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context", ACL 2019.

Each layer attends over the current segment and a memory of the previous `mem_len` positions,
whose gradient is stopped. Positions enter only through relative distances: the score between
query i and key j is

    (q_i + u) . k_j  +  (q_i + v) . W_kR R_{i-j}

where k_j = W_kE h_j (content keys), R is the sinusoidal encoding of the distance i - j, W_kR
its own projection, and u (`r_w_bias`), v (`r_r_bias`) are learned biases shared by all
positions. Because nothing depends on absolute positions, the memory can be reused as is by the
next segment.

Serving notes
- The memory we keep is each layer's projected keys and values (`XLMemory`), not the hidden
  states the paper stores. Keys and values are position-local functions of the hidden states, so
  the result is identical, and decoding one token costs O(context * d) per layer instead of
  re-projecting the memory at O(context * d^2).
- The relative term uses a per-layer table W_kR R_d for distances d = 0, 1, ..., built once per
  length in eval mode and reused by every request (it depends on the weights only). A single
  decoding row instead projects its query by W_kR and scores it against R itself, which all
  layers share: the same sum in another order, reading d_model^2 weights instead of a table.
- The memory's buffers are laid out for decoding (`extend_memory`): each head's keys as one
  contiguous (positions, D) matrix, each head's values the same for one row and as one
  contiguous (D, positions) matrix in a batch (see RelativeAttentionLayer.forward for why).
  Batching rows (`XLMemory.concat`) and keeping some of a batch's rows (`XLMemory.take`) write
  straight into such buffers, so a batch that changes does not copy its memory a second time.
- Training keeps the same memory of keys and values. In the paper the memory's keys are
  re-projected from the stored hidden states at every step; with the memory's gradient stopped,
  the only difference is that W_kE and W_v see no gradient through memory positions and the
  memory is projected by the weights of the step that produced it.

Chunking semantics (what `forward` promises about splitting a text into calls)
- `same_length=True` (our default; the paper's evaluation setting): every query attends to
  itself and exactly the `mem_len - 1` positions before it, whatever the chunking. Feeding a text
  in one call or in chunks of any size, one token at a time included, gives the same
  log-probabilities, also for chunks longer than `mem_len`.
- `same_length=False` (the paper's training setting): a query attends to the whole memory plus
  every earlier position of its own chunk, so how far back it sees depends on where its chunk
  began. A text of at most `mem_len + 1` tokens gives the same result in any chunking; beyond
  that, a chunk longer than one token lets later queries see further back than token-by-token
  decoding would, and the log-probabilities differ by design.
- `mem_len=0` means no memory: each call is an independent segment (causal within it).

Imported checkpoints (models/convert/transfo_xl.py)
- Hugging Face's TransfoXLLMHeadModel maps onto this file with `adaptive=True` (adaptive input
  and adaptive softmax, models/layers/adaptive.py), `final_norm=False` (its pre_lnorm variant
  has no norm after the last layer) and its own untie_r, clamp_len and same_length. Its memory
  holds hidden states where ours holds their projected keys and values; the log-probabilities
  are the same when both start from an empty memory (its `init_mems` starts from mem_len zero
  vectors, which take attention mass).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import ArchConfig, LanguageModel, State
from xlserve.models.layers.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from xlserve.models.layers.linear import Linear


@dataclass
class TransformerXLConfig(ArchConfig):
    vocab_size: int = 256  # bytes
    n_layer: int = 6
    d_model: int = 192  # width of the residual stream
    n_head: int = 4
    d_head: int = 48  # per-head width; n_head * d_head need not equal d_model
    d_inner: int = 512  # width of the position-wise feed-forward layer
    dropout: float = 0.0  # on embeddings, attention output and feed-forward
    dropatt: float = 0.0  # on attention probabilities
    mem_len: int = 256  # positions of memory kept per layer
    tgt_len: int = 128  # training segment length (serving accepts any chunk length)
    clamp_len: int = -1  # distances beyond clamp_len share its encoding; -1 = no clamping
    same_length: bool = True  # every query sees exactly mem_len positions (see module docstring)
    pre_norm: bool = True  # layer norm before each sub-layer (+ a final norm, see next); False = post-norm
    final_norm: bool = True  # with pre_norm: a layer norm after the last layer (HF's pre_lnorm has none)
    untie_r: bool = True  # per-layer u and v; False = one pair shared by all layers
    tie_embedding: bool = True  # output softmax shares the input embedding matrix (adaptive: every table)
    layer_norm_epsilon: float = 1e-5
    # adaptive input + adaptive softmax for word-level vocabularies (models/layers/adaptive.py)
    adaptive: bool = False  # False: one (vocab_size, d_model) embedding and a linear head
    d_embed: int | None = None  # adaptive: vector width of the first cluster; None = d_model
    cutoffs: list[int] = field(default_factory=list)  # adaptive: first id of each further cluster
    div_val: int = 1  # adaptive: cluster i has vectors of width d_embed // div_val**i
    tie_projs: list[bool] = field(default_factory=list)  # adaptive: per cluster, output projection = input's


@dataclass
class XLMemory(State):
    """Per layer, the projected keys and values of the last positions seen.

    keys[l], values[l]: (B, M, H, D) with M <= mem_len. `valid` (B, M) is False where a row of a
    batch was left-padded because its session has seen fewer positions than the longest one.
    """

    keys: list[Tensor]
    values: list[Tensor]
    valid: Tensor

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    @classmethod
    def empty(cls, batch_size: int, n_layer: int, n_head: int, d_head: int, like: Tensor) -> "XLMemory":
        """A memory that has seen nothing, with the dtype and device of `like`."""
        empty = lambda: like.new_zeros(batch_size, 0, n_head, d_head)  # noqa: E731
        return cls(
            keys=[empty() for _ in range(n_layer)],
            values=[empty() for _ in range(n_layer)],
            valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=like.device),
        )

    def check_within(self, mem_len: int | None) -> None:
        if mem_len is not None and self.length > mem_len:
            raise ValueError(f"memory holds {self.length} positions, more than mem_len {mem_len}")

    @classmethod
    def concat(cls, states: list["XLMemory"]) -> "XLMemory":
        """Rows of every state, left-padded to the longest memory. Serving (autograd off) writes
        them straight into buffers with room, laid out as a batch decodes them (`memory_buffer`):
        the batch's first step then appends in place instead of copying every memory again."""
        longest = max(s.length for s in states)
        batch = sum(s.valid.shape[0] for s in states)

        def pad(t: Tensor, fill) -> Tensor:  # left-pad dim 1 up to `longest`
            missing = longest - t.shape[1]
            if missing == 0:
                return t
            filler = t.new_full((t.shape[0], missing, *t.shape[2:]), fill)
            return torch.cat([filler, t], dim=1)

        def stack(parts: list[Tensor], positions_last: bool) -> Tensor:  # (b_i, M_i, H, D) each -> (B, longest, H, D)
            if torch.is_grad_enabled():
                return torch.cat([pad(t, 0) for t in parts])
            out = memory_buffer(parts[0], batch, longest, positions_last)
            start = 0
            for t in parts:
                _write_left_padded(out.narrow(0, start, t.shape[0]), t)
                start += t.shape[0]
            return out

        n_layer = len(states[0].keys)
        return cls(
            keys=[stack([s.keys[i] for s in states], False) for i in range(n_layer)],
            values=[stack([s.values[i] for s in states], batch > 1) for i in range(n_layer)],
            valid=torch.cat([pad(s.valid, False) for s in states]),
        )

    def take(self, rows: list[int]) -> "XLMemory":
        """The rows at `rows` (see State.take), less the padding none of them needs: `concat` of
        one slice per run of neighbouring rows, where splitting would hand it one row at a time."""
        needed = self.valid[rows].any(dim=0)  # (M,)
        start = int(needed.long().argmax()) if bool(needed.any()) else self.length  # padding only before it
        runs: list[list[int]] = []  # [first row, row count]
        for row in rows:
            if runs and sum(runs[-1]) == row:
                runs[-1][1] += 1
            else:
                runs.append([row, 1])
        return XLMemory.concat([
            XLMemory(keys=[k.narrow(0, first, count)[:, start:] for k in self.keys],
                     values=[v.narrow(0, first, count)[:, start:] for v in self.values],
                     valid=self.valid.narrow(0, first, count)[:, start:])
            for first, count in runs
        ])

    def put_row(self, index: int, row: "XLMemory") -> bool:
        """State.put_row: the row's memory, left-padded to this batch's length, written into
        place `index` (its buffers' other places and room untouched). Not for a row with a
        longer memory than the batch's, nor under autograd."""
        if torch.is_grad_enabled() or row.valid.shape[0] != 1 or row.length > self.length:
            return False
        for mine, theirs in zip([*self.keys, *self.values], [*row.keys, *row.values]):
            _write_left_padded(mine.narrow(0, index, 1), theirs)
        missing = self.length - row.length
        self.valid[index, :missing] = False
        self.valid[index, missing:] = row.valid[0]
        return True

    def split(self) -> list["XLMemory"]:
        rows = []
        for row in super().split():
            # drop the padding this row carried inside a batch; padding only ever sits on the left
            start = int((~row.valid[0]).sum())
            rows.append(
                XLMemory(
                    keys=[k[:, start:] for k in row.keys],
                    values=[v[:, start:] for v in row.values],
                    valid=row.valid[:, start:],
                )
            )
        return rows


def _write_left_padded(target: Tensor, rows: Tensor) -> None:
    """Write (b, M, H, D) `rows` into the end of the (b, M', H, D) `target`, M <= M', and zeros
    before them: the padding is masked, but 0 * garbage could be nan."""
    missing = target.shape[1] - rows.shape[1]
    if missing:
        target.narrow(1, 0, missing).zero_()
    target.narrow(1, missing, rows.shape[1]).copy_(rows)


MEMORY_ROOM = 64  # spare positions after a memory buffer: decoding copies the memory once per 64 steps
_CLAIM = threading.Lock()  # two threads continuing the same state must not both take its room


def extend_memory(memory: Tensor, new: Tensor, positions_last: bool = False) -> Tensor:
    """torch.cat([memory, new], dim=1) for (B, M, H, D) + (B, T, H, D), without copying `memory`
    when it can be avoided. With autograd on (training) it is torch.cat itself: a buffer written
    in place would break the graph.

    The result is a (B, M + T, H, D) view of a buffer with MEMORY_ROOM spare positions after it,
    laid out for the decoding product that reads it: (B, H, capacity, D) by default, so each
    head's keys are one contiguous (positions, D) matrix, or with `positions_last`
    (B, H, D, capacity), so each head's values are one contiguous (D, positions) matrix (see
    RelativeAttentionLayer.forward for why). Either way the matrix-product kernels stream whole
    rows instead of rows strided by H * D, and the view keeps the (B, M, H, D) shape every caller
    works with. The buffer's storage records its layout and how far it has been written
    (`_xl_positions_last`, `_xl_filled`); when `memory` is a full-batch view of such a buffer that
    ends exactly there and the room suffices, `new` is written into the room and the longer view
    returned. The positions `memory` covers are never written, so every earlier state stays
    valid: a second continuation of the same state (a retry, a fork) finds the room taken and
    copies instead.
    """
    if torch.is_grad_enabled():
        return torch.cat([memory, new], dim=1)
    B, M, H, D = memory.shape
    T = new.shape[1]
    positions = 3 if positions_last else 2  # the buffer's position dimension
    to_view = (0, 3, 1, 2) if positions_last else (0, 2, 1, 3)  # buffer (B, H, ., .) -> (B, M, H, D)
    to_buffer = (0, 2, 3, 1) if positions_last else (0, 2, 1, 3)  # (B, T, H, D) -> buffer order
    storage = memory.untyped_storage()
    ours = getattr(storage, "_xl_positions_last", None) == positions_last  # a buffer of this layout made here
    if ours and memory.dtype == new.dtype and memory.device == new.device and B * H * D > 0:
        capacity = storage.nbytes() // (B * H * D * memory.element_size())
        shape = (B, H, D, capacity) if positions_last else (B, H, capacity, D)
        buffer = memory.as_strided(shape, (H * D * capacity, D * capacity, shape[3], 1), 0)
        step = buffer.stride(positions)  # storage elements between two positions
        offset = memory.storage_offset()
        if (
            memory.stride() == buffer.permute(*to_view).stride()  # a view of this buffer ...
            and buffer.numel() * memory.element_size() == storage.nbytes()  # ... of every batch row
            and offset % step == 0
            and offset < capacity * step  # starting in batch row 0, head 0
        ):
            start = offset // step
            with _CLAIM:
                claimed = storage._xl_filled == start + M and start + M + T <= capacity
                if claimed:
                    storage._xl_filled = start + M + T
            if claimed:
                buffer.narrow(positions, start + M, T).copy_(new.permute(*to_buffer))
                return buffer.narrow(positions, start, M + T).permute(*to_view)
    out = memory_buffer(memory, B, M + T, positions_last)
    out.narrow(1, 0, M).copy_(memory)
    out.narrow(1, M, T).copy_(new)
    return out


def memory_buffer(like: Tensor, batch: int, length: int, positions_last: bool = False) -> Tensor:
    """A new, unwritten (batch, length, H, D) memory (H, D, dtype and device as `like`'s) at the
    start of a buffer with MEMORY_ROOM spare positions after it, in `extend_memory`'s layout and
    recorded as filled up to `length`: the caller writes it, and extend_memory then appends into
    its room."""
    _, _, H, D = like.shape
    capacity = length + MEMORY_ROOM
    buffer = like.new_empty((batch, H, D, capacity) if positions_last else (batch, H, capacity, D))
    buffer.untyped_storage()._xl_positions_last = positions_last
    buffer.untyped_storage()._xl_filled = length
    if positions_last:
        return buffer.narrow(3, 0, length).permute(0, 3, 1, 2)  # (B, length, H, D)
    return buffer.narrow(2, 0, length).permute(0, 2, 1, 3)


def sinusoid_encoding(distances: Tensor, d_model: int) -> Tensor:
    """distances (K,) -> (K, d_model): [sin(d * w_i) ..., cos(d * w_i) ...] as in the paper."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, dtype=torch.float32) / d_model))
    angles = distances.float()[:, None] * inv_freq[None, :]  # (K, d_model / 2)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class RelativeAttentionLayer(nn.Module):
    """One Transformer-XL layer: relative multi-head attention + position-wise feed-forward."""

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        self.config = config
        c = config
        self.qkv_net = Linear(c.d_model, 3 * c.n_head * c.d_head, bias=False)  # W_q, W_kE, W_v
        self.r_net = Linear(c.d_model, c.n_head * c.d_head, bias=False)  # W_kR
        self.o_net = Linear(c.n_head * c.d_head, c.d_model, bias=False)
        self.attn_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.ff = nn.Sequential(
            Linear(c.d_model, c.d_inner),
            nn.ReLU(),
            nn.Dropout(c.dropout),
            Linear(c.d_inner, c.d_model),
            nn.Dropout(c.dropout),
        )
        self.ff_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.drop = nn.Dropout(c.dropout)
        self.dropatt = nn.Dropout(c.dropatt)
        self.scale = 1.0 / math.sqrt(c.d_head)

    def forward(
        self,
        x: Tensor,  # (B, T, d_model)
        mem_keys: Tensor,  # (B, M, H, D)
        mem_values: Tensor,  # (B, M, H, D)
        rel_keys: Tensor | None,  # (K, H, D): W_kR R_d for distance d = 0 .. K-1; None: use `encoding`
        encoding: Tensor | None,  # (K, d_model): R_d, when rel_keys is None (one decoding row)
        distance: Tensor,  # (T, K) int64: the distance d of each (query, key)
        allowed: Tensor,  # (B, 1, T, K) bool
        r_w_bias: Tensor,  # (H, D) u
        r_r_bias: Tensor,  # (H, D) v
    ) -> tuple[Tensor, Tensor, Tensor]:
        c = self.config
        B, T, _ = x.shape
        h = self.attn_norm(x) if c.pre_norm else x
        q, k, v = self.qkv_net(h).view(B, T, 3, c.n_head, c.d_head).unbind(dim=2)  # (B, T, H, D)
        inference = not torch.is_grad_enabled()
        # decode (one new position): scores and attended values are one batched product each,
        # over the memory as it lies (see extend_memory), where an einsum would copy it first.
        # Which orientation is fastest depends on where the memory is. A batch's memory comes
        # from beyond the cache: there a contiguous matrix times a vector streams best, so a
        # batch keeps its values as (D, K) rows and multiplies (K, D) keys and (D, K) values by
        # the query and the probabilities (shipped model, memory full, one thread: a batch-16
        # step took a median 4.93 ms against 5.43; mem_len 1,600, 12 layers of d_model 512, two
        # threads: batch 8 71-82 against 104-109 ms). One row's memory is mostly still in cache,
        # where the vector on the left over (K, D) rows is faster (that model at batch 1: a
        # median 24.3 against 26.8 ms the other way).
        batched = B > 1
        keys = extend_memory(mem_keys, k)  # (B, K, H, D) over a (B, H, capacity, D) buffer
        values = extend_memory(mem_values, v, positions_last=batched)  # a batch: over (B, H, D, capacity)
        K = keys.shape[1]
        decode = inference and T == 1
        if decode:
            qw = (q + r_w_bias).transpose(1, 2)  # (B, H, 1, D)
            if batched:
                content = (keys.transpose(1, 2) @ qw.transpose(2, 3)).transpose(2, 3)  # (B, H, K, D) @ (B, H, D, 1)
            else:
                content = qw @ keys.permute(0, 2, 3, 1)  # (B, H, 1, D) @ (B, H, D, K) -> (B, H, 1, K)
        else:
            content = torch.einsum("bthd,bkhd->bhtk", q + r_w_bias, keys)  # (B, H, T, K)
        if rel_keys is None:
            # one decoding row: (q + v) . W_kR R_d = ((q + v) W_kR) . R_d, so project the query once
            # and read the encodings R, shared by every layer and small enough to stay in cache,
            # instead of this layer's (K, H, D) table W_kR R (see TransformerXL.forward)
            qr = (q + r_r_bias)[0].transpose(0, 1)  # (H, 1, D)
            w = qr @ self.r_net.weight.view(c.n_head, c.d_head, c.d_model)  # (H, 1, d_model)
            by_distance = (w[:, 0] @ encoding.t())[None, :, None]  # (1, H, 1, K)
        else:  # score every query against every distance once, then pick the distance of each (i, j)
            by_distance = torch.einsum("bthd,khd->bhtk", q + r_r_bias, rel_keys)  # (B, H, T, K)
        position = torch.gather(by_distance, 3, distance.expand(B, c.n_head, T, K))
        scores = (content + position) * self.scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = self.dropatt(torch.softmax(scores, dim=-1))
        if decode:
            if values.stride(1) == 1:  # (D, K) rows, as a batch keeps them (any layout gives the same sum)
                attended = (values.permute(0, 2, 3, 1) @ probs.transpose(2, 3)).permute(0, 3, 1, 2)  # (B, 1, H, D)
            else:
                attended = (probs @ values.transpose(1, 2)).transpose(1, 2)  # (B, H, 1, K) @ (B, H, K, D)
            attended = attended.reshape(B, T, -1)
        else:
            attended = torch.einsum("bhtk,bkhd->bthd", probs, values).reshape(B, T, -1)
        out = self.drop(self.o_net(attended))

        if c.pre_norm:
            x = x + out
            x = x + self.ff(self.ff_norm(x))
        else:
            x = self.attn_norm(x + out)
            x = self.ff_norm(x + self.ff(x))
        return x, keys, values


class TransformerXL(LanguageModel):
    architecture = "transformer-xl"
    config_class = TransformerXLConfig
    state_class = XLMemory
    state_kind = "segment-recurrence"
    state_grows_with_context = False  # bounded by mem_len
    ragged_chunks = True  # forward(tokens, state, lengths): see the end of forward

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        self.config = config
        c = config
        if not c.adaptive and (c.cutoffs or c.tie_projs or c.div_val != 1 or c.d_embed not in (None, c.d_model)):
            raise ValueError("cutoffs, div_val, tie_projs and d_embed != d_model need adaptive=True")
        if c.adaptive:
            d_embed = c.d_embed or c.d_model
            self.embedding = AdaptiveEmbedding(c.vocab_size, d_embed, c.d_model, c.cutoffs, c.div_val)
        else:
            self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(RelativeAttentionLayer(c) for _ in range(c.n_layer))
        n_bias = c.n_layer if c.untie_r else 1
        self.r_w_bias = nn.Parameter(torch.zeros(n_bias, c.n_head, c.d_head))  # u
        self.r_r_bias = nn.Parameter(torch.zeros(n_bias, c.n_head, c.d_head))  # v
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon) if c.pre_norm and c.final_norm else None
        if c.adaptive:  # returns log-probabilities itself
            self.head = AdaptiveLogSoftmax(
                c.vocab_size, d_embed, c.d_model, c.cutoffs, c.div_val, self.embedding, c.tie_embedding, c.tie_projs
            )
        else:
            self.head = Linear(c.d_model, c.vocab_size)
            if c.tie_embedding:
                self.head.weight = self.embedding.weight
        self.apply(self._init_weights)
        nn.init.normal_(self.r_w_bias, std=0.02)
        nn.init.normal_(self.r_r_bias, std=0.02)
        # eval-mode cache of W_kR R_d per layer; derived from the weights, never per-session
        self._rel_key_cache: dict[tuple, tuple[Tensor, list[Tensor]]] = {}

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    @property
    def max_context(self) -> int | None:
        return None  # any history; it sees the last mem_len positions of it

    def init_state(self, batch_size: int) -> XLMemory:
        c = self.config
        return XLMemory.empty(batch_size, c.n_layer, c.n_head, c.d_head, like=self.r_w_bias)

    def _fixed_state_dims(self, name: str, fresh: Tensor) -> range:
        return range(2, fresh.dim())  # memory length (dim 1) varies

    def check_state(self, state: State) -> None:
        super().check_state(state)
        state.check_within(self.config.mem_len)

    def train(self, mode: bool = True):
        self._rel_key_cache.clear()  # weights are about to change
        return super().train(mode)

    def _load_from_state_dict(self, *args, **kwargs):
        self._rel_key_cache.clear()
        return super()._load_from_state_dict(*args, **kwargs)

    def relative_positions(self, length: int) -> tuple[Tensor, list[Tensor]]:
        """R_d for d = 0 .. length-1 as (length, d_model), and per layer W_kR R_d as (length, H, D)."""
        c = self.config
        dtype, device = self.r_w_bias.dtype, self.r_w_bias.device
        cacheable = not self.training and not torch.is_grad_enabled()
        if cacheable:
            for (cached_len, cached_dtype, cached_device), (encoding, tables) in self._rel_key_cache.items():
                if cached_len >= length and cached_dtype == dtype and cached_device == device:
                    return encoding[:length], [t[:length] for t in tables]
            length = max(length, 2 * max((k[0] for k in self._rel_key_cache), default=0), 512)
        distances = torch.arange(length, device=device)
        if c.clamp_len > 0:
            distances = distances.clamp(max=c.clamp_len)
        encoding = self.drop(sinusoid_encoding(distances, c.d_model).to(device=device, dtype=dtype))
        tables = [layer.r_net(encoding).view(length, c.n_head, c.d_head) for layer in self.layers]
        if cacheable:
            self._rel_key_cache.clear()
            self._rel_key_cache[(length, dtype, device)] = (encoding, tables)
        return encoding, tables

    def forward(self, tokens: Tensor, state: XLMemory, lengths: Tensor | None = None) -> tuple[Tensor, XLMemory]:
        """tokens (B, T) -> log-probs (B, T, V) and the memory after them. With `lengths` (B,),
        row b's chunk is tokens[b, :lengths[b]], right-padded: the padding comes after every
        real token, so causality already hides it from them, and only the memory kept needs
        care (each row's window ends at its own last token)."""
        c = self.config
        B, T = tokens.shape
        M = state.length
        K = M + T

        # distance from query i (at absolute index M + i) to key j, and who may see whom
        query_pos = torch.arange(M, K, device=tokens.device)[:, None]  # (T, 1)
        key_pos = torch.arange(K, device=tokens.device)[None, :]  # (1, K)
        distance = query_pos - key_pos  # (T, K)
        allowed = distance >= 0
        if c.same_length and c.mem_len > 0:
            allowed = allowed & (distance < c.mem_len)
        valid = torch.cat([state.valid, state.valid.new_ones(B, T)], dim=1)  # (B, K)
        allowed = allowed[None, None] & valid[:, None, None, :]  # (B, 1, T, K)
        distance = distance.clamp(min=0)

        encoding, rel_keys = self.relative_positions(K)
        if T == 1 and B == 1 and not torch.is_grad_enabled() and not self.training:
            # one decoding row: each layer projects its query by W_kR and reads the shared R
            # (3 MB at K = 1,600, d_model 512) rather than its own table W_kR R of the same size;
            # this measured 4.4 against 8.3 ms per token over 12 layers on one CPU core
            rel_keys = [None] * c.n_layer
        x = self.drop(self.embedding(tokens) * math.sqrt(c.d_model))  # (B, T, d_model)
        new_keys, new_values = [], []
        keep = max(0, K - c.mem_len)  # first index of what stays in memory
        for i, layer in enumerate(self.layers):
            bias = i if c.untie_r else 0
            x, keys, values = layer(
                x, state.keys[i], state.values[i], rel_keys[i], encoding, distance, allowed,
                self.r_w_bias[bias], self.r_r_bias[bias],
            )
            new_keys.append(keys.detach())  # (B, K, H, D); trimmed to the memory below
            new_values.append(values.detach())
        if self.final_norm is not None:
            x = self.final_norm(x)
        x = self.drop(x)
        if c.adaptive:
            log_probs = self.head(x)  # (B, T, V)
        else:
            log_probs = F.log_softmax(self.head(x).float(), dim=-1)  # (B, T, V)
        if lengths is not None and bool((lengths < T).any()):
            return log_probs, self._ragged_memory(new_keys, new_values, valid, T - lengths.to(tokens.device), K - keep)
        return log_probs, XLMemory(keys=[k[:, keep:] for k in new_keys], values=[v[:, keep:] for v in new_values],
                                   valid=valid[:, keep:])

    @staticmethod
    def _ragged_memory(keys: list[Tensor], values: list[Tensor], valid: Tensor, padding: Tensor, W: int) -> XLMemory:
        """The W-position memory kept after a right-padded batch, from the (B, K, H, D) keys and
        values of every position: row b's last `padding[b]` positions are not its own, so its
        window is the W positions before them. Rows are shifted right by their padding, so that
        each row's last real position is the memory's last (the next token's distances count
        from there); what is shifted in from before position 0 is marked as padding, on the
        left, where XLMemory keeps a batch's padding."""
        B, K = valid.shape
        source = torch.arange(K - W, K, device=valid.device)[None, :] - padding[:, None]  # (B, W)
        inside = source >= 0
        source = source.clamp(min=0)
        index = source[:, :, None, None].expand(B, W, *keys[0].shape[2:])  # (B, W, H, D)
        return XLMemory(
            keys=[k.gather(1, index) for k in keys],
            values=[v.gather(1, index) for v in values],
            valid=valid.gather(1, source) & inside,
        )

    def with_mem_len(self, mem_len: int) -> "TransformerXL":
        """A view of this model (same parameters) that keeps `mem_len` positions of memory."""
        import copy
        import dataclasses

        view = copy.copy(self)
        view.config = dataclasses.replace(self.config, mem_len=mem_len)  # layers never read mem_len
        return view
