"""Relative positional attention, the score of Transformer-XL that XLNet and the ∞-former reuse.

Paper: Zihang Dai et al., "Transformer-XL: Attentive Language Models Beyond a Fixed-Length
Context", ACL 2019, section 3.3. With content keys k_j = W_kE h_j, R the sinusoid encoding of
a distance and W_kR its own projection, the score of query i against key j is

    (a) + (c) = (q_i + u) . k_j               content: what is at j
    (b) + (d) = (q_i + v) . W_kR R_{i-j}      position: how far back j is

with u, v learned vectors shared by all positions (`r_w_bias`, `r_r_bias` in the reference
code). Nothing depends on absolute positions, which is what lets a memory of earlier positions
be reused as is.

The position term is computed as the paper suggests: every query is scored once against every
distance (`scores_by_distance`), and each (i, j) then picks the score of its distance i - j
(`rel_shift`; the reference code shifts a padded matrix, a gather reads the same entries).
The table W_kR R_d depends on the weights only, so in eval mode `RelativeKeys` keeps it for
every request. `RelativeAttentionBlock` holds the parameters of a Transformer-XL layer, which
adaptive span's layer shares.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.layers.feedforward import FeedForward


def sinusoid_encoding(distances: Tensor, d_model: int) -> Tensor:
    """distances (K,) -> (K, d_model): [sin(d * w_i) ..., cos(d * w_i) ...] as in the paper."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, dtype=torch.float32, device=distances.device) / d_model))
    angles = distances.float()[:, None] * inv_freq[None, :]  # (K, d_model / 2)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def relative_scores(q: Tensor, k: Tensor, rel_keys: Tensor, distance: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """(a) + (b) + (c) + (d), unscaled: queries q (B, T, H, D), keys k (B, K, H, D), W_kR R_r
    for R distances as rel_keys (R, H, D), `distance` (T, K) or (B or 1, 1, T, K) the index into
    rel_keys of each (query, key) pair, u and v (H, D) -> scores (B, H, T, K)."""
    content = torch.einsum("bthd,bkhd->bhtk", q + u, k)  # (B, H, T, K)
    position = rel_shift(scores_by_distance(q + v, rel_keys), distance)  # (B, H, T, K)
    return content + position


def scores_by_distance(q: Tensor, rel_keys: Tensor) -> Tensor:
    """Every query (B, T, H, D) against every distance's key (R, H, D) -> (B, H, T, R)."""
    return torch.einsum("bthd,rhd->bhtr", q, rel_keys)


def rel_shift(by_distance: Tensor, distance: Tensor) -> Tensor:
    """(B, H, T, R) scores per distance -> (B, H, T, K) scores per key: pair (i, j) takes the
    score of its distance index distance[..., i, j] ((T, K) or (B or 1, 1, T, K))."""
    B, H, T, _ = by_distance.shape
    return torch.gather(by_distance, 3, distance.expand(B, H, T, distance.shape[-1]))


def layer_norm(norm: nn.LayerNorm, x: Tensor) -> Tensor:
    """norm(x) without the module call, for the decoding steps of Transformer-XL's and XLNet's
    layers: after a large product a module call and an nn.Module.__getattr__ cost many times what
    they do alone (models/transformer_xl.py `RelativeAttentionLayer._decode`)."""
    parameters = norm._parameters  # not norm.weight, which goes through nn.Module.__getattr__
    return F.layer_norm(x, norm.normalized_shape, parameters["weight"], parameters["bias"], norm.eps)


# kept relative-key tables past this many bytes that no call has needed a quarter of for
# SHRINK_AFTER_SECONDS are rebuilt at the length calls now ask for (RelativeKeys.forward): a model
# whose memory is not bounded (XLNet converted with mem_len null) asks for as many distances as
# its longest history, and kept them, about 40 KB a distance at xlnet-base's shape (2.6 GB after
# one 60k-token document), for the life of the process. Not less: transfo-xl-wt103's kept tables
# are 300 MB (4,096 distances of 18 layers), which every step of a full memory reads, and
# rebuilding them costs about a second of a CPU
KEPT_BYTES_BEFORE_SHRINK = 1 << 30
SHRINK_AFTER_SECONDS = 60.0


