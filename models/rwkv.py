"""RWKV-4: a recurrent language model of time-mixing and channel-mixing, trainable like a transformer.

Paper: Bo Peng, Eric Alcaide, Quentin Anthony, et al., "RWKV: Reinventing RNNs for the
Transformer Era", Findings of EMNLP 2023 (arXiv:2305.13048). Served as Hugging Face's
`RwkvForCausalLM` computes it (the RWKV/rwkv-4-*-pile checkpoints convert with `xlserve
convert`, models/convert/rwkv.py).

A block is pre-norm (LayerNorm) and residual around two mixers, each of which reads the current
position and the previous one through a learned per-channel interpolation ("token shift"):

    time mixing    k, v, r = K(mix_k(x_t, x_{t−1})), V(mix_v(...)), sigmoid(R(mix_r(...)))
                   wkv_t = (Σ_{s<t} e^{−(t−1−s)w + k_s} v_s + e^{u + k_t} v_t)
                         / (Σ_{s<t} e^{−(t−1−s)w + k_s}     + e^{u + k_t})
                   out = O(r ⊙ wkv)
    channel mixing k = relu(K(mix_k(x_t, x_{t−1})))², r = sigmoid(R(mix_r(...)))
                   out = r ⊙ V(k)

per channel, with w = exp(time_decay) > 0 and u = time_first. The first block also normalises
the embeddings (pre_ln). As transformers does at inference, every `rescale_every` blocks the
residual stream is halved, and the outputs of block i are divided by 2^(i // rescale_every):
the same function up to the LayerNorms' epsilon, with activations that stay within float16.

WKV (`wkv`): the sums are carried as (numerator, denominator, exponent) so that nothing
overflows: the true sums are num·e^max and den·e^max. Within a chunk of positions every output
is a softmax-like weighted average over the chunk's earlier positions and the carried state,
each term's exponent known in closed form (−(j−1−i)w + k_i, u + k_j, max − j·w), so the chunk is
computed at once with its largest exponent subtracted, and the state after it in the same way.
The reference's loop over positions computes the same sums one position at a time.

State (`WKVState`): per layer the last input of each mixer (the token shift) and the three WKV
tensors of the attention width, plus the token count: constant in size, and every output is a
function of the tokens up to it only, the same in any chunking (to float32 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xlserve.models.interface import ArchConfig, FixedShapeState, LanguageModel
from xlserve.models.layers.init import init_weights


CHUNK = 16  # positions whose WKV is computed at once (work and memory B · CHUNK² · d_attention per layer)
# the state's exponent before the first token: e^(EMPTY_EXPONENT − x) is exactly 0 in float32 for
# any key x a model produces (transformers starts at −1e30, the same zeros), yet its magnitude stays
# within what the server accepts in an imported state (server/engine/process.py, 1e12)
EMPTY_EXPONENT = -1e9


@dataclass
class RwkvConfig(ArchConfig):
    vocab_size: int = 256
    n_layer: int = 4
    d_model: int = 128
    d_attention: int = 128  # width of the time mixing's k, v, r (transformers' attention_hidden_size)
    d_ffn: int = 512  # width of the channel mixing (intermediate_size)
    layer_norm_epsilon: float = 1e-5
    rescale_every: int = 6  # 0: never
    tie_embedding: bool = False


@dataclass
class WKVState(FixedShapeState):
    """Per layer l (lists indexed by layer), batch on dimension 0:

    attn_shift[l]: (B, d_model) the last normalised input of the time mixing (zeros before the first token)
    ffn_shift[l]: (B, d_model) the last normalised input of the channel mixing
    numerator[l], denominator[l]: (B, d_attention) float32, Σ e^{−(t−s)w + k_s − max} v_s and the same without v_s
    exponent[l]: (B, d_attention) float32, max: the true sums are the two above times e^max
    position: (B,) int64, tokens seen

    Bytes per session: n_layer · (2 · d_model · element size + 12 · d_attention) + 8.

    A session stored in 16 bits keeps `exponent` in float32: it scales the whole history (the
    sums are num · e^max), so rounding it in bfloat16 (by up to 0.06 once it passes 16) would
    re-weight every past token against the next ones by up to 6%, where rounding num and den
    costs each value 0.4%.
    """

    kept_in_float32 = frozenset({"exponent"})

    attn_shift: list[Tensor]
    ffn_shift: list[Tensor]
    numerator: list[Tensor]
    denominator: list[Tensor]
    exponent: list[Tensor]
    position: Tensor

    def check_consistent(self) -> None:
        layers = {len(self.attn_shift), len(self.ffn_shift), len(self.numerator), len(self.denominator),
                  len(self.exponent)}
        if len(layers) != 1:
            raise ValueError("state has a different number of layers of attn_shift, ffn_shift, numerator, "
                             "denominator and exponent")
        if tuple(self.position.shape) != (self.batch_size,):
            raise ValueError(f"state tensor 'position' has shape {tuple(self.position.shape)}, "
                             f"expected ({self.batch_size},)")
        if bool((self.position < 0).any()):
            raise ValueError("state tensor 'position' holds a negative number of tokens")
        for i, den in enumerate(self.denominator):
            if bool((den < 0).any()):
                raise ValueError(f"state tensor 'denominator.{i}' holds negative values: it is a sum of exponentials")


def wkv(decay: Tensor, first: Tensor, k: Tensor, v: Tensor, num: Tensor, den: Tensor, mx: Tensor,
        chunk: int = CHUNK) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """RWKV-4's weighted key-value average for k, v (B, T, A) float32, decay w > 0 and first u
    (A), from the carried (num, den, mx) (B, A) -> wkv (B, T, A) and the state after."""
    if k.shape[1] == 1:  # decoding: the recurrence itself, a chunk of one without its tables
        k, v = k[:, 0], v[:, 0]
        top = torch.maximum(mx, first + k)
        scale, own = torch.exp(mx - top), torch.exp(first + k - top)
        out = (scale * num + own * v) / (scale * den + own)
        new_mx = torch.maximum(mx - decay, k)
        kept, added = torch.exp(mx - decay - new_mx), torch.exp(k - new_mx)
        return out[:, None], kept * num + added * v, kept * den + added, new_mx
    outputs, offsets = [], {}
    for start in range(0, k.shape[1], chunk):
        kc, vc = k[:, start : start + chunk], v[:, start : start + chunk]  # (B, L, A)
        L = kc.shape[1]
        if L not in offsets:  # the same for every chunk of this length
            offsets[L] = _chunk_offsets(decay, first, L)
        pairs, carried_by, to_end = offsets[L]
        terms = kc[:, None, :, :] + pairs  # (B, L_j, L_i, A): position i's exponent in output j
        carried = mx[:, None, :] - carried_by  # (B, L, A): the state's exponent at output j
        top = torch.maximum(terms.amax(dim=2), carried)  # (B, L, A)
        weights = torch.exp(terms - top[:, :, None, :])  # (B, L, L, A), 0 where i > j
        scale = torch.exp(carried - top)  # (B, L, A)
        numerator = scale * num[:, None, :] + (weights * vc[:, None, :, :]).sum(dim=2)
        denominator = scale * den[:, None, :] + weights.sum(dim=2)
        outputs.append(numerator / denominator)
        # the state after the chunk: e^{−Lw} · before + Σ_i e^{−(L−1−i)w + k_i}
        after = kc - to_end  # (B, L, A)
        old = mx - L * decay  # (B, A)
        new_mx = torch.maximum(after.amax(dim=1), old)
        w_after = torch.exp(after - new_mx[:, None, :])
        w_old = torch.exp(old - new_mx)
        num = w_old * num + (w_after * vc).sum(dim=1)
        den = w_old * den + w_after.sum(dim=1)
        mx = new_mx
    return torch.cat(outputs, dim=1), num, den, mx


def _chunk_offsets(decay: Tensor, first: Tensor, L: int) -> tuple[Tensor, Tensor, Tensor]:
    """What a chunk of L positions adds to the keys, for decay w and first u (A): the exponent
    offset of position i in output j (L, L, A): −(j−1−i)w before j, u at j, −inf after; the
    state's decay at output j, j·w (L, A); and position i's decay to the chunk's end, (L−1−i)w."""
    j = torch.arange(L, device=decay.device, dtype=decay.dtype)
    lag = (j[:, None] - 1 - j[None, :])[:, :, None]  # (L_j, L_i, 1): j − 1 − i
    pairs = torch.where(lag == -1, first, -lag * decay).masked_fill(lag < -1, float("-inf"))
    return pairs, j[:, None] * decay, (L - 1 - j)[:, None] * decay


