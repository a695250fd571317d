"""The vanilla character transformer: a deep causal transformer over a fixed context of L bytes.

Paper: Rami Al-Rfou, Dokook Choe, Noah Constant, Mandy Guo, Llion Jones, "Character-Level Language
Modeling with Deeper Self-Attention", AAAI 2019 (the model Transformer-XL calls "vanilla").

The model sees at most `context_len` (L) bytes. Positions are absolute within that window: every
layer adds its own learned positional embedding (an (L, d_model) table per layer) to its input,
so position information does not fade with depth. Nothing is carried from one window to the
next; the paper trains on independent windows and we do the same (the training loop's memory
argument is passed through untouched).

Training: three auxiliary losses (`training_loss`; switches in the config)
- multiple positions (`aux_positions`): every position of the window predicts its next byte,
  not only the last one;
- intermediate layers (`aux_layers`): the output of every layer l < n also predicts, through
  the same final norm and softmax as the top layer; layer l stops contributing after the
  fraction l / (2n) of training, so all of them are gone half way through
  (`intermediate_layer_weights`);
- multiple targets (`aux_targets`): a second, separate classifier predicts the byte two steps
  ahead at every scored position; its loss is weighted 0.5 and added to the loss of the layer
  it came from.
The total is the sum of the layer losses, as in the paper. With all three switched off the loss
is the plain next-byte loss of the window's last position; with only `aux_positions` on it is
the plain next-byte loss averaged over every position (what the standard training loop computes
for models without auxiliary losses).

Serving (`forward`) gives each byte the prediction the model makes from the window of the last L
bytes ending at it, with positions counted from the window's start (the paper's evaluation):
- While fewer than L bytes have been seen, the window starts at byte 0, so positions never
  shift: decoding is incremental, against a key/value cache kept in the state (`ByteWindow`).
- Once the window slides, every byte has moved to a new position and every layer's input
  changed with it, so nothing cached is reusable: each new byte costs one full forward pass over
  its window of L bytes (batched over the new bytes of one call, about `window_batch_positions`
  positions at a time). That cost is what Transformer-XL's memory removes; it is deliberately
  not optimised away here.
Feeding a text in one call or in chunks of any size gives the same log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import LanguageModel, State, TransformerConfig
from xlserve.models.layers.buffers import check_padding_on_the_left, check_same_positions, left_pad, left_padding
from xlserve.models.layers.feedforward import FeedForward
from xlserve.models.layers.init import init_weights


@dataclass
class VanillaConfig(TransformerConfig):
    """vocab_size, n_layer, d_model, n_head, d_head and d_inner: TransformerConfig's (models/interface.py)."""

    context_len: int = 128  # L: the fixed context, and the training window
    dropout: float = 0.0  # on embeddings, attention output and feed-forward
    dropatt: float = 0.0  # on attention probabilities
    layer_norm_epsilon: float = 1e-5
    tie_embedding: bool = True  # the next-byte softmax shares the input embedding matrix
    # auxiliary losses of Al-Rfou et al. (training only; serving never uses them)
    aux_positions: bool = True  # predict at every position, not only the last
    aux_layers: bool = True  # intermediate layers predict too, dropped on the l/(2n) schedule
    aux_targets: bool = True  # a second classifier predicts the byte two steps ahead
    second_target_weight: float = 0.5  # weight of the two-steps-ahead loss


# -- the state between calls -----------------------------------------------------------------------


