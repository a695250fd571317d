"""Held-out evaluation in bits per byte, with the memory carried across each whole document.

Each document is scored on its own, starting from an empty state: the first byte has no
context and is not scored; every later byte is predicted from everything the model can
remember of the bytes before it in the same document.

Fixed-context models (`max_context` L, the vanilla transformer) served byte by byte recompute a
whole window per byte once the window slides (Al-Rfou et al.'s evaluation, `window_stride` 1),
which costs L times a memory model's evaluation. `window_stride` S > 1 is the usual cheaper
estimate: windows of L bytes advanced S bytes at a time, each scoring only its last S
predictions, so every byte is predicted from at least L - S bytes of context (all of it inside
the first window). It can only see less context than stride 1, never more.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from xlserve.models.interface import LanguageModel


@torch.no_grad()
def document_nll(model: LanguageModel, data: bytes, chunk_len: int) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of bytes 1..n-1 of `data`, and their count."""
    tokens = torch.tensor(list(data), dtype=torch.long, device=model.device)[None]  # (1, n)
    state = model.init_state(1)
    total = 0.0
    for start in range(0, tokens.shape[1] - 1, chunk_len):
        inputs = tokens[:, start : start + chunk_len]
        targets = tokens[:, start + 1 : start + chunk_len + 1]
        inputs = inputs[:, : targets.shape[1]]
        log_probs, state = model(inputs, state)
        total -= log_probs.gather(-1, targets[..., None]).sum().item()
    return total, max(tokens.shape[1] - 1, 0)


@torch.no_grad()
def windowed_document_nll(model: LanguageModel, data: bytes, stride: int, batch_windows: int = 32) -> tuple[float, int]:
    """`document_nll` for a fixed-context model, scored by windows of L bytes `stride` apart."""
    L = model.sliding_window
    if L is None or not 1 <= stride <= L:
        raise ValueError(f"window stride {stride} needs a fixed-context model and 1 <= stride <= {L}")
    tokens = torch.tensor(list(data), dtype=torch.long, device=model.device)
    n = tokens.shape[0]
    if n < 2:
        return 0.0, 0
    # window w covers inputs start..start+L-1 and targets start+1..start+L; the first scores all
    # of its targets, every later one only targets it is the first to reach
    starts = list(range(0, max(n - L - 1, 0) + 1, stride))
    if starts[-1] + L < n - 1:
        starts.append(n - 1 - L)
    total, scored_up_to = 0.0, 0  # targets 1..scored_up_to are done
    full = [s for s in starts if s + L <= n - 1]
    partial = [s for s in starts if s + L > n - 1]  # only when the document is shorter than L + 1
    for group in [full[i : i + batch_windows] for i in range(0, len(full), batch_windows)] + [[s] for s in partial]:
        width = min(L, n - 1 - group[0])
        inputs = torch.stack([tokens[s : s + width] for s in group])  # (W, width)
        targets = torch.stack([tokens[s + 1 : s + width + 1] for s in group])
        log_probs, _ = model(inputs, model.init_state(len(group)))  # (W, width, V)
        picked = log_probs.gather(-1, targets[..., None])[..., 0]  # (W, width)
        for row, s in enumerate(group):
            first_new = max(scored_up_to + 1, s + 1) - (s + 1)  # index in this window's targets
            total -= picked[row, first_new:].sum().item()
            scored_up_to = s + width
    return total, n - 1


def scored_part(model: LanguageModel, data: bytes) -> bytes:
    """The part of a document `bits_per_byte` feeds `model`: all of it, except for a model whose
    max_context is where it stops (no window slides), which takes its first max_context + 1
    bytes (its first byte is never scored)."""
    return data if model.history_limit is None else data[: model.history_limit + 1]


@torch.no_grad()
def bits_per_byte(model: LanguageModel, documents: Iterable[bytes], chunk_len: int = 512,
                  window_stride: int | None = None) -> float:
    """Bits per scored byte over `documents`; `window_stride` scores a fixed-context model by
    strided windows (see the module docstring) instead of byte-by-byte sliding. A model whose
    max_context is where it stops (no window slides) is scored on each document's first
    max_context + 1 bytes, the most it can be fed."""
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    for data in documents:
        data = scored_part(model, data)
        if window_stride is not None and model.sliding_window is not None:
            doc_nll, doc_count = windowed_document_nll(model, data, window_stride)
        else:
            doc_nll, doc_count = document_nll(model, data, chunk_len)
        nll += doc_nll
        count += doc_count
    model.train(was_training)
    return nll / max(count, 1) / math.log(2)


@torch.no_grad()
def permutation_bits_per_byte(model: LanguageModel, documents: Iterable[bytes], segment_len: int,
                              predict_fraction: float, seed: int = 0) -> float:
    """XLNet's training objective on held-out text: each document in segments of `segment_len`
    with the memory carried, a random factorisation order per segment (seeded), the last
    `predict_fraction` of each order predicted from the memory and the positions before it in
    the order (on both sides of it in the text). Bits per predicted byte. Needs `model.permuted`."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    nll, count = 0.0, 0
    for data in documents:
        tokens = torch.tensor(list(data), dtype=torch.long, device=model.device)[None]  # (1, n)
        state = model.init_state(1)
        for start in range(0, tokens.shape[1], segment_len):
            segment = tokens[:, start : start + segment_len]
            T = segment.shape[1]
            order = torch.randperm(T, generator=generator)[None].to(model.device)  # (1, T)
            n_predict = max(1, math.ceil(T * predict_fraction))
            log_probs, predicted, state = model.permuted(segment, state, order, n_predict)
            nll -= log_probs.gather(-1, segment.gather(1, predicted)[..., None]).sum().item()
            count += n_predict
    model.train(was_training)
    return nll / max(count, 1) / math.log(2)
