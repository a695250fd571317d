"""XLNet: a permutation language model with two-stream attention over Transformer-XL's memory.

Paper: Zhilin Yang, Zihang Dai, Yiming Yang, Jaime Carbonell, Ruslan Salakhutdinov, Quoc V. Le,
"XLNet: Generalized Autoregressive Pretraining for Language Understanding", NeurIPS 2019.

Two streams run through the same layers (same weights):
- the content stream h_i starts from the token embedding and attends to the positions before
  it in the factorisation order *and to itself*; it is what later positions read;
- the query stream g_i starts from a learned mask embedding w (`mask_emb`) and attends to the
  positions before i in the order, never to i itself, so it knows where it is (through the
  relative positions) but not what is there. The top layer's g_i predicts token i.
Attention is Transformer-XL's relative attention (models/layers/relative.py), score
(q_i + u).k_j + (q_i + v).W_r R_{i-j},
plus XLNet's segment term (q_i + b).s_ij, where s_ij is one of two learned vectors telling
whether i and j lie in the same segment (only meaningful for sentence pairs: for one text every
pair is "same", the term is a per-query constant and softmax removes it, so it is computed only
when segment ids are given). The keys and values of the previous segment's content stream are
kept as memory, visible to every query, gradient stopped.

Training (`training_loss`): permutation language modeling with partial prediction. Each sequence
of a batch gets its own uniformly random factorisation order z; attention masks come from the
order (content: rank(j) <= rank(i); query: rank(j) < rank(i)), and only the last 1/K of z
(`partial_prediction_k`) is predicted, so the query stream is computed for those positions only.
The memory carried to the next segment is this segment's content stream, computed under its order.

Serving (`forward`) uses the left-to-right order, one of the orders training covers. The content
stream of each new token is computed once (it sees the memory and the tokens before it) and
its keys and values per layer join the memory (`XLMemory`, the same value type as
Transformer-XL's, appended in place into head-major buffers by the same `extend_memory`,
models/layers/xl_memory.py and buffers.py). The
query stream of the position after each token predicts the next token from the memory and the
tokens up to it; one generated token is one incremental step. The top
layer's content stream is never read (nothing attends to it and it predicts nothing), so only
its keys and values are computed.

Chunking semantics (what `forward` promises about splitting a text into calls)
- `same_length=True` (our default): every content position sees itself and the mem_len - 1
  positions before it, and every prediction sees exactly the last mem_len positions, whatever the
  chunking: feeding a text in one call or in chunks of any size gives the same log-probabilities.
  Training applies the same window to both streams.
- `same_length=False` (the reference's semantics; converted checkpoints use it): within a call a
  content position sees the whole memory and every earlier position of its chunk; the prediction
  after position t sees the same keys as t's content stream plus t itself, except after the last
  position of a call, which sees only what the new memory keeps (the last mem_len positions),
  exactly as the reference's first prediction of its next segment does. A text of at most
  mem_len + 1 tokens gives the same result in any chunking; beyond that, longer chunks see
  further back, as in Transformer-XL with same_length=False.
- `mem_len=None`: the memory keeps everything (the reference's mem_len=None); every chunking
  agrees and the state grows with the context.

Imported checkpoints (models/convert/xlnet.py): Hugging Face's XLNetLMHeadModel maps onto this file
with same_length=False and its own mem_len, clamp_len, activation and layer-norm epsilon; its
output at position i under a left-to-right permutation mask and identity target mapping is our
output at position i - 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import LanguageModel, State, TransformerConfig
from xlserve.models.layers.buffers import extend_memory
from xlserve.models.layers.feedforward import ACTIVATIONS
from xlserve.models.layers.init import init_weights
from xlserve.models.layers.relative import RelativeKeys, layer_norm, rel_shift, relative_scores, scores_by_distance
from xlserve.models.layers.xl_memory import XLMemory


@dataclass
class XLNetConfig(TransformerConfig):
    """vocab_size, n_layer, d_model, n_head, d_head and d_inner: TransformerConfig's
    (models/interface.py); d_model is the width of both streams."""

    ff_activation: str = "gelu"  # gelu | gelu_new | relu | silu
    dropout: float = 0.0  # on embeddings, positional encodings, attention output and feed-forward
    dropatt: float = 0.0  # on attention probabilities
    mem_len: int | None = 128  # positions of content memory kept per layer; None = all
    same_length: bool = True  # every query sees exactly mem_len positions (see module docstring)
    clamp_len: int = -1  # |distances| beyond clamp_len share its encoding; -1 = no clamping
    layer_norm_epsilon: float = 1e-5
    tie_embedding: bool = True  # the softmax shares the input embedding matrix (plus its own bias)
    seg_len: int = 128  # training segment length (serving accepts any chunk length)
    partial_prediction_k: int = 6  # training predicts the last 1/K of each factorisation order


# -- the model -------------------------------------------------------------------------------------


class TwoStreamLayer(nn.Module):
    """One XLNet layer: relative attention (post-norm) + feed-forward, applied to whichever
    stream's queries it is given; keys and values always come from the content stream."""

    def __init__(self, config: XLNetConfig):
        super().__init__()
        c = config
        self.config = c
        inner = c.n_head * c.d_head
        self.q_net = nn.Linear(c.d_model, inner, bias=False)
        self.k_net = nn.Linear(c.d_model, inner, bias=False)
        self.v_net = nn.Linear(c.d_model, inner, bias=False)
        self.r_net = nn.Linear(c.d_model, inner, bias=False)  # W_r: relative encodings -> keys
        self.o_net = nn.Linear(inner, c.d_model, bias=False)
        self.r_w_bias = nn.Parameter(torch.zeros(c.n_head, c.d_head))  # u (content)
        self.r_r_bias = nn.Parameter(torch.zeros(c.n_head, c.d_head))  # v (position)
        self.r_s_bias = nn.Parameter(torch.zeros(c.n_head, c.d_head))  # b (segment)
        self.seg_embed = nn.Parameter(torch.zeros(2, c.n_head, c.d_head))  # s+ (same), s- (different)
        self.attn_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        # the feed-forward's two projections under the names of the reference's layer_1 and
        # layer_2, which checkpoints store them by (models/convert/xlnet.py)
        self.ff_in = nn.Linear(c.d_model, c.d_inner)
        self.ff_out = nn.Linear(c.d_inner, c.d_model)
        self.ff_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.activation = ACTIVATIONS[c.ff_activation]
        self.drop = nn.Dropout(c.dropout)
        self.dropatt = nn.Dropout(c.dropatt)
        self.scale = 1.0 / math.sqrt(c.d_head)

    def keys_values(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """Content stream (B, T, d) -> its keys and values (B, T, H, D)."""
        c = self.config
        B, T, _ = h.shape
        if self.training or torch.is_grad_enabled():
            k, v = self.k_net(h), self.v_net(h)
        else:  # serving: the products' own forward, without the module calls (`_serve`)
            k, v = self.k_net.forward(h), self.v_net.forward(h)
        return k.view(B, T, c.n_head, c.d_head), v.view(B, T, c.n_head, c.d_head)

    def forward(
        self,
        x: Tensor,  # (B, Q, d): queries of either stream
        keys: Tensor,  # (B, K, H, D): memory + content stream
        values: Tensor,  # (B, K, H, D)
        rel_keys: Tensor,  # (R, H, D): W_r R_d for the distances the index below refers to
        distance: Tensor,  # (B or 1, Q, K) int64 index into rel_keys
        allowed: Tensor,  # (B or 1, 1, Q, K) bool
        different_segment: Tensor | None,  # (B, Q, K) int64 (0 same, 1 different) or None
    ) -> Tensor:
        c = self.config
        B, Q, _ = x.shape
        if not self.training and not torch.is_grad_enabled():
            return self._serve(x, keys, values, rel_keys, distance, allowed, different_segment)
        q = self.q_net(x).view(B, Q, c.n_head, c.d_head)  # (B, Q, H, D)
        probs = self.dropatt(self._attention(q, keys, rel_keys, distance, allowed, different_segment))
        attended = torch.einsum("bhqk,bkhd->bqhd", probs, values).reshape(B, Q, -1)
        x = self.attn_norm(x + self.drop(self.o_net(attended)))
        inner = self.drop(self.activation(self.ff_in(x)))
        return self.ff_norm(x + self.drop(self.ff_out(inner)))

    def _serve(self, x: Tensor, keys: Tensor, values: Tensor, rel_keys: Tensor, distance: Tensor, allowed: Tensor,
               different_segment: Tensor | None) -> Tensor:
        """`forward` in eval mode without autograd, without module calls: each product through
        its module's own `forward` (F.linear, oneDNN's product for a batch, an int8 copy), the
        norms through F.layer_norm on their parameters, no dropout (the identity in eval mode),
        no hooks. A decoding step streams every weight once, and after each large product a module
        call costs many times what it does alone (models/transformer_xl.py
        `RelativeAttentionLayer._decode`): at xlnet-large's shape batch 1 decoded 11.66 tokens/s
        this way against 11.44 through the modules, faster in each of 8 rounds by 1-6%
        interleaved in one process, the same bits (2026-12-05, a slow hour of the machine)."""
        c = self.config
        B, Q, _ = x.shape
        q = self.q_net.forward(x).view(B, Q, c.n_head, c.d_head)  # (B, Q, H, D)
        probs = self._serve_attention(q, keys, rel_keys, distance, allowed, different_segment)  # (B, H, Q, K)
        attended = (probs @ values.transpose(1, 2)).transpose(1, 2).reshape(B, Q, -1)  # (B, H, K, D): the buffer
        x = layer_norm(self.attn_norm, x + self.o_net.forward(attended))
        return layer_norm(self.ff_norm, x + self.ff_out.forward(self.activation(self.ff_in.forward(x))))

    # Serving scores as Transformer-XL's decoding step does (models/transformer_xl.py
    # `_decode_scores`): batched products straight on the memory's head-major buffer ((B, H,
    # capacity, D), models/layers/buffers.py), the content part added to the distances' and both
    # scaled by the product itself (baddbmm), the mask filled in place. The einsums read the same
    # views without a copy but cost a dozen view operations each, and the scale and the mask each
    # a new tensor. The distances' part stays a gather by the index: an XLNet step has two query
    # rows a layer (the content stream and the query stream, one position apart), and any order
    # `permuted` serves must still work. At xlnet-large's shape with its memory full (512
    # positions), 16 rounds interleaved with the einsums in one process: batch 1 12.12 against
    # 11.96 tokens/s, batch 8 39.31 against 39.14, the same bits (2026-12-05); the einsums took
    # 8.3 ms of a 78 ms batch-1 step, the products 7.0.

    def _serve_attention(self, q: Tensor, keys: Tensor, rel_keys: Tensor, distance: Tensor, allowed: Tensor,
                         different_segment: Tensor | None) -> Tensor:
        """`_attention` without autograd: queries q (B, Q, H, D) -> probabilities (B, H, Q, K),
        the scale applied by the content product itself (baddbmm)."""
        B, Q, H, D = q.shape
        K = keys.shape[1]
        qv = (q + self.r_r_bias).permute(2, 0, 1, 3).reshape(H, B * Q, D)
        by_distance = torch.bmm(qv, rel_keys.permute(1, 2, 0))  # (H, B Q, D) @ (H, D, R) -> (H, B Q, R)
        by_distance = by_distance.view(H, B, Q, -1).transpose(0, 1)  # (B, H, Q, R)
        position = rel_shift(by_distance, distance[:, None]).reshape(B * H, Q, K)  # (B H, Q, K) by key
        qu = (q + self.r_w_bias).transpose(1, 2).reshape(B * H, Q, D)  # (B H, Q, D)
        keys_by_head = keys.permute(0, 2, 3, 1).reshape(B * H, D, K)  # a view of the buffer (B H, D, K)
        scores = torch.baddbmm(position, qu, keys_by_head, beta=self.scale, alpha=self.scale).view(B, H, Q, K)
        if different_segment is not None:
            scores = scores + self._segment_scores(q, different_segment) * self.scale
        return torch.softmax(scores.masked_fill_(~allowed, torch.finfo(scores.dtype).min), dim=-1)

    def _attention(self, q: Tensor, keys: Tensor, rel_keys: Tensor, distance: Tensor, allowed: Tensor,
                   different_segment: Tensor | None) -> Tensor:
        """The attention probabilities (B, H, Q, K) of queries q (B, Q, H, D), before dropout."""
        scores = relative_scores(q, keys, rel_keys, distance[:, None], self.r_w_bias, self.r_r_bias)  # (B, H, Q, K)
        if different_segment is not None:
            scores = scores + self._segment_scores(q, different_segment)
        scores = (scores * self.scale).masked_fill(~allowed, torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1)

    def _segment_scores(self, q: Tensor, different_segment: Tensor) -> Tensor:
        """(q_i + b) . s_ij, (B, H, Q, K): the position term's two steps with two "distances",
        same segment (s+) or not (s-)."""
        by_segment = scores_by_distance(q + self.r_s_bias, self.seg_embed)  # (B, H, Q, 2)
        return rel_shift(by_segment, different_segment[:, None])


class XLNet(LanguageModel):
    architecture = "xlnet"
    config_class = XLNetConfig
    state_class = XLMemory
    state_kind = "segment-recurrence"

    @property
    def chunking_invariant(self) -> bool:
        return self.config.same_length or self.config.mem_len is None  # the module docstring's chunking semantics

    def __init__(self, config: XLNetConfig):
        super().__init__()
        c = config
        self.config = c
        if c.ff_activation not in ACTIVATIONS:
            raise ValueError(f"ff_activation {c.ff_activation!r} is not one of {sorted(ACTIVATIONS)}")
        if c.mem_len is not None and c.mem_len < 1:
            raise ValueError("mem_len must be at least 1, or None for an unbounded memory")
        if c.same_length and c.mem_len is None:
            raise ValueError("same_length needs a mem_len")
        if c.partial_prediction_k < 1:
            raise ValueError("partial_prediction_k must be at least 1")
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.mask_emb = nn.Parameter(torch.zeros(c.d_model))  # w: the query stream's input
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(TwoStreamLayer(c) for _ in range(c.n_layer))
        self.relative_keys = RelativeKeys(c.d_model, c.n_head, c.d_head, c.dropout, c.clamp_len)
        self.head = nn.Linear(c.d_model, c.vocab_size)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        init_weights(self, [self.mask_emb, *(p for layer in self.layers
                                             for p in (layer.r_w_bias, layer.r_r_bias, layer.r_s_bias, layer.seg_embed))])

    @property
    def state_grows_with_context(self) -> bool:  # type: ignore[override]
        return self.config.mem_len is None

    @property
    def max_context(self) -> int | None:
        return None  # any history; it sees the last mem_len positions of it

    # -- state: Transformer-XL's memory, kept and checked as Transformer-XL keeps it ---------------

    # Copied from xlserve.models.transformer_xl.TransformerXL.init_state with r_w_bias->mask_emb
    def init_state(self, batch_size: int) -> XLMemory:
        c = self.config
        return XLMemory.empty(batch_size, c.n_layer, c.n_head, c.d_head, like=self.mask_emb)

    # Copied from xlserve.models.transformer_xl.TransformerXL._fixed_state_dims
    def _fixed_state_dims(self, name: str, fresh: Tensor) -> range:
        return range(2, fresh.dim())  # memory length (dim 1) varies

    def _full_state_length(self, name: str) -> int | None:
        return self.config.mem_len  # the last mem_len positions; None: the memory keeps everything

    # Copied from xlserve.models.transformer_xl.TransformerXL.check_state
    def check_state(self, state: State, tokens: int | None = None) -> None:
        super().check_state(state, tokens)
        state.check_within(self.config.mem_len)

    # Copied from xlserve.models.transformer_xl.TransformerXL._check_tokens
    def _check_tokens(self, state: XLMemory, tokens: int) -> None:
        """After t tokens the memory holds the last min(t, mem_len) positions (XLMemory.check_holds_last)."""
        state.check_holds_last(tokens, self.config.mem_len)

    # -- the two streams ----------------------------------------------------------------------

    def _two_stream(
        self,
        tokens: Tensor,  # (B, T) content tokens at absolute positions M .. M+T-1
        state: XLMemory,
        content_allowed: Tensor,  # (B or 1, T, K) bool
        query_positions: Tensor,  # (B or 1, P) absolute positions the query stream predicts
        query_allowed: Tensor,  # (B or 1, P, K) bool
        keep: int,  # first key index the new memory keeps
        different_segment: Tensor | None = None,  # (B, T + P, K) int64, or None
        left_to_right: bool = False,  # no query may see a later position: distances of masked pairs clamp to 0
    ) -> tuple[Tensor, XLMemory]:
        """Top-layer query stream (B, P, d) and the new memory."""
        B, T = tokens.shape
        K = state.length + T
        P = query_positions.shape[1]
        content_dist, query_dist = self._distances(state.length, T, query_positions, left_to_right)
        low = min(int(content_dist.min()), int(query_dist.min())) if K > 0 else 0
        high = max(int(content_dist.max()), int(query_dist.max())) if K > 0 else 0
        _, rel_keys = self.relative_keys([layer.r_net for layer in self.layers], low, high, like=self.mask_emb)

        valid = torch.cat([state.valid, state.valid.new_ones(B, T)], dim=1)[:, None, :]  # (B, 1, K)
        content_allowed = content_allowed & valid
        query_allowed = query_allowed & valid
        # below the top layer both streams go through a layer at once: content rows, then query rows
        both_dist = torch.cat([content_dist.expand(query_dist.shape[0], T, K), query_dist], dim=1) - low
        both_allowed = torch.cat([content_allowed.expand(B, T, K), query_allowed.expand(B, P, K)], dim=1)[:, None]
        q_dist, q_allowed = query_dist - low, query_allowed[:, None]
        q_segment = different_segment[:, T:] if different_segment is not None else None

        h = self.drop(self.embedding(tokens))  # (B, T, d)
        g = self.drop(self.mask_emb.expand(B, P, -1))  # (B, P, d)
        new_keys, new_values = [], []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            k, v = layer.keys_values(h)
            keys = extend_memory(state.keys[i], k)  # (B, K, H, D); in place when serving
            values = extend_memory(state.values[i], v)
            new_keys.append(keys[:, keep:].detach())
            new_values.append(values[:, keep:].detach())
            if i < last:
                out = layer(torch.cat([h, g], dim=1), keys, values, rel_keys[i], both_dist, both_allowed,
                            different_segment)
                h, g = out[:, :T], out[:, T:]
            else:  # nothing reads the top content stream
                g = layer(g, keys, values, rel_keys[i], q_dist, q_allowed, q_segment)
        return self.drop(g), XLMemory(keys=new_keys, values=new_values, valid=valid[:, 0, keep:])

    @staticmethod
    def _distances(M: int, T: int, query_positions: Tensor, left_to_right: bool) -> tuple[Tensor, Tensor]:
        """Distances i - j from each content position i (absolute M .. M+T-1) to each key j,
        (T, K), and from each query stream position, (B or 1, P, K). Left to right, no visible
        distance is negative, so the masked ones clamp to 0 and one table from 0 serves every call."""
        key_pos = torch.arange(M + T, device=query_positions.device)
        content_dist = torch.arange(M, M + T, device=query_positions.device)[:, None] - key_pos  # (T, K)
        query_dist = query_positions[..., None] - key_pos  # (B or 1, P, K)
        if left_to_right:
            return content_dist.clamp(min=0), query_dist.clamp(min=0)
        return content_dist, query_dist

    def _log_probs(self, g: Tensor) -> Tensor:
        return F.log_softmax(self.head(g).float(), dim=-1)

    # -- serving: the left-to-right order -----------------------------------------------------

    def step_bytes_beside_weights(self, positions: int) -> int:
        """A step reads each layer's table of relative keys for the distances from its query
        stream to the memory and the new token (memory + 2 rows, from 0: `_distances` left to
        right), not r_net, which only builds the tables (RelativeKeys)."""
        memory = positions if self.config.mem_len is None else min(positions, self.config.mem_len)
        return self.relative_keys.bytes_read_per_step([layer.r_net for layer in self.layers], memory + 2, self.mask_emb)

    def forward(self, tokens: Tensor, state: XLMemory) -> tuple[Tensor, XLMemory]:
        c = self.config
        B, T = tokens.shape
        if T == 0:
            return tokens.new_zeros(B, 0, self.vocab_size, dtype=torch.float32), state
        M = state.length
        K = M + T
        device = tokens.device
        key_pos = torch.arange(K, device=device)
        content_pos = torch.arange(M, K, device=device)
        content_allowed = key_pos[None, :] <= content_pos[:, None]  # (T, K): itself and before
        query_allowed = key_pos[None, :] < content_pos[:, None] + 1  # predicting position t+1: up to t
        keep = 0 if c.mem_len is None else max(0, K - c.mem_len)
        if c.same_length:
            content_allowed = content_allowed & (content_pos[:, None] - key_pos[None, :] < c.mem_len)
            query_allowed = query_allowed & (content_pos[:, None] + 1 - key_pos[None, :] <= c.mem_len)
        elif c.mem_len is not None:  # the prediction after the call sees what the new memory keeps
            query_allowed[-1] &= key_pos >= keep
        g, new_state = self._two_stream(
            tokens, state, content_allowed[None], (content_pos + 1)[None], query_allowed[None], keep,
            left_to_right=True,
        )
        return self._log_probs(g), new_state

    # -- any factorisation order (training, and parity with the reference) --------------------

    def permuted(
        self,
        tokens: Tensor,  # (B, T)
        state: XLMemory,
        order: Tensor,  # (B, T) a permutation of 0..T-1 per row
        n_predict: int,
        segment_ids: Tensor | None = None,  # (B, T) int64; memory counts as segment 0
    ) -> tuple[Tensor, Tensor, XLMemory]:
        """Log-probabilities (B, n_predict, V) of the tokens at the last n_predict positions of
        each order (returned as (B, n_predict) positions), each predicted by its query stream
        from the memory and the positions before it in the order; and the new memory."""
        c = self.config
        B, T = tokens.shape
        M = state.length
        K = M + T
        content, query, predicted = permutation_masks(order, n_predict)
        memory_visible = torch.ones(B, T, M, dtype=torch.bool, device=tokens.device)
        content_allowed = torch.cat([memory_visible, content], dim=2)  # (B, T, K)
        query_allowed = torch.cat([memory_visible, query], dim=2)
        query_allowed = query_allowed.gather(1, predicted[..., None].expand(B, n_predict, K))  # predicted rows
        query_positions = M + predicted
        if c.same_length:
            key_pos = torch.arange(K, device=tokens.device)
            content_pos = torch.arange(M, K, device=tokens.device)
            content_allowed = content_allowed & (content_pos[:, None] - key_pos < c.mem_len)
            query_allowed = query_allowed & (query_positions[..., None] - key_pos <= c.mem_len)
        keep = 0 if c.mem_len is None else max(0, K - c.mem_len)
        different = None
        if segment_ids is not None:
            key_segments = torch.cat([segment_ids.new_zeros(B, M), segment_ids], dim=1)  # (B, K)
            query_segments = torch.cat([segment_ids, segment_ids.gather(1, predicted)], dim=1)  # (B, T + P)
            different = (query_segments[:, :, None] != key_segments[:, None, :]).long()
        g, new_state = self._two_stream(tokens, state, content_allowed, query_positions, query_allowed, keep, different)
        return self._log_probs(g), predicted, new_state

    def training_loss(self, inputs: Tensor, targets: Tensor, state: XLMemory, fraction_done: float):
        """Permutation LM with partial prediction on the segment `inputs` (B, T): a random order
        per row, predict the tokens at the last ceil(T / K) steps of it. (`targets`, the next
        bytes, are not needed: XLNet predicts tokens of the segment itself; the byte after the
        segment is the first of the next one.)"""
        c = self.config
        if c.mem_len is None:
            raise ValueError("training needs a bounded mem_len")
        B, T = inputs.shape
        order = torch.argsort(torch.rand(B, T, device=inputs.device), dim=1)
        n_predict = max(1, math.ceil(T / c.partial_prediction_k))
        log_probs, predicted, new_state = self.permuted(inputs, state, order, n_predict)
        loss = -log_probs.gather(-1, inputs.gather(1, predicted)[..., None]).mean()
        return loss, new_state


def permutation_masks(order: Tensor, n_predict: int) -> tuple[Tensor, Tensor, Tensor]:
    """Masks of permutation language modeling for factorisation orders `order` (B, T) (order[b, k]
    = the position at step k).

    Returns content (B, T, T) with content[b, i, j] = position i's content stream may see
    position j (rank(j) <= rank(i)), query (B, T, T) with rank(j) < rank(i), and the predicted
    positions (B, n_predict): the last n_predict of each order, in order."""
    B, T = order.shape
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(T, device=order.device).expand(B, T))
    content = rank[:, None, :] <= rank[:, :, None]
    query = rank[:, None, :] < rank[:, :, None]
    return content, query, order[:, T - n_predict :]