def token_shift(x: Tensor, last: Tensor) -> Tensor:
    """x (B, T, C) -> the previous position's x at every position, `last` (B, C) before the first."""
    return torch.cat([last[:, None, :].to(x.dtype), x[:, :-1]], dim=1)


class TimeMixing(nn.Module):
    def __init__(self, config: RwkvConfig):
        super().__init__()
        c = config
        self.time_decay = nn.Parameter(torch.empty(c.d_attention))  # w = exp(time_decay)
        self.time_first = nn.Parameter(torch.empty(c.d_attention))  # u
        self.time_mix_key = nn.Parameter(torch.empty(c.d_model))
        self.time_mix_value = nn.Parameter(torch.empty(c.d_model))
        self.time_mix_receptance = nn.Parameter(torch.empty(c.d_model))
        self.key = nn.Linear(c.d_model, c.d_attention, bias=False)
        self.value = nn.Linear(c.d_model, c.d_attention, bias=False)
        self.receptance = nn.Linear(c.d_model, c.d_attention, bias=False)
        self.output = nn.Linear(c.d_attention, c.d_model, bias=False)

    def forward(self, x: Tensor, shift: Tensor, num: Tensor, den: Tensor, mx: Tensor):
        previous = token_shift(x, shift)  # (B, T, d_model)
        mix = lambda m: x * m + previous * (1 - m)  # noqa: E731
        k = self.key(mix(self.time_mix_key)).float()
        v = self.value(mix(self.time_mix_value)).float()
        r = torch.sigmoid(self.receptance(mix(self.time_mix_receptance)))
        out, num, den, mx = wkv(torch.exp(self.time_decay.float()), self.time_first.float(), k, v, num, den, mx)
        return self.output(r * out.to(x.dtype)), x[:, -1], num, den, mx