@dataclass
class ByteWindow(State):
    """The last (at most L) bytes seen, and the key/value cache of the window while it has not
    slid yet.

    tokens (B, W) int64 with W <= L; `valid` (B, W) is False where a row of a batch was
    left-padded because its session has seen fewer bytes. keys[l], values[l]: (B, C, H, D), the
    layer-l keys and values of the window's positions, aligned with `tokens` (C == W), or C == 0
    when no row has a cache; `cached` (B,) says whose cache is valid. A cache exists only while
    the window still starts at byte 0 (W < L); it is dropped once the window is full, since the
    next byte shifts every position.
    """

    tokens: Tensor
    valid: Tensor
    cached: Tensor
    keys: list[Tensor]
    values: list[Tensor]

    # a commit slides the byte window (and grows its cache) by the new positions (State.delta_from)
    delta_axes = {"tokens": 1, "valid": 1, "keys": 1, "values": 1}

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def cache_length(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    @property
    def fully_cached(self) -> bool:
        """Every row's cache covers its whole window (trivially so for an empty window)."""
        return self.length == 0 or (self.cache_length == self.length and bool(self.cached.all()))

    def check_consistent(self) -> None:
        """State.check_consistent: `valid` and `cached` fit `tokens`, padding comes first, and
        each layer's cached keys and values cover the whole window or nothing."""
        if len(self.keys) != len(self.values):
            raise ValueError(f"state has keys for {len(self.keys)} layers and values for {len(self.values)}")
        check_same_positions([("valid", self.valid)], "tokens", self.tokens)
        if tuple(self.cached.shape) != tuple(self.tokens.shape[:1]):
            raise ValueError(f"state tensor 'cached' has shape {tuple(self.cached.shape)}, "
                             f"expected ({self.tokens.shape[0]},)")
        check_padding_on_the_left(self.valid)
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):
            if keys.shape != values.shape:
                raise ValueError(f"state tensors 'keys.{i}' {tuple(keys.shape)} and 'values.{i}' "
                                 f"{tuple(values.shape)} differ in shape")
            if keys.shape[1] not in (0, self.length) or keys.shape[1] != self.cache_length:
                raise ValueError(f"state tensor 'keys.{i}' caches {keys.shape[1]} positions, the window holds "
                                 f"{self.length} and layer 0 caches {self.cache_length}")

    def _without_cache(self) -> "ByteWindow":
        empty = lambda t: t[:, :0]  # noqa: E731
        return ByteWindow(self.tokens, self.valid, torch.zeros_like(self.cached),
                          [empty(k) for k in self.keys], [empty(v) for v in self.values])

    @classmethod
    def concat(cls, states: list["ByteWindow"]) -> "ByteWindow":
        """Rows of every state, left-padded to the longest window. The batch keeps a cache when
        any row has one; rows without one get zeros there, flagged as not cached."""
        longest = max(s.length for s in states)
        any_cache = any(s.cache_length > 0 and bool(s.cached.any()) for s in states)

        def cache(s: ByteWindow, which: str, layer: int) -> Tensor:
            t = getattr(s, which)[layer]
            if not any_cache:
                return t
            if t.shape[1] != s.length:  # no cache in this state
                t = t.new_zeros(t.shape[0], s.length, *t.shape[2:])
            return left_pad(t, longest, 0)

        n_layer = len(states[0].keys)
        if not any_cache:
            states = [s._without_cache() for s in states]
        return cls(
            tokens=torch.cat([left_pad(s.tokens, longest, 0) for s in states]),
            valid=torch.cat([left_pad(s.valid, longest, False) for s in states]),
            cached=torch.cat([s.cached & (s.cache_length == s.length) for s in states]),
            keys=[torch.cat([cache(s, "keys", i) for s in states]) for i in range(n_layer)],
            values=[torch.cat([cache(s, "values", i) for s in states]) for i in range(n_layer)],
        )

    def split(self) -> list["ByteWindow"]:
        rows = []
        for row in super().split():
            start = left_padding(row.valid)
            trimmed = ByteWindow(row.tokens[:, start:], row.valid[:, start:], row.cached,
                                 [k[:, start:] for k in row.keys], [v[:, start:] for v in row.values])
            rows.append(trimmed if trimmed.fully_cached and trimmed.length > 0 else trimmed._without_cache())
        return rows


# -- the model -------------------------------------------------------------------------------------


