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
positions (models/layers/relative.py). Because nothing depends on absolute positions, the
memory can be reused as is by the next segment.

Serving notes
- The memory we keep is each layer's projected keys and values (`XLMemory`,
  models/layers/xl_memory.py), not the hidden states the paper stores. Keys and values are
  position-local functions of the hidden states, so the result is identical, and decoding one
  token costs O(context * d) per layer instead of re-projecting the memory at O(context * d^2).
- The relative term uses a per-layer table W_kR R_d for distances d = 0, 1, ..., built once per
  length in eval mode and reused by every request (it depends on the weights only), stored
  head-major so that each head's distances are one contiguous matrix (RelativeKeys). Every
  decoding step, one row or a batch, reads it (the comments above `_decode_scores` say why not
  R itself).
- Decoding appends to the memory in place, in buffers laid out for the products that read them
  (models/layers/buffers.py; `_decode_scores` and `_decode_attend` below say why that layout).
- A prompt chunk whose whole rows nobody reads is scored without them (`forward_scored`): the
  adaptive softmax computes a tail cluster only for the positions whose next token is in it.
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
  and adaptive softmax, `AdaptiveEmbedding` and `AdaptiveLogSoftmax`), `final_norm=False` (its pre_lnorm variant
  has no norm after the last layer) and its own untie_r, clamp_len and same_length. Its memory
  holds hidden states where ours holds their projected keys and values; the log-probabilities
  are the same when both start from an empty memory (its `init_mems` starts from mem_len zero
  vectors, which take attention mass).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import LanguageModel, State, TransformerConfig, last_positions
from xlserve.models.layers.buffers import extend_memory
from xlserve.models.layers.init import init_weights
from xlserve.models.layers.relative import (
    RelativeAttentionBlock, RelativeKeys, layer_norm, relative_scores,
)
from xlserve.models.layers.xl_memory import XLMemory
from xlserve.models.linear import linear


@dataclass
class TransformerXLConfig(TransformerConfig):
    """vocab_size, n_layer, d_model, n_head, d_head and d_inner: TransformerConfig's
    (models/interface.py), with six layers and a narrower feed-forward by default."""

    n_layer: int = 6
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
    # adaptive input + adaptive softmax for word-level vocabularies (AdaptiveEmbedding, AdaptiveLogSoftmax)
    adaptive: bool = False  # False: one (vocab_size, d_model) embedding and a linear head
    d_embed: int | None = None  # adaptive: vector width of the first cluster; None = d_model
    cutoffs: list[int] = field(default_factory=list)  # adaptive: first id of each further cluster
    div_val: int = 1  # adaptive: cluster i has vectors of width d_embed // div_val**i
    tie_projs: list[bool] = field(default_factory=list)  # adaptive: per cluster, output projection = input's


# -- adaptive input and adaptive softmax (word-level vocabularies) ---------------------------------
# Papers: Alexei Baevski, Michael Auli, "Adaptive Input Representations for Neural Language
# Modeling", ICLR 2019; Edouard Grave, Armand Joulin, Moustapha Cissé, David Grangier, Hervé Jégou,
# "Efficient softmax approximation for GPUs", ICML 2017. Transformer-XL's WikiText-103 model uses
# both, with the input and output sides sharing their weights.
#
# The vocabulary, sorted by frequency, is cut into clusters at `cutoffs`: cluster 0 holds ids
# [0, cutoffs[0]), cluster i holds [cutoffs[i-1], cutoffs[i]), the last one ends at vocab_size.
# Cluster i has vectors of width d_embed // div_val**i (rare words get narrow vectors) that a
# projection of shape (d_model, d_i) maps to and from the model width.
#
# - Input: token -> its cluster's vector (d_i) -> projected to d_model. With div_val == 1 there
#   is one table of width d_embed for the whole vocabulary and one projection, present only when
#   d_embed != d_model.
# - Output: the head scores the ids of cluster 0 plus one logit per further cluster; a tail
#   cluster's ids are scored among themselves, and log p(id) = log p_head(cluster) + log p_tail(id).
#   Every cluster projects the hidden state with its own projection (with div_val == 1 and
#   d_embed == d_model there are none). The head's cluster logits use `cluster_weight` (width
#   d_embed) and `cluster_bias`.
# - Sharing: `tie_weight` makes the output vectors of each cluster the input table (the output
#   keeps its own bias); `tie_projs[i]` makes cluster i's output projection the input projection
#   of cluster i (with div_val == 1: the single input projection).
#
# `AdaptiveLogSoftmax` returns log-probabilities over the whole vocabulary (no sampled or
# target-only shortcut): serving needs the full distribution.


