"""Adaptive attention span: a byte-level causal transformer in which every head learns how far
back it looks, and a served session keeps only that far.

Paper: Sainbayar Sukhbaatar, Edouard Grave, Piotr Bojanowski, Armand Joulin, "Adaptive Attention
Span in Transformers", ACL 2019.

Attention (section 3). Head h of layer l has a learned span z in [0, S] (S = `max_span`). With
s_tr the score of query t against key r and x = t - r their distance, the weights are

    a_tr = m_z(t - r) exp(s_tr) / sum_q m_z(t - q) exp(s_tq),     m_z(x) = clamp((R + z - x) / R, 0, 1)

(`soft_span_mask`): full weight up to distance z, a linear ramp of width R (`ramp`)
down to nothing at z + R, renormalised over what is left. z = S * p with p a parameter per head
(`AdaptiveSpanLayer.span_fraction`), kept in [0, 1] as the authors' code does (clamped before
every training step, `training_loss`). Training adds the L1 penalty (lambda / M) sum_i z_i over
the M heads of all layers (`span_penalty` = lambda), which shrinks spans a head does not need.

Positions enter only through distances: the score is Transformer-XL's relative score
(models/layers/relative.py), (q_t + u) . k_r + (q_t + v) . W_kR R_{t-r}, with u, v per layer.
The authors' released code scores distances with a learned embedding per distance instead; both
depend on the distance only, which is what lets a head keep nothing beyond its span. Like the
paper (which uses a Transformer-XL-style cache) the model carries the keys and values of past
positions from one call to the next, gradient stopped.

State (`SpanMemory`). A query reaches ceil(z) + R positions, itself
included, so the next query can still reach the last n = ceil(z) + R - 1 positions of each head:
a served session keeps, per layer and head, exactly those keys and values (fewer until it has
seen n tokens). Heads with short spans keep little; the bytes are
8 * d_head * sum_(l,h) n_lh + 8 once full (float32; `SpanMemory` gives the layout and formula),
bounded by the maximum span whatever the history. `spans_report()` gives the learned z and n of
every head (for the model card). In training mode every head of a layer keeps what the layer's
longest current span reaches plus a margin of 16 positions (z moves by less than 2 positions a
step with the standard recipe), capped at S + R - 1: the authors' code trims its cache to the
current spans in the same way, and while spans are short it saves most of the attention.

Chunking semantics: the mask, the relative score and the causal rule depend on the distance
between query and key only, and the state keeps every position any later query can reach (each
head its whole span + ramp, at every layer). So a text fed in one call, token by token, or in
chunks of any size (7, 64, ...) gives the same log-probabilities, to float tolerance, from the
same starting state: what a query sees never depends on where its chunk began. This holds
because the kept memory covers each head's span + ramp (in training mode, the layer's longest
span + ramp + the margin); a state that kept less would break it, and `check_state` refuses one.

Decoding one token costs, per layer, attention of every head over the layer's longest head
memory (the heads' memories are padded to it side by side for one batched product, the padding
masked), plus copying each head's kept positions into the next state: O(n_head * max_h n_lh *
d_head) per layer, bounded by the span; nothing is recomputed. (The served bytes follow each
head's own span; the compute follows the layer's longest.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import LanguageModel, State, TransformerConfig
from xlserve.models.layers.buffers import left_pad
from xlserve.models.layers.init import init_weights
from xlserve.models.layers.relative import RelativeAttentionBlock, RelativeKeys, relative_scores


@dataclass
class AdaptiveSpanConfig(TransformerConfig):
    """vocab_size, n_layer, d_model, n_head, d_head and d_inner: TransformerConfig's (models/interface.py)."""

    max_span: int = 512  # S: the longest span z a head may learn
    ramp: int = 32  # R: width of the soft mask's ramp, in positions
    span_init: float = 0.0  # z / S of every head at initialisation (the authors' code starts at 0)
    span_penalty: float = 2e-6  # lambda: weight of the mean span in the training loss (paper, enwik8)
    dropout: float = 0.0  # on embeddings, attention output and feed-forward
    dropatt: float = 0.0  # on attention weights
    pre_norm: bool = True  # layer norm before each sub-layer (+ one after the last layer); False = post-norm
    layer_norm_epsilon: float = 1e-5
    tie_embedding: bool = True  # the output softmax shares the input embedding matrix


# -- the state between calls -----------------------------------------------------------------------


