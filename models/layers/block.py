"""The pre-norm residual block that the windowed architectures share: a token mixer (attention,
or Lite Transformer's long-short range attention) and a position-wise feed-forward, each behind
a LayerNorm and added back to the residual stream:

    x = x + Dropout(Mixer(LayerNorm(x), context...))
    x = x + FeedForward(LayerNorm(x))

The mixer returns its output and its new memory; the block hands the memory back unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from xlserve.models.layers.feedforward import FeedForward


class PreNormBlock(nn.Module):
    def __init__(self, mixer: nn.Module, d_model: int, d_inner: int, dropout: float, layer_norm_epsilon: float):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model, eps=layer_norm_epsilon)
        self.attention = mixer
        self.ff_norm = nn.LayerNorm(d_model, eps=layer_norm_epsilon)
        self.ff = FeedForward(d_model, d_inner, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, *context) -> tuple[Tensor, object]:
        """x (B, T, d_model) and whatever the mixer takes after its input -> (B, T, d_model), memory."""
        mixed, memory = self.attention(self.attn_norm(x), *context)
        x = x + self.drop(mixed)
        x = x + self.ff(self.ff_norm(x))
        return x, memory


def forward_in_pieces(tokens: Tensor, position: Tensor, max_positions: int, run_piece) -> tuple[Tensor, Tensor]:
    """Run `run_piece(chunk (B, t), position (B,)) -> log-probs (B, t, V)` over consecutive pieces
    of at most `max_positions` tokens, each starting where the last ended. For a model whose
    results do not depend on chunking this is one call's result with one piece's activations
    at a time. Returns the log-probs (B, T, V) and the position after the last token."""
    pieces = []
    for start in range(0, tokens.shape[1], max_positions):
        chunk = tokens[:, start : start + max_positions]
        pieces.append(run_piece(chunk, position))
        position = position + chunk.shape[1]
    return (torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]), position