class ChannelMixing(nn.Module):
    def __init__(self, config: RwkvConfig):
        super().__init__()
        c = config
        self.time_mix_key = nn.Parameter(torch.empty(c.d_model))
        self.time_mix_receptance = nn.Parameter(torch.empty(c.d_model))
        self.key = nn.Linear(c.d_model, c.d_ffn, bias=False)
        self.receptance = nn.Linear(c.d_model, c.d_model, bias=False)
        self.value = nn.Linear(c.d_ffn, c.d_model, bias=False)

    def forward(self, x: Tensor, shift: Tensor):
        previous = token_shift(x, shift)
        k = torch.square(torch.relu(self.key(x * self.time_mix_key + previous * (1 - self.time_mix_key))))
        r = torch.sigmoid(self.receptance(x * self.time_mix_receptance + previous * (1 - self.time_mix_receptance)))
        return r * self.value(k), x[:, -1]


class RwkvBlock(nn.Module):
    def __init__(self, config: RwkvConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.ln2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.attention = TimeMixing(config)
        self.feed_forward = ChannelMixing(config)


class Rwkv(LanguageModel):
    architecture = "rwkv"
    config_class = RwkvConfig
    state_class = WKVState
    state_kind = "linear"
    state_grows_with_context = False
    chunking_invariant = True

    def __init__(self, config: RwkvConfig):
        super().__init__()
        c = config
        self.config = c
        if min(c.n_layer, c.d_model, c.d_attention, c.d_ffn) < 1 or c.rescale_every < 0:
            raise ValueError("n_layer, d_model, d_attention and d_ffn must be at least 1, rescale_every at least 0")
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.pre_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)  # the first block's pre_ln
        self.layers = nn.ModuleList(RwkvBlock(c) for _ in range(c.n_layer))
        self.final_norm = nn.LayerNorm(c.d_model)  # transformers' ln_out keeps LayerNorm's default epsilon
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embedding:
            self.head.weight = self.embedding.weight
        init_weights(self)
        with torch.no_grad():  # the paper's initialisation: decays spread over channels, mixes by depth
            for i, block in enumerate(self.layers):
                depth = i / max(1, c.n_layer - 1)
                channel = torch.arange(c.d_model) / c.d_model
                attention = torch.arange(c.d_attention) / max(1, c.d_attention - 1)
                block.attention.time_decay.copy_(-5 + 8 * attention ** (0.7 + 1.3 * depth))
                block.attention.time_first.fill_(0.5)
                for mix in (block.attention.time_mix_key, block.attention.time_mix_receptance,
                            block.feed_forward.time_mix_key, block.feed_forward.time_mix_receptance):
                    mix.copy_(channel ** (1 - depth))
                block.attention.time_mix_value.copy_(channel ** (1 - depth) + 0.3 * depth)

    @property
    def max_context(self) -> int | None:
        return None

    def init_state(self, batch_size: int) -> WKVState:
        c = self.config
        like = self.embedding.weight
        zeros = lambda width, dtype=torch.float32: torch.zeros(batch_size, width, dtype=dtype, device=like.device)  # noqa: E731
        return WKVState(
            attn_shift=[zeros(c.d_model, like.dtype) for _ in range(c.n_layer)],
            ffn_shift=[zeros(c.d_model, like.dtype) for _ in range(c.n_layer)],
            numerator=[zeros(c.d_attention) for _ in range(c.n_layer)],
            denominator=[zeros(c.d_attention) for _ in range(c.n_layer)],
            exponent=[zeros(c.d_attention).fill_(EMPTY_EXPONENT) for _ in range(c.n_layer)],
            position=torch.zeros(batch_size, dtype=torch.long, device=like.device),
        )

    def _check_tokens(self, state: WKVState, tokens: int) -> None:
        if tokens == 0:
            for name in ("attn_shift", "ffn_shift", "numerator", "denominator"):
                for i, t in enumerate(getattr(state, name)):
                    if bool(t.any()):
                        raise ValueError(f"state tensor '{name}.{i}' is not 0 before the first token")

    def forward(self, tokens: Tensor, state: WKVState) -> tuple[Tensor, WKVState]:
        B, T = tokens.shape
        if T == 0:
            return torch.zeros(B, 0, self.vocab_size, device=tokens.device), state
        c = self.config
        x = self.pre_norm(self.embedding(tokens))  # (B, T, d_model)
        new = {name: [] for name in ("attn_shift", "ffn_shift", "numerator", "denominator", "exponent")}
        for i, block in enumerate(self.layers):
            scale = 2 ** (i // c.rescale_every) if c.rescale_every else 1
            out, shift, num, den, mx = block.attention(block.ln1(x), state.attn_shift[i], state.numerator[i],
                                                       state.denominator[i], state.exponent[i])
            x = x + out / scale
            out, ffn_shift = block.feed_forward(block.ln2(x), state.ffn_shift[i])
            x = x + out / scale
            if c.rescale_every and (i + 1) % c.rescale_every == 0:
                x = x / 2
            for name, value in zip(new, (shift, ffn_shift, num, den, mx)):
                new[name].append(value.detach())
        log_probs = F.log_softmax(self.head(self.final_norm(x)).float(), dim=-1)  # (B, T, V)
        return log_probs, WKVState(**new, position=state.position + T)