@dataclass
class SpanMemory(State):
    """Per layer and head, the projected keys and values of the last positions that head can
    still reach: a head with learned span z reaches ceil(z) + R - 1 positions before its query
    (`kept_positions_for`), so a head with a short span keeps little.

    Layout (every tensor batch-first):
    - keys[l * n_head + h], values[l * n_head + h]: (B, m, D), head h of layer l; m = min(n_lh, M)
      where n_lh = ceil(z_lh) + R - 1 is what the head keeps once its memory is full and M is the
      longest head memory of the state (M = min(tokens seen, max n_lh) for one session). Positions
      run oldest to newest; the last one is the last token seen.
    - position: (B,) int64, tokens each row has seen. In a batch, rows that have seen fewer
      positions than a head tensor holds are left-padded with zeros: row b's own positions in a
      tensor of length m are its last min(position_b, m).

    Bytes for one session after t tokens, float32, D = d_head:
        8 * D * sum over (l, h) of min(n_lh, t)  +  8      (keys and values, 4 bytes each; `position`)
    and once t >= max n_lh: 8 * D * sum n_lh + 8, against 8 * D * n_layer * n_head * (S + R - 1) + 8
    for a state that kept the maximum span S for every head.

    Heads of different spans batch together because each head is its own tensor; rows of
    different histories batch together by left padding (`concat`), masked by `position`.
    """

    keys: list[Tensor]  # n_layer * n_head tensors (B, m, D), index l * n_head + h
    values: list[Tensor]  # the same shapes as keys
    # a commit slides each head's window by the new positions (State.delta_from)
    delta_axes = {"keys": 1, "values": 1}
    position: Tensor  # (B,) int64: tokens seen per row (the position of the next one)

    @property
    def length(self) -> int:
        """M: the longest head memory (positions) in this state."""
        return max((k.shape[1] for k in self.keys), default=0)

    @classmethod
    def empty(cls, batch_size: int, n_heads_total: int, d_head: int, like: Tensor) -> "SpanMemory":
        return cls(
            keys=[like.new_zeros(batch_size, 0, d_head) for _ in range(n_heads_total)],
            values=[like.new_zeros(batch_size, 0, d_head) for _ in range(n_heads_total)],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    def check_consistent(self) -> None:
        """State.check_consistent: keys and values for the same heads, of the same shapes, and a
        non-negative token count per row."""
        if len(self.keys) != len(self.values):
            raise ValueError(f"state has keys for {len(self.keys)} heads and values for {len(self.values)}")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k.shape != v.shape:
                raise ValueError(f"state tensors 'keys.{i}' {tuple(k.shape)} and 'values.{i}' {tuple(v.shape)} "
                                 f"differ in shape")
        if self.position.dim() != 1:
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, expected (batch,)")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' holds a negative token count")

    @classmethod
    def concat(cls, states: list["SpanMemory"]) -> "SpanMemory":
        """Rows of every state; each head's tensors left-padded with zeros to the longest among
        the states (the padding lies before each row's own positions, and `position` masks it)."""
        n = len(states[0].keys)

        def stack(which: str, i: int) -> Tensor:
            parts = [getattr(s, which)[i] for s in states]
            longest = max(p.shape[1] for p in parts)
            return torch.cat([left_pad(p, longest, 0) for p in parts])

        return cls(keys=[stack("keys", i) for i in range(n)], values=[stack("values", i) for i in range(n)],
                   position=torch.cat([s.position for s in states]))

    def split(self) -> list["SpanMemory"]:
        """One state per row, each head tensor trimmed to the row's own positions (what the row
        would hold alone)."""
        rows = []
        for b in range(self.batch_size):
            own = int(self.position[b])
            cut = lambda t: t[b : b + 1, t.shape[1] - min(own, t.shape[1]) :]  # noqa: E731
            rows.append(SpanMemory(keys=[cut(k) for k in self.keys], values=[cut(v) for v in self.values],
                                   position=self.position[b : b + 1]))
        return rows


# -- the soft span mask ----------------------------------------------------------------------------
# A head with span z weights the key at distance x back from its query by
#
#     m_z(x) = clamp((R + z - x) / R, 0, 1)
#
# 1 up to distance z, then a linear ramp of width R down to 0 at distance z + R (the paper's
# section 3.1); the attention weights are renormalised over what the mask leaves (`span_log_mask`
# gives log m_z, added to the scores before the softmax: exp(s + log m) = m exp(s), so the softmax
# is that renormalisation).