class RelativeKeys(nn.Module):
    """Per layer, the relative keys W_kR R_d for the distances d = low .. high.

    In eval mode without autograd the tables for d = 0, 1, ... are kept and sliced for every
    later request; they are computed for at least `min_length` distances and at least twice the
    length kept before, so a growing context recomputes them rarely. Tables of more than
    KEPT_BYTES_BEFORE_SHRINK that no call needed a quarter of for SHRINK_AFTER_SECONDS are
    rebuilt smaller, so one long history does not hold their memory for good. The tables depend on the
    weights only: switching between train and eval mode and loading weights drop them. No
    parameters of its own (the projections W_kR belong to the layers and are passed in).

    A kept table is an (R, H, D) view of head-major storage, each head's (R, D) distances
    contiguous: a decoding step multiplies each head's query by them, which then streams whole
    rows (the same numbers; on the machine of 2026-12-05 the 18 tables of a wt103-shaped step at
    1,601 distances took 7.3 instead of 9.4 ms for one row, 13.1 instead of 17.5 for eight).
    """

    def __init__(self, d_model: int, n_head: int, d_head: int, dropout: float, clamp_len: int = -1,
                 min_length: int = 512):
        super().__init__()
        self.d_model, self.n_head, self.d_head = d_model, n_head, d_head
        self.clamp_len = clamp_len  # |distances| beyond clamp_len share its encoding; <= 0: no clamping
        self.min_length = min_length
        self.drop = nn.Dropout(dropout)  # on the encodings R, as in the reference code
        self._kept: tuple[int, torch.dtype, torch.device, Tensor, list[Tensor]] | None = None
        self._kept_bytes = 0
        self._long_asked_at = 0.0  # time.monotonic() of the last call that needed a quarter of the kept length

    def forget_tables(self) -> None:
        """Drop the kept tables: built from the projections as they were, they are stale once a
        projection is replaced (quantized: models/quantize.py)."""
        self._kept = None

    def forward(self, projections: Sequence[nn.Module], low: int, high: int, like: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The encodings R_d as (high - low + 1, d_model) and per projection W_kR R_d as
        (high - low + 1, H, D), in the dtype and on the device of `like`."""
        dtype, device = like.dtype, like.device
        cacheable = low == 0 and not self.training and not torch.is_grad_enabled()
        asked = high
        if cacheable:
            if self._kept is not None:
                length, kept_dtype, kept_device, encoding, tables = self._kept
                if length > high and kept_dtype == dtype and kept_device == device:
                    now = time.monotonic()
                    if 4 * (high + 1) > length:
                        self._long_asked_at = now
                    if (self._kept_bytes <= KEPT_BYTES_BEFORE_SHRINK
                            or now - self._long_asked_at <= SHRINK_AFTER_SECONDS):
                        return encoding[: high + 1], [t[: high + 1] for t in tables]
                    self._kept = None  # long unneeded: rebuilt below at what calls ask for now
            high = max(high + 1, self.min_length, 2 * (self._kept[0] if self._kept else 0)) - 1
        distances = torch.arange(low, high + 1, device=device)
        if self.clamp_len > 0:
            distances = distances.clamp(-self.clamp_len, self.clamp_len)
        encoding = self.drop(sinusoid_encoding(distances, self.d_model).to(device=device, dtype=dtype))
        tables = [w_kr(encoding).view(-1, self.n_head, self.d_head) for w_kr in projections]  # (R, H, D)
        if cacheable:  # kept head-major (the class docstring), read as the same (R, H, D)
            tables = [table.transpose(0, 1).contiguous().transpose(0, 1) for table in tables]
            self._kept = (high + 1, dtype, device, encoding, tables)
            self._kept_bytes = sum(t.numel() * t.element_size() for t in (encoding, *tables))
            self._long_asked_at = time.monotonic()
            # the distances asked for, as a later call gets them (a step reads every row it is given)
            return encoding[: asked + 1], [t[: asked + 1] for t in tables]
        return encoding, tables

    def bytes_read_per_step(self, projections: Sequence[nn.Module], distances: int, like: Tensor) -> int:
        """What a decoding step reads through the kept tables besides the weights: `distances`
        rows of each projection's table, less the projections' own weights, which no step reads
        (they only build the tables). The benches' bandwidth measure
        (`LanguageModel.step_bytes_beside_weights`)."""
        tables = len(projections) * distances * self.n_head * self.d_head * like.element_size()
        # a projection's parameters and buffers, and the packed int8 values an int8 layer keeps
        # outside both (models/quantize.py, which this module does not read)
        weights = sum(t.numel() * t.element_size() for p in projections for t in (*p.parameters(), *p.buffers()))
        packed = sum(getattr(p, "packed_bytes", lambda: 0)() for p in projections)
        return tables - weights - packed

    def train(self, mode: bool = True):
        self._kept = None  # the weights are about to change
        return super().train(mode)

    def _load_from_state_dict(self, *args, **kwargs):
        self._kept = None
        return super()._load_from_state_dict(*args, **kwargs)


class RelativeAttentionBlock(nn.Module):
    """The parameters of a Transformer-XL layer, relative multi-head attention then a
    position-wise feed-forward, and the residual wiring around them: the layers of Transformer-XL
    (models/transformer_xl.py) and adaptive span (models/adaptive_span.py) both hold exactly these
    and compute their attention in their own `forward`.

    `config` needs d_model, n_head, d_head, d_inner, dropout, dropatt, layer_norm_epsilon and
    pre_norm. The parameter names are the checkpoints' (qkv_net, r_net, o_net, attn_norm, ff,
    ff_norm)."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.config = c
        self.qkv_net = nn.Linear(c.d_model, 3 * c.n_head * c.d_head, bias=False)  # W_q, W_kE, W_v
        self.r_net = nn.Linear(c.d_model, c.n_head * c.d_head, bias=False)  # W_kR
        self.o_net = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)
        self.attn_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.ff = FeedForward(c.d_model, c.d_inner, c.dropout)
        self.ff_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.drop = nn.Dropout(c.dropout)
        self.dropatt = nn.Dropout(c.dropatt)
        self.scale = 1.0 / math.sqrt(c.d_head)

    def add_attention_and_feed_forward(self, x: Tensor, attended: Tensor) -> Tensor:
        """The layer's output (B, T, d_model) from its input x and the attention's output
        `attended` (B, T, d_model, after o_net and dropout): pre-norm adds each sub-layer to the
        residual stream (the norms came before them), post-norm normalises after each addition.
        Transformer-XL's decoding step writes the same wiring out without the module calls
        (models/transformer_xl.py `RelativeAttentionLayer._decode`): a change here goes there too."""
        if self.config.pre_norm:
            x = x + attended
            return x + self.ff(self.ff_norm(x))
        x = self.attn_norm(x + attended)
        return self.ff_norm(x + self.ff(x))
