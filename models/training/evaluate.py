"""Held-out evaluation in bits per byte, with the memory carried across each whole document.

Each document is scored on its own, starting from an empty state: the first byte has no
context and is not scored; every later byte is predicted from everything the model can
remember of the bytes before it in the same document.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from models.interface import LanguageModel


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
def bits_per_byte(model: LanguageModel, documents: Iterable[bytes], chunk_len: int = 512) -> float:
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    for data in documents:
        doc_nll, doc_count = document_nll(model, data, chunk_len)
        nll += doc_nll
        count += doc_count
    model.train(was_training)
    return nll / max(count, 1) / math.log(2)