class CausalLayer(nn.Module):
    """Pre-norm causal self-attention + feed-forward, with this layer's learned positions added
    to its input."""

    def __init__(self, config: VanillaConfig):
        super().__init__()
        c = config
        self.config = c
        self.position = nn.Parameter(torch.zeros(c.context_len, c.d_model))  # this layer's positions
        self.attn_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.qkv_net = nn.Linear(c.d_model, 3 * c.n_head * c.d_head, bias=False)
        self.o_net = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)
        self.ff_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.ff = FeedForward(c.d_model, c.d_inner, c.dropout)
        self.drop = nn.Dropout(c.dropout)

    def forward(
        self,
        x: Tensor,  # (B, T, d_model)
        start: int,  # position (within the window) of x's first row
        cache_keys: Tensor | None,  # (B, C, H, D) with C == start, or None when start == 0
        cache_values: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The layer's output (B, T, d_model) and its keys and values over cache + x
        (B, start + T, H, D)."""
        c = self.config
        B, T, _ = x.shape
        x = x + self.position[start : start + T]
        q, k, v = self.qkv_net(self.attn_norm(x)).view(B, T, 3, c.n_head, c.d_head).unbind(dim=2)  # (B, T, H, D)
        if cache_keys is not None and cache_keys.shape[1] > 0:
            keys, values = torch.cat([cache_keys, k], dim=1), torch.cat([cache_values, v], dim=1)
        else:
            keys, values = k, v
        attended = self._causal_attention(q, keys, values)  # (B, T, H, D)
        x = x + self.drop(self.o_net(attended.reshape(B, T, -1)))
        x = x + self.ff(self.ff_norm(x))
        return x, keys, values

    def _causal_attention(self, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """softmax(q kᵀ / √D) v for queries q (B, T, H, D) at the window's last T positions over
        keys and values (B, K, H, D) at positions 0 .. K-1: query i sees keys 0 .. K - T + i.
        -> (B, T, H, D)"""
        T, K = q.shape[1], keys.shape[1]
        dropatt = self.config.dropatt if self.training else 0.0
        q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)  # (B, H, ., D)
        if K == T:  # no cache: plain causal attention
            attended = F.scaled_dot_product_attention(q, keys, values, dropout_p=dropatt, is_causal=True)
        else:
            mask = None  # one query sees every key
            if T > 1:
                mask = torch.arange(K, device=q.device)[None, :] <= torch.arange(K - T, K, device=q.device)[:, None]
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropatt)
        return attended.transpose(1, 2)


class VanillaTransformer(LanguageModel):
    architecture = "vanilla"
    config_class = VanillaConfig
    state_class = ByteWindow
    state_kind = "window"
    state_grows_with_context = False  # at most L bytes (+ their keys/values until the window slides)
    window_batch_positions = 8192  # serving, once the window slides: positions recomputed per batched forward
    chunking_invariant = True  # the module docstring's chunking semantics

    def __init__(self, config: VanillaConfig):
        super().__init__()
        c = config
        self.config = c
        if c.context_len < 1:
            raise ValueError("context_len must be at least 1")
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(CausalLayer(c) for _ in range(c.n_layer))
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.head = nn.Linear(c.d_model, c.vocab_size)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        # the multiple-targets classifier (two steps ahead); separate from `head`, training only
        self.second_head = nn.Linear(c.d_model, c.vocab_size) if c.aux_targets else None
        init_weights(self, [layer.position for layer in self.layers])

    @property
    def max_context(self) -> int | None:
        return self.config.context_len

    # -- state --------------------------------------------------------------------------------

    def init_state(self, batch_size: int) -> ByteWindow:
        c = self.config
        p = self.embedding.weight
        empty = lambda: p.new_zeros(batch_size, 0, c.n_head, c.d_head)  # noqa: E731
        return ByteWindow(
            tokens=torch.zeros(batch_size, 0, dtype=torch.long, device=p.device),
            valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=p.device),
            cached=torch.zeros(batch_size, dtype=torch.bool, device=p.device),
            keys=[empty() for _ in range(c.n_layer)],
            values=[empty() for _ in range(c.n_layer)],
        )

    def _fixed_state_dims(self, name: str, fresh: Tensor) -> range:
        return range(2, fresh.dim())  # window and cache lengths (dim 1) vary

    def _full_state_length(self, name: str) -> int | None:
        """The largest this state gets, which is what budgets and the state-body limit are sized
        by: L - 1 bytes with their keys and values (781 KB at vanilla-stdlib's size). A full
        window holds L bytes and drops the key/value cache (1,153 bytes there), so counting that
        sized every session in its first L bytes at a fraction of itself, and an export of one of
        them could pass the state-body limit its import is held to."""
        return self.config.context_len - 1

    def check_state(self, state: State, tokens: int | None = None) -> None:
        super().check_state(state, tokens)  # valid, cached and the cache fit tokens: ByteWindow.check_consistent
        L = self.config.context_len
        if state.length > L:
            raise ValueError(f"window holds {state.length} bytes, more than context_len {L}")
        if state.tokens.numel() and (int(state.tokens.min()) < 0 or int(state.tokens.max()) >= self.vocab_size):
            raise ValueError(f"state 'tokens' holds ids outside 0..{self.vocab_size - 1}")

    def _check_tokens(self, state: ByteWindow, tokens: int) -> None:
        """After t bytes the window holds the last min(t, L), and once it has slid (t > L) it
        keeps no key/value cache (every position shifted)."""
        L = self.config.context_len
        held = int(state.valid.sum())
        if held != min(tokens, L):
            raise ValueError(f"state tensor 'valid' marks {held} bytes; after {tokens} bytes a window of "
                             f"context_len {L} holds {min(tokens, L)}")
        if held != state.length:  # padding is a batch's (split takes it off): a session's bytes are all its own
            raise ValueError(f"state tensor 'valid' marks {held} of its {state.length} positions: a session's "
                             "window holds no padding")
        if tokens > L and state.cache_length > 0 and bool(state.cached.any()):
            raise ValueError(f"state tensor 'cached' claims a key/value cache for a window that has slid "
                             f"({tokens} bytes seen, context_len {L})")

    # -- the network --------------------------------------------------------------------------

    def _stack(self, tokens: Tensor, start: int, cache: tuple[list[Tensor], list[Tensor]] | None,
               all_layers: bool = False):
        """tokens (B, T) at window positions start .. start+T-1 -> the final hidden states
        (B, T, d) (after the final norm), the per-layer keys and values (B, start+T, H, D) and,
        with `all_layers`, every layer's output before the final norm."""
        x = self.drop(self.embedding(tokens))
        keys, values, outputs = [], [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, start, cache[0][i] if cache else None, cache[1][i] if cache else None)
            keys.append(k)
            values.append(v)
            if all_layers:
                outputs.append(x)
        return self.final_norm(x), keys, values, outputs

    def _log_probs(self, hidden: Tensor) -> Tensor:
        return F.log_softmax(self.head(self.drop(hidden)).float(), dim=-1)

    # -- serving ------------------------------------------------------------------------------

    def forward(self, tokens: Tensor, state: ByteWindow) -> tuple[Tensor, ByteWindow]:
        B, T = tokens.shape
        uniform = bool(state.valid.all()) and (state.fully_cached or not bool(state.cached.any()))
        if B > 1 and not uniform:  # rows of different lengths or caches: one at a time
            outputs = [self.forward(tokens[b : b + 1], row) for b, row in enumerate(state.split())]
            return torch.cat([o[0] for o in outputs]), ByteWindow.concat([o[1] for o in outputs])
        if T == 0:
            return tokens.new_zeros(B, 0, self.vocab_size, dtype=torch.float32), state

        L = self.config.context_len
        W = state.length
        history = torch.cat([state.tokens, tokens], dim=1)  # (B, W + T)
        pieces = []

        # 1. bytes that still fit the window that starts at byte 0: one incremental causal pass
        fit = max(0, min(T, L - W))
        keys, values = state.keys, state.values
        if fit > 0:
            if not state.fully_cached:  # cache lost (restored, batched, ...): rebuild it from the bytes
                _, keys, values, _ = self._stack(state.tokens, 0, None)
            hidden, keys, values, _ = self._stack(tokens[:, :fit], W, (keys, values))
            pieces.append(self._log_probs(hidden))

        # 2. bytes after the window starts sliding: each is predicted from its own window of L
        # bytes at positions 0..L-1, recomputed from scratch (nothing cached is valid any more)
        if fit < T:
            # the window ending at history index a starts at a - L + 1; a runs over W+fit .. W+T-1
            windows = history.unfold(1, L, 1)[:, W + fit - L + 1 :]  # (B, T - fit, L)
            last = []
            for chunk in windows.reshape(-1, L).split(max(1, self.window_batch_positions // L)):
                hidden, _, _, _ = self._stack(chunk, 0, None)
                last.append(hidden[:, -1])
            pieces.append(self._log_probs(torch.cat(last).view(B, T - fit, -1)))

        log_probs = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        window = history[:, -L:]
        valid = state.valid.new_ones(window.shape)
        if window.shape[1] < L:  # not slid, nor about to: keep the cache
            return log_probs, ByteWindow(window, valid, state.cached.new_ones(B), [k.detach() for k in keys],
                                         [v.detach() for v in values])
        empty = [k[:, :0] for k in state.keys]
        return log_probs, ByteWindow(window, valid, state.cached.new_zeros(B), empty, [v[:, :0] for v in state.values])

    # -- training -----------------------------------------------------------------------------

    def training_loss(self, inputs: Tensor, targets: Tensor, state: State, fraction_done: float):
        """The paper's loss on independent windows `inputs` (B, T <= L); `targets` are the next
        bytes. The state is passed through unchanged (no memory between windows)."""
        return self.auxiliary_loss(inputs, targets, fraction_done), state

    def auxiliary_loss(self, inputs: Tensor, targets: Tensor, fraction_done: float) -> Tensor:
        c = self.config
        B, T = inputs.shape
        if T > c.context_len:
            raise ValueError(f"training windows of {T} bytes exceed context_len {c.context_len}")
        final, _, _, outputs = self._stack(inputs, 0, None, all_layers=c.aux_layers)
        if c.aux_layers:
            weights = intermediate_layer_weights(c.n_layer, fraction_done)
            layer_hidden = [self.final_norm(h) for h in outputs[:-1]] + [final]
        else:
            weights, layer_hidden = [0.0] * (c.n_layer - 1) + [1.0], [None] * (c.n_layer - 1) + [final]

        scored = slice(None) if c.aux_positions else slice(T - 1, T)  # positions whose next byte is predicted
        total = inputs.new_zeros((), dtype=torch.float32)
        for weight, hidden in zip(weights, layer_hidden):
            if weight == 0.0:
                continue
            h = self.drop(hidden[:, scored])
            loss = F.cross_entropy(self.head(h).float().flatten(0, 1), targets[:, scored].flatten())
            if c.aux_targets and self.second_head is not None:
                # the byte two steps after position t is targets[t + 1]: positions 0..T-2 have one
                positions = range(T - 1)[scored]
                if len(positions) > 0:
                    h2 = self.drop(hidden[:, positions.start : positions.stop])
                    second = targets[:, positions.start + 1 : positions.stop + 1]
                    loss = loss + c.second_target_weight * F.cross_entropy(
                        self.second_head(h2).float().flatten(0, 1), second.flatten()
                    )
            total = total + weight * loss
        return total


def intermediate_layer_weights(n_layer: int, fraction_done: float) -> list[float]:
    """Weight of each layer's loss (index 0 = layer 1) at `fraction_done` of training: the top
    layer always 1; layer l < n is 1 until the fraction l / (2n) of training, then 0."""
    return [1.0 if l == n_layer or fraction_done < l / (2 * n_layer) else 0.0 for l in range(1, n_layer + 1)]