def soft_span_mask(distance: Tensor, spans: Tensor, ramp: int) -> Tensor:
    """m_z(x) for every head: distances x (T, K) (any integer or float tensor), spans z (H,) ->
    (H, T, K) float32 in [0, 1]. Computed in float32 whatever the model's dtype, so the
    positions a head reaches are those `reachable_positions` counts."""
    x = distance.to(torch.float32)[None]  # (1, T, K)
    z = spans.to(torch.float32)[:, None, None]  # (H, 1, 1)
    return ((ramp + z - x) / ramp).clamp(0.0, 1.0)


def span_log_mask(distance: Tensor, spans: Tensor, ramp: int) -> Tensor:
    """log m_z(x), (H, T, K): -inf where the mask is 0. Differentiable in z where m > 0; where
    m = 0 the gradient is 0, not the NaN of log(0)'s infinite slope times clamp's zero slope."""
    mask = soft_span_mask(distance, spans, ramp)
    inside = mask > 0
    return torch.where(inside, mask.clamp(min=torch.finfo(mask.dtype).tiny).log(), float("-inf"))


def reachable_positions(span: float, ramp: int) -> int:
    """How many positions a query with span z gives a weight above 0, itself included:
    distances x = 0 .. ceil(z) + R - 1, i.e. ceil(z) + R of them (x < R + z)."""
    return math.ceil(span) + ramp


def kept_positions_for(span: float, ramp: int) -> int:
    """Positions of a head's past that the next query can still reach: `reachable_positions`
    less the query itself, ceil(z) + R - 1. What a served state keeps per head."""
    return reachable_positions(span, ramp) - 1


# -- the model -------------------------------------------------------------------------------------