def cluster_bounds(vocab_size: int, cutoffs: list[int]) -> list[int]:
    """[0, *cutoffs, vocab_size], checked to be strictly increasing."""
    bounds = [0, *cutoffs, vocab_size]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cutoffs {cutoffs} must increase strictly between 0 and vocab_size {vocab_size}")
    return bounds


def cluster_widths(d_embed: int, n_clusters: int, div_val: int) -> list[int]:
    """Vector width of each cluster: d_embed // div_val**i (all d_embed when div_val == 1)."""
    widths = [d_embed // div_val**i for i in range(n_clusters)]
    if min(widths) < 1:
        raise ValueError(f"d_embed {d_embed} with div_val {div_val} leaves a cluster of width 0")
    return widths


class AdaptiveEmbedding(nn.Module):
    """tokens (B, T) -> (B, T, d_model), unscaled."""


    def __init__(self, vocab_size: int, d_embed: int, d_model: int, cutoffs: list[int], div_val: int):
        super().__init__()
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        self.d_model = d_model
        if div_val == 1:  # one table for the whole vocabulary
            self.tables = nn.ModuleList([nn.Embedding(vocab_size, d_embed)])
            widths = [d_embed] if d_embed != d_model else []
        else:
            widths = cluster_widths(d_embed, len(self.bounds) - 1, div_val)
            sizes = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
            self.tables = nn.ModuleList(nn.Embedding(n, d) for n, d in zip(sizes, widths))
        # projections[i]: (d_model, d_i), applied as x @ P.T; one per table, or none at all
        self.projections = nn.ParameterList(nn.Parameter(torch.empty(d_model, d)) for d in widths)
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.02)
        for projection in self.projections:
            nn.init.normal_(projection, std=0.01)

    def forward(self, tokens: Tensor) -> Tensor:
        if len(self.tables) == 1:
            x = self.tables[0](tokens)  # (B, T, d_embed)
            return F.linear(x, self.projections[0]) if len(self.projections) else x
        flat = tokens.reshape(-1)
        out = self.projections[0].new_zeros(flat.shape[0], self.d_model)  # (B*T, d_model)
        for i, (table, projection) in enumerate(zip(self.tables, self.projections)):
            low, high = self.bounds[i], self.bounds[i + 1]
            rows = ((flat >= low) & (flat < high)).nonzero().squeeze(1)
            if rows.numel():
                out.index_copy_(0, rows, F.linear(table(flat[rows] - low), projection))
        return out.view(*tokens.shape, self.d_model)


