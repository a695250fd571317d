"""Choosing the next token: temperature, top-k, top-p, seeds, stop strings, logprobs.

Everything here works on one row of log-probabilities (V,) on the CPU or the model's device;
a seeded request draws from its own generator, so the same seed gives the same text whether
the request runs alone or beside others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None = none; k = the chosen token's and the k most likely
    echo: bool = False


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def choose(self, log_probs: torch.Tensor) -> int:
        """log_probs (V,) -> token id."""
        p = self.params
        if p.temperature == 0:
            return int(log_probs.argmax())
        logits = log_probs.float().cpu() / p.temperature  # (V,)
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            outside = probs.cumsum(-1) - probs >= p.top_p
            sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def top_alternatives(log_probs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, indices = torch.topk(log_probs.float(), k)
    return [(int(i), float(v)) for i, v in zip(indices, values)]


class StopChecker:
    """Finds stop strings in generated text, even when one spans several tokens, and holds
    back text that might turn out to be the start of a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""  # text not yet released

    def push(self, text: str) -> tuple[str, bool]:
        """Add generated text; returns (text safe to release, whether a stop string was hit).
        On a hit, the released text ends just before the stop string."""
        self.pending += text
        if not self.stops:
            released, self.pending = self.pending, ""
            return released, False
        hits = [self.pending.find(s) for s in self.stops]
        hits = [h for h in hits if h >= 0]
        if hits:
            released, self.pending = self.pending[: min(hits)], ""
            return released, True
        hold = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(stop[:length]):
                    hold = max(hold, length)
                    break
        cut = len(self.pending) - hold
        released, self.pending = self.pending[:cut], self.pending[cut:]
        return released, False

    def flush(self) -> str:
        released, self.pending = self.pending, ""
        return released