class AdaptiveSpanLayer(RelativeAttentionBlock):
    """Relative multi-head attention with a learned soft span per head, and a feed-forward: the
    parameters and residual wiring of a Transformer-XL layer (`RelativeAttentionBlock`,
    models/layers/relative.py) plus a span per head."""

    config: AdaptiveSpanConfig

    def __init__(self, config: AdaptiveSpanConfig):
        super().__init__(config)
        c = config
        # p per head, z = max_span * clamp(p, 0, 1); one-dimensional, so no weight decay (train.py)
        self.span_fraction = nn.Parameter(torch.full((c.n_head,), float(c.span_init)))

    def spans(self) -> Tensor:
        """z per head, (H,), in positions."""
        return self.config.max_span * self.span_fraction.clamp(0.0, 1.0)

    def attention_weights(self, q: Tensor, keys: Tensor, rel_keys: Tensor, distance: Tensor, visible: Tensor,
                          u: Tensor, v: Tensor) -> Tensor:
        """a_tr = m_z(t - r) exp(s_tr) / sum_q m_z(t - q) exp(s_tq) over the keys a query may see
        (causal and `visible`), 0 elsewhere: queries q (B, T, H, D), keys (B, K, H, D), distance
        (T, K) query minus key position, visible (B, H, K) -> (B, H, T, K)."""
        scores = relative_scores(q, keys, rel_keys, distance.clamp(min=0), u, v) * self.scale  # (B, H, T, K)
        log_mask = span_log_mask(distance.clamp(min=0), self.spans(), self.config.ramp)  # (H, T, K): log m_z(x)
        scores = scores + log_mask.to(scores.dtype)[None]  # exp(s + log m) = m exp(s): softmax renormalises
        allowed = visible[:, :, None, :] & (distance >= 0)[None, None]  # (B, H, T, K)
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)

    def forward(
        self,
        x: Tensor,  # (B, T, d_model)
        memory_keys: list[Tensor],  # per head (B, m_h, D): the last m_h positions before x
        memory_values: list[Tensor],
        seen: Tensor,  # (B,) int64: positions each row has seen before x
        rel_keys: Tensor,  # (>= M + T, H, D): W_kR R_d for distances d = 0, 1, ...
        u: Tensor,  # (H, D)
        v: Tensor,  # (H, D)
        keep: list[int],  # per head: positions to keep for the next call
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """The layer's output (B, T, d_model) and, per head, the keys and values (B, m'_h, D) of
        the last m'_h = min(keep_h, m_h + T, max seen + T) positions."""
        c = self.config
        B, T, _ = x.shape
        lengths = [k.shape[1] for k in memory_keys]  # m_h
        M = max(lengths)
        K = M + T
        h = self.attn_norm(x) if c.pre_norm else x
        q, k, v_new = self.qkv_net(h).view(B, T, 3, c.n_head, c.d_head).unbind(dim=2)  # (B, T, H, D)
        # heads' memories of different lengths side by side: each left-padded to M (masked below)
        past_keys = torch.stack([left_pad(m, M, 0) for m in memory_keys], dim=2)  # (B, M, H, D)
        past_values = torch.stack([left_pad(m, M, 0) for m in memory_values], dim=2)
        keys = torch.cat([past_keys, k], dim=1)  # (B, K, H, D)
        values = torch.cat([past_values, v_new], dim=1)

        # which keys each (row, head) may see: its own positions of the head's memory, and the chunk
        index = torch.arange(K, device=x.device)
        own_memory = torch.minimum(seen[:, None], torch.tensor(lengths, device=x.device)[None, :])  # (B, H)
        visible = index[None, None, :] >= (M - own_memory)[:, :, None]  # (B, H, K)
        distance = (M + torch.arange(T, device=x.device))[:, None] - index[None, :]  # (T, K): query M + t, key j
        probs = self.dropatt(self.attention_weights(q, keys, rel_keys, distance, visible, u, v))  # (B, H, T, K)
        attended = torch.einsum("bhtk,bkhd->bthd", probs, values)  # (B, T, H, D)
        out = self.drop(self.o_net(attended.reshape(B, T, -1)))
        x = self.add_attention_and_feed_forward(x, out)

        longest_row = int(seen.max()) + T if B > 0 else T
        kept_keys, kept_values = [], []
        for head, (m, n) in enumerate(zip(lengths, keep)):
            count = min(n, m + T, longest_row)
            kept_keys.append(keys[:, K - count :, head].detach().contiguous())  # (B, count, D)
            kept_values.append(values[:, K - count :, head].detach().contiguous())
        return x, kept_keys, kept_values


class AdaptiveSpan(LanguageModel):
    architecture = "adaptive-span"
    config_class = AdaptiveSpanConfig
    state_class = SpanMemory
    state_kind = "window"  # per-head windows of keys and values
    state_grows_with_context = False  # at most ceil(z) + R - 1 positions per head
    TRAINING_SPAN_MARGIN = 16  # positions kept in training beyond the layer's longest current span
    chunking_invariant = True  # the module docstring's chunking semantics

    def __init__(self, config: AdaptiveSpanConfig):
        super().__init__()
        c = config
        self.config = c
        if c.ramp < 1 or c.max_span < 0:
            raise ValueError("ramp must be at least 1 and max_span at least 0")
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(AdaptiveSpanLayer(c) for _ in range(c.n_layer))
        self.relative_keys = RelativeKeys(c.d_model, c.n_head, c.d_head, c.dropout)
        self.r_w_bias = nn.Parameter(torch.zeros(c.n_layer, c.n_head, c.d_head))  # u per layer
        self.r_r_bias = nn.Parameter(torch.zeros(c.n_layer, c.n_head, c.d_head))  # v per layer
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon) if c.pre_norm else None
        self.head = nn.Linear(c.d_model, c.vocab_size)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        init_weights(self, [self.r_w_bias, self.r_r_bias])

    # -- spans ----------------------------------------------------------------------------------

    def spans(self) -> Tensor:
        """The learned spans z, (n_layer, n_head), in positions."""
        return torch.stack([layer.spans() for layer in self.layers])

    def kept_positions(self) -> list[list[int]]:
        """Per layer and head, the positions a served state keeps: ceil(z) + R - 1."""
        return [[kept_positions_for(z, self.config.ramp) for z in row] for row in self.spans().tolist()]

    def spans_report(self) -> list[dict]:
        """For the model card: per layer, each head's learned span z, the positions it keeps
        and the fraction of the maximum (S + R - 1) that is."""
        c = self.config
        full = c.max_span + c.ramp - 1
        report = []
        for l, (spans, kept) in enumerate(zip(self.spans().tolist(), self.kept_positions())):
            report.append({"layer": l, "spans": [round(z, 2) for z in spans], "kept_positions": kept,
                           "kept_fraction": [round(n / full, 4) for n in kept]})
        return report

    def state_bytes_when_full(self) -> int:
        """Bytes of one session's state once it has seen at least max kept positions (float32
        weights: 4 bytes per number): keys and values of every head's kept positions + `position`."""
        element = self.r_w_bias.element_size()
        return 2 * element * self.config.d_head * sum(map(sum, self.kept_positions())) + 8

    @property
    def max_context(self) -> int | None:
        return None  # any history; each head sees its own span of it

    # -- state ----------------------------------------------------------------------------------

    def init_state(self, batch_size: int) -> SpanMemory:
        c = self.config
        return SpanMemory.empty(batch_size, c.n_layer * c.n_head, c.d_head, like=self.r_w_bias)

    def _fixed_state_dims(self, name: str, fresh: Tensor) -> range:
        return range(2, fresh.dim())  # a head's memory length (dim 1) varies

    def _full_state_length(self, name: str) -> int | None:
        """keys.i and values.i (i = l * n_head + h): the ceil(z) + R - 1 positions head h of
        layer l keeps."""
        kept = [n for row in self.kept_positions() for n in row]
        return kept[int(name.split(".")[1])]

    def check_state(self, state: State, tokens: int | None = None) -> None:
        """LanguageModel.check_state, and: every head holds min(n, M) positions, n what it keeps
        (ceil(z) + R - 1), M the longest, and no more positions than the rows have seen."""
        super().check_state(state, tokens)
        M = state.length
        kept = [n for row in self.kept_positions() for n in row]
        for i, (keys, n) in enumerate(zip(state.keys, kept)):
            if keys.shape[1] != min(n, M):
                raise ValueError(f"state tensor 'keys.{i}' holds {keys.shape[1]} positions; head {i} keeps "
                                 f"min({n}, {M}) = {min(n, M)}")
        if state.batch_size and M > int(state.position.max()):
            raise ValueError(f"state holds {M} positions but tensor 'position' says at most "
                             f"{int(state.position.max())} tokens were seen")

    def _check_tokens(self, state: SpanMemory, tokens: int) -> None:
        """After t tokens the longest head memory holds min(t, max n) positions."""
        expected = min(tokens, max(n for row in self.kept_positions() for n in row))
        if state.length != expected:
            raise ValueError(f"state holds {state.length} positions; after {tokens} tokens it holds {expected}")

    # -- the network ----------------------------------------------------------------------------

    def forward(self, tokens: Tensor, state: SpanMemory) -> tuple[Tensor, SpanMemory]:
        c = self.config
        B, T = tokens.shape
        if T == 0:
            return tokens.new_zeros(B, 0, self.vocab_size, dtype=torch.float32), state
        H = c.n_head
        if self.training:
            # z moves at every step, by at most about max_span · learning rate (< 2 positions
            # with the standard recipe): keep what the layer's longest span reaches now plus a
            # margin of TRAINING_SPAN_MARGIN, never more than the maximum span could. Keeping the
            # maximum for every head would score ~4x more keys while the spans are short.
            keep = []
            for layer in self.layers:
                reach = kept_positions_for(float(layer.spans().detach().max()), c.ramp) + self.TRAINING_SPAN_MARGIN
                keep.append([min(reach, c.max_span + c.ramp - 1)] * H)
        else:
            keep = self.kept_positions()
        _, rel_keys = self.relative_keys([layer.r_net for layer in self.layers], 0, state.length + T - 1,
                                         like=self.r_w_bias)
        x = self.drop(self.embedding(tokens) * math.sqrt(c.d_model))  # (B, T, d_model)
        new_keys, new_values = [], []
        for l, layer in enumerate(self.layers):
            heads = slice(l * H, (l + 1) * H)
            x, keys, values = layer(x, state.keys[heads], state.values[heads], state.position, rel_keys[l],
                                    self.r_w_bias[l], self.r_r_bias[l], keep[l])
            new_keys.extend(keys)
            new_values.extend(values)
        if self.final_norm is not None:
            x = self.final_norm(x)
        log_probs = F.log_softmax(self.head(self.drop(x)).float(), dim=-1)  # (B, T, V)
        return log_probs, SpanMemory(keys=new_keys, values=new_values, position=state.position + T)

    # -- training -------------------------------------------------------------------------------

    def training_loss(self, inputs: Tensor, targets: Tensor, state: SpanMemory, fraction_done: float):
        """Mean next-byte negative log-likelihood + lambda * the mean span over all heads (the
        paper's L1 penalty, (lambda / M) sum_i z_i). Each p is first clamped to [0, 1], as the
        authors' code does after every update: a p pushed past 0 by the penalty would otherwise
        sit where clamp(p, 0, 1) has no gradient and never grow again."""
        with torch.no_grad():
            for layer in self.layers:
                layer.span_fraction.clamp_(0.0, 1.0)
        log_probs, state = self(inputs, state)
        nll = -log_probs.gather(-1, targets[..., None]).mean()
        return nll + self.config.span_penalty * self.spans().mean(), state