class AdaptiveLogSoftmax(nn.Module):
    """hidden (..., d_model) -> log-probabilities (..., vocab_size) in float32."""


    def __init__(
        self,
        vocab_size: int,
        d_embed: int,
        d_model: int,
        cutoffs: list[int],
        div_val: int,
        embedding: AdaptiveEmbedding,
        tie_weight: bool,
        tie_projs: list[bool],
    ):
        super().__init__()
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        n_clusters = len(self.bounds) - 1
        if len(tie_projs) not in (0, n_clusters):
            raise ValueError(f"tie_projs has {len(tie_projs)} entries, expected one per cluster ({n_clusters})")
        tie_projs = list(tie_projs) or [False] * n_clusters

        # output vectors: the input tables (tie_weight) or tables of the same layout
        if tie_weight:
            self.tables = embedding.tables  # shared module: same parameters under both names
        else:
            self.tables = nn.ModuleList(nn.Embedding(*t.weight.shape) for t in embedding.tables)
            for table in self.tables:
                nn.init.normal_(table.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(vocab_size))  # (V,) never shared

        # one projection per cluster when the input side has any (div_val > 1 or d_embed != d_model)
        projections = []
        for i in range(n_clusters if len(embedding.projections) else 0):
            source = embedding.projections[0 if div_val == 1 else i]
            if tie_projs[i]:
                projections.append(source)
            else:
                projections.append(nn.Parameter(torch.empty_like(source).normal_(std=0.01)))
        self.projections = nn.ParameterList(projections)

        if n_clusters > 1:  # the head scores each tail cluster with one logit
            self.cluster_weight = nn.Parameter(torch.zeros(n_clusters - 1, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(n_clusters - 1))
            nn.init.normal_(self.cluster_weight, std=0.02)
        self.int8_products: nn.ModuleDict | None = None  # XLSERVE_QUANTIZE=int8: set by quantize_int8

    def quantize_int8(self, int8_layer: Callable[[Tensor, Tensor | None], nn.Module]) -> None:
        """Multiply through weight-only int8 copies of the products (`int8_layer(weight, bias)`:
        models/quantize.py's Int8Linear.for_weight): per cluster its projection and its output
        vectors with their bias, and the head's cluster logits. The float tables stay: the input
        embedding shares them."""
        b = self.bounds
        products = {}
        for i in range(len(b) - 1):
            if len(self.projections):
                products[f"project{i}"] = int8_layer(self.projections[i].t(), None)  # hidden @ P = linear(hidden, P.T)
            products[f"output{i}"] = int8_layer(self._cluster_vectors(i), self.bias[b[i] : b[i + 1]])
        if len(b) > 2:
            products["clusters"] = int8_layer(self.cluster_weight, self.cluster_bias)
        self.int8_products = nn.ModuleDict(products)

    def _int8(self, name: str) -> nn.Module | None:
        """The int8 copy of the product called `name`, if quantize_int8 made one."""
        return None if self.int8_products is None else self.int8_products[name] if name in self.int8_products else None

    def _product(self, name: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """linear(x, weight, bias), through its int8 copy `name` when there is one."""
        int8 = self._int8(name)
        return int8(x) if int8 is not None else linear(x, weight, bias)

    def _cluster_vectors(self, i: int) -> Tensor:
        """(size_i, d_i): output vectors of cluster i."""
        if len(self.tables) == 1:
            return self.tables[0].weight[self.bounds[i] : self.bounds[i + 1]]
        return self.tables[i].weight

    def _project(self, hidden: Tensor, i: int) -> Tensor:
        """(N, d_model) -> (N, d_i) with cluster i's projection (identity when there is none)."""
        if not len(self.projections):
            return hidden
        int8 = self._int8(f"project{i}")
        return int8(hidden) if int8 is not None else hidden @ self.projections[i]

    def _head(self, h: Tensor) -> Tensor:
        """(N, d_model) -> (N, cutoffs[0] + tail clusters): log-probabilities of the head's ids
        and of each tail cluster."""
        b = self.bounds
        projected = self._project(h, 0)  # (N, d_0)
        # (N, cutoffs[0])
        head_logits = self._product("output0", projected, self._cluster_vectors(0), self.bias[b[0] : b[1]])
        if len(b) > 2:  # one more logit per tail cluster
            cluster_logits = self._product("clusters", projected, self.cluster_weight, self.cluster_bias)
            head_logits = torch.cat([head_logits, cluster_logits], dim=-1)
        return F.log_softmax(head_logits.float(), dim=-1)

    def _tail_logits(self, h: Tensor, i: int) -> Tensor:
        """(N, d_model) -> (N, size_i): the scores of tail cluster i's ids."""
        b = self.bounds
        return self._product(f"output{i}", self._project(h, i), self._cluster_vectors(i), self.bias[b[i] : b[i + 1]])

    def _tail(self, h: Tensor, i: int) -> Tensor:
        """(N, d_model) -> (N, size_i): log-probabilities of tail cluster i's ids within it."""
        return F.log_softmax(self._tail_logits(h, i).float(), dim=-1)

    def forward(self, hidden: Tensor) -> Tensor:
        shape = hidden.shape[:-1]
        h = hidden.reshape(-1, hidden.shape[-1])  # (N, d_model)
        b = self.bounds
        head = self._head(h)  # (N, cutoffs[0] + tail clusters)
        if len(b) == 2:  # one cluster: the head is the whole row
            return head.view(*shape, b[-1])
        # each cluster's log-probabilities go into its columns of one (N, V) tensor and get their
        # cluster's log-probability added in place, where adding into a new tensor and then
        # concatenating the pieces wrote every row twice more (at wt103's shape 1.1 MB a row;
        # the same bits). Without autograd log_softmax writes straight into the columns (for
        # one row; for several, through a copy of its own), which has no derivative.
        log_probs = head.new_empty(h.shape[0], b[-1])  # (N, V)
        log_probs[:, : b[1]] = head[:, : b[1]]
        for i in range(1, len(b) - 1):
            cluster = log_probs[:, b[i] : b[i + 1]]
            if torch.is_grad_enabled():
                cluster.copy_(self._tail(h, i))
            else:
                torch.log_softmax(self._tail_logits(h, i).float(), dim=-1, out=cluster)
            cluster += head[:, b[1] + i - 1, None]
        return log_probs.view(*shape, b[-1])  # (..., V)

    def log_prob_of(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """log p(targets[n]) after hidden[n]: (N, d_model), (N,) -> (N,), as forward(hidden)
        gathered at targets, without its whole rows: the head for every row, and a tail
        cluster only for the rows whose target is in it (most words of a text are in the
        head), each scored against its own cluster alone."""
        b = self.bounds
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= b[-1]):
            raise ValueError(f"target ids must lie in [0, {b[-1]}): got {int(targets.min())} to {int(targets.max())}")
        head = self._head(hidden)  # (N, cutoffs[0] + tail clusters)
        scores = head.gather(1, targets.clamp(max=b[1] - 1)[:, None])[:, 0]  # right for targets in the head
        for i in range(1, len(b) - 1):
            rows = ((targets >= b[i]) & (targets < b[i + 1])).nonzero()[:, 0]  # (n,)
            if rows.numel():
                tail = self._tail(hidden[rows], i)  # (n, size_i)
                within = tail.gather(1, (targets[rows] - b[i])[:, None])[:, 0]
                scores[rows] = head[rows, b[1] + i - 1] + within
        return scores


# -- the model -------------------------------------------------------------------------------------


class RelativeAttentionLayer(RelativeAttentionBlock):
    """One Transformer-XL layer: relative multi-head attention + position-wise feed-forward (the
    parameters and residual wiring of `RelativeAttentionBlock`, models/layers/relative.py)."""

    config: TransformerXLConfig

    def forward(
        self,
        x: Tensor,  # (B, T, d_model)
        mem_keys: Tensor,  # (B, M, H, D)
        mem_values: Tensor,  # (B, M, H, D)
        rel_keys: Tensor,  # (K, H, D): W_kR R_d for distance d = 0 .. K-1
        distance: Tensor,  # (T, K) int64: the distance d of each (query, key)
        blocked: Tensor,  # (B, 1, T, K) bool: True where the query may not see the key
        r_w_bias: Tensor,  # (H, D) u
        r_r_bias: Tensor,  # (H, D) v
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The layer's output (B, T, d_model) and its keys and values over memory + chunk
        (B, K, H, D), K = M + T."""
        c = self.config
        B, T, _ = x.shape
        if T == 1 and not self.training and not torch.is_grad_enabled():
            return self._decode(x, mem_keys, mem_values, rel_keys, blocked, r_w_bias, r_r_bias)
        h = self.attn_norm(x) if c.pre_norm else x
        q, k, v = self.qkv_net(h).view(B, T, 3, c.n_head, c.d_head).unbind(dim=2)  # (B, T, H, D)
        keys = extend_memory(mem_keys, k)  # (B, K, H, D) over a (B, H, capacity, D) buffer
        values = extend_memory(mem_values, v)
        scores = relative_scores(q, keys, rel_keys, distance, r_w_bias, r_r_bias) * self.scale  # (B, H, T, K)
        probs = self.dropatt(torch.softmax(scores.masked_fill_(blocked, float("-inf")), dim=-1))
        attended = torch.einsum("bhtk,bkhd->bthd", probs, values)  # (B, T, H, D)
        out = self.drop(self.o_net(attended.reshape(B, T, -1)))
        return self.add_attention_and_feed_forward(x, out), keys, values

    # Decoding one position per row, in eval mode without autograd: `forward`'s numbers through
    # fewer Python calls. A wt103-shaped step streams 1.1 GB of weights, and each call after a
    # large product finds the caches emptied of the interpreter's and the dispatcher's own data,
    # so a module call or an nn.Module.__getattr__ that takes a microsecond alone takes many there.
    # So the products go through each module's own `forward` (F.linear, oneDNN's product for a
    # batch, an int8 copy: whatever the module is now), the norms through F.layer_norm on their
    # parameters, and dropout, the identity in eval mode, is left out; no hooks run on this path.
    # The layer's own mode decides: dropout modules set to training inside an eval-mode layer are
    # not applied here. The residual wiring is `add_attention_and_feed_forward`'s, written out.
    # A wt103-shaped batch-1 step took 49.6-49.9 ms this way against 50.4-53.1 through the
    # modules, the same bits (2026-12-05, three pairs of processes alternating; docs/benchmarks.md,
    # "Transformer-XL's decoding step without module calls").

    def _decode(self, x: Tensor, mem_keys: Tensor, mem_values: Tensor, rel_keys: Tensor, blocked: Tensor,
                r_w_bias: Tensor, r_r_bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`forward` for x (B, 1, d_model), in eval mode without autograd."""
        c = self.config
        B = x.shape[0]
        h = layer_norm(self.attn_norm, x) if c.pre_norm else x
        q, k, v = self.qkv_net.forward(h).view(B, 1, 3, c.n_head, c.d_head).unbind(dim=2)  # (B, 1, H, D)
        keys = extend_memory(mem_keys, k)  # (B, K, H, D) over a (B, H, capacity, D) buffer
        values = extend_memory(mem_values, v)
        scores = self._decode_scores(q, keys, rel_keys, r_w_bias, r_r_bias)  # (B, H, 1, K)
        probs = torch.softmax(scores.masked_fill_(blocked, float("-inf")), dim=-1)
        out = self.o_net.forward(self._decode_attend(probs, values).reshape(B, 1, -1))  # (B, 1, d_model)
        if c.pre_norm:
            x = x + out
            return x + self.ff.inference(layer_norm(self.ff_norm, x)), keys, values
        x = layer_norm(self.attn_norm, x + out)
        return layer_norm(self.ff_norm, x + self.ff.inference(x)), keys, values

    # Decoding one position per row. Scores and attended values are one batched product each,
    # over the memory as it lies in its buffer, where an einsum would copy it first: the query
    # and the probabilities multiply each head's contiguous (K, D) keys and values from the
    # left. On the machine of 2026-12-04 that orientation streamed the memory 1.7-2.8x faster
    # than (K, D) @ q and a (D, K) layout @ p at every shape measured (batch 2-16, 64-1,601
    # positions, 1 and 2 threads): a wt103-shaped batch-8 step went from 143 to 119 ms. An
    # earlier machine had favoured the other (docs/benchmarks.md, "The memory's layout").

    # The distances' part reads the layer's table W_kR R_d (K, H, D), kept head-major by
    # RelativeKeys, for one row as for a batch. Scoring ((q + v) W_kR) . R_d instead reads W_kR
    # (d_model, H, D) and the shared R but multiplies H x d_model x K: measured 2026-12-05 on a
    # wt103-shaped step it was the slower at every length (272, 1,024 and 1,601 distances: 3.7,
    # 8.7 and 11.6 ms a step against 0.7, 4.0 and 7.3 for the tables; a whole step with its
    # memory full 80.5 against 77.5 ms before the tables were head-major), so it was removed.

    def _decode_scores(self, q: Tensor, keys: Tensor, rel_keys: Tensor, r_w_bias: Tensor, r_r_bias: Tensor) -> Tensor:
        """`relative_scores` times the scale for one query per row, q (B, 1, H, D) -> (B, H, 1, K),
        in two products and no more passes over the scores than it takes. The one query sits
        after every key, key j at distance K - 1 - j, so the distances' scores are the table's
        read backwards: a flip, where `rel_shift` gathers by an index. The content part is added
        to them, both scaled, by the product itself (baddbmm). A step of 18 wt103-shaped layers
        took 1% less time this way than through gather, add and scale apart after 256 tokens,
        3.5% less with the memory full (1,600 positions), 2026-12-05: the same bits there, where
        the scale is 1/8; a scale that is not a power of two rounds differently (the test that
        decoding equals the full forward bounds it)."""
        B, _, H, D = q.shape
        K = keys.shape[1]
        qv = (q[:, 0] + r_r_bias).transpose(0, 1)  # (H, B, D)
        by_distance = torch.bmm(qv, rel_keys.transpose(0, 1).transpose(1, 2))  # (H, B, D) @ (H, D, K)
        by_key = by_distance.transpose(0, 1).flip(-1).reshape(B * H, 1, K)  # (B H, 1, K): key j's distance
        qu = (q[:, 0] + r_w_bias).reshape(B * H, 1, D)  # (B H, 1, D)
        keys_by_head = keys.permute(0, 2, 3, 1).reshape(B * H, D, K)  # a view of the buffer (B H, D, K)
        scores = torch.baddbmm(by_key, qu, keys_by_head, beta=self.scale, alpha=self.scale)  # (B H, 1, K)
        return scores.view(B, H, 1, K)

    @staticmethod
    def _decode_attend(probs: Tensor, values: Tensor) -> Tensor:
        """probs (B, H, 1, K), values (B, K, H, D) -> attended (B, 1, H, D)."""
        return (probs @ values.transpose(1, 2)).transpose(1, 2)  # (B, H, 1, K) @ (B, H, K, D)


class TransformerXL(LanguageModel):
    architecture = "transformer-xl"
    config_class = TransformerXLConfig
    state_class = XLMemory
    state_kind = "segment-recurrence"
    state_grows_with_context = False  # bounded by mem_len
    ragged_chunks = True  # forward(tokens, state, lengths): see the end of _layers

    @property
    def chunking_invariant(self) -> bool:
        # the module docstring's chunking semantics; without a memory (mem_len 0) every call is a
        # segment of its own, which sees nothing of the calls before it
        return self.config.same_length and self.config.mem_len > 0

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        self.config = config
        c = config
        if c.mem_len < 0:
            raise ValueError(f"mem_len must be 0 or more, got {c.mem_len}")
        if not c.adaptive and (c.cutoffs or c.tie_projs or c.div_val != 1 or c.d_embed not in (None, c.d_model)):
            raise ValueError("cutoffs, div_val, tie_projs and d_embed != d_model need adaptive=True")
        if c.adaptive:
            d_embed = c.d_embed or c.d_model
            self.embedding = AdaptiveEmbedding(c.vocab_size, d_embed, c.d_model, c.cutoffs, c.div_val)
        else:
            self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(RelativeAttentionLayer(c) for _ in range(c.n_layer))
        self.relative_keys = RelativeKeys(c.d_model, c.n_head, c.d_head, c.dropout, c.clamp_len)
        n_bias = c.n_layer if c.untie_r else 1
        self.r_w_bias = nn.Parameter(torch.zeros(n_bias, c.n_head, c.d_head))  # u
        self.r_r_bias = nn.Parameter(torch.zeros(n_bias, c.n_head, c.d_head))  # v
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon) if c.pre_norm and c.final_norm else None
        if c.adaptive:  # returns log-probabilities itself
            self.head = AdaptiveLogSoftmax(
                c.vocab_size, d_embed, c.d_model, c.cutoffs, c.div_val, self.embedding, c.tie_embedding, c.tie_projs
            )
        else:
            self.head = nn.Linear(c.d_model, c.vocab_size)
            if c.tie_embedding:
                self.head.weight = self.embedding.weight
        init_weights(self, [self.r_w_bias, self.r_r_bias])

    @property
    def max_context(self) -> int | None:
        return None  # any history; it sees the last mem_len positions of it

    def init_state(self, batch_size: int) -> XLMemory:
        c = self.config
        return XLMemory.empty(batch_size, c.n_layer, c.n_head, c.d_head, like=self.r_w_bias)

    def _fixed_state_dims(self, name: str, fresh: Tensor) -> range:
        return range(2, fresh.dim())  # memory length (dim 1) varies

    def _full_state_length(self, name: str) -> int | None:
        return self.config.mem_len  # a full memory holds the last mem_len positions

    def check_state(self, state: State, tokens: int | None = None) -> None:
        super().check_state(state, tokens)
        state.check_within(self.config.mem_len)

    def _check_tokens(self, state: XLMemory, tokens: int) -> None:
        """After t tokens the memory holds the last min(t, mem_len) positions (XLMemory.check_holds_last)."""
        state.check_holds_last(tokens, self.config.mem_len)

    def forward(self, tokens: Tensor, state: XLMemory, lengths: Tensor | None = None) -> tuple[Tensor, XLMemory]:
        """tokens (B, T) -> log-probs (B, T, V) and the memory after them. With `lengths` (B,),
        row b's chunk is tokens[b, :lengths[b]], right-padded: the padding comes after every
        real token, so causality already hides it from them, and only the memory kept needs
        care (each row's window ends at its own last token)."""
        if tokens.shape[1] == 0:  # nothing to read: nothing changes, as in every other architecture
            return tokens.new_zeros(tokens.shape[0], 0, self.vocab_size, dtype=torch.float32), state
        x, memory = self._layers(tokens, state, lengths)
        return self._log_probs(x), memory

    def forward_scored(self, tokens: Tensor, state: XLMemory,
                       lengths: Tensor | None = None) -> tuple[Tensor, Tensor, XLMemory]:
        """LanguageModel.forward_scored. With the adaptive softmax, whole rows only after each
        row's last token and every other position scored at its next token alone
        (AdaptiveLogSoftmax.log_prob_of): at wt103's shape the whole rows of a 128-token
        chunk are 137 MB and a third of its forward. It runs the layers itself, not through
        `forward`: whatever wraps or patches an adaptive model's forward must do the same here."""
        if not self.config.adaptive:
            return super().forward_scored(tokens, state, lengths)
        x, memory = self._layers(tokens, state, lengths)
        h = self._head_input(x)  # (B, T, d_model)
        B, T, d = h.shape
        next_rows = self.head(h[torch.arange(B, device=h.device), last_positions(tokens, lengths)])  # (B, V)
        scores = self.head.log_prob_of(h[:, :-1].reshape(-1, d), tokens[:, 1:].reshape(-1)).view(B, T - 1)
        return next_rows, scores, memory

    def _layers(self, tokens: Tensor, state: XLMemory, lengths: Tensor | None) -> tuple[Tensor, XLMemory]:
        """tokens (B, T) -> the top layer's output (B, T, d_model) and the memory after them."""
        c = self.config
        B, T = tokens.shape
        K = state.length + T
        distance, blocked, valid = self._visibility(tokens, state)
        _, rel_keys = self.relative_keys([layer.r_net for layer in self.layers], 0, K - 1, like=self.r_w_bias)
        x = self.drop(self.embedding(tokens) * math.sqrt(c.d_model))  # (B, T, d_model)
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            bias = i if c.untie_r else 0
            x, keys, values = layer(
                x, state.keys[i], state.values[i], rel_keys[i], distance, blocked,
                self.r_w_bias[bias], self.r_r_bias[bias],
            )
            new_keys.append(keys.detach())  # (B, K, H, D); trimmed to the memory below
            new_values.append(values.detach())
        keep = max(0, K - c.mem_len)  # first index of what stays in memory
        if lengths is not None and bool((lengths < T).any()):
            return x, self._ragged_memory(new_keys, new_values, valid, T - lengths.to(tokens.device), K - keep)
        return x, XLMemory(keys=[k[:, keep:] for k in new_keys], values=[v[:, keep:] for v in new_values],
                           valid=valid[:, keep:])

    def _visibility(self, tokens: Tensor, state: XLMemory) -> tuple[Tensor, Tensor, Tensor]:
        """For the chunk `tokens` (B, T) after `state`'s M positions: the distance (T, K) from
        query i (at absolute index M + i) to key j, clamped to >= 0; whether query i may not see
        key j, (B, 1, T, K), once for every layer; and which of the K = M + T positions are a
        row's own, (B, K)."""
        c = self.config
        B, T = tokens.shape
        M = state.length
        query_pos = torch.arange(M, M + T, device=tokens.device)[:, None]  # (T, 1)
        key_pos = torch.arange(M + T, device=tokens.device)[None, :]  # (1, K)
        distance = query_pos - key_pos  # (T, K)
        allowed = distance >= 0
        if c.same_length and c.mem_len > 0:
            allowed = allowed & (distance < c.mem_len)
        valid = torch.cat([state.valid, state.valid.new_ones(B, T)], dim=1)  # (B, K)
        allowed = allowed[None, None] & valid[:, None, None, :]  # (B, 1, T, K)
        return distance.clamp(min=0), ~allowed, valid

    def _head_input(self, x: Tensor) -> Tensor:
        """Top layer's output -> what the softmax reads (the final norm, dropout)."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.drop(x)

    def _log_probs(self, x: Tensor) -> Tensor:
        """Top layer's output (B, T, d_model) -> log-probabilities (B, T, V)."""
        x = self._head_input(x)
        if self.config.adaptive:
            return self.head(x)
        return F.log_softmax(self.head(x).float(), dim=-1)

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

    def step_bytes_beside_weights(self, positions: int) -> int:
        """A step reads each layer's table of relative keys for its K = memory + 1 distances
        (`_decode_scores`), not r_net, which only builds the tables (RelativeKeys)."""
        distances = min(positions, self.config.mem_len) + 1  # the memory and the new token
        return self.relative_keys.bytes_read_per_step([layer.r_net for layer in self.layers], distances, self.r_w_bias)

    def with_mem_len(self, mem_len: int) -> "TransformerXL":
        """A view of this model (same parameters) that keeps `mem_len` positions of memory."""
        view = copy.copy(self)
        view.config = dataclasses.replace(self.config, mem_len=mem_len)  # layers never read mem_len
        return view
