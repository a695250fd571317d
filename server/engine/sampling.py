"""Choosing the next token: penalties, temperature, top-k, top-p, min-p, seeds, stop strings,
logprobs (engine process, the engine's worker thread).

Everything here works on one row of log-probabilities (V,) on the CPU or the model's device.
Each choice of each request draws from its own generator, so the same seed gives the same text
whether the request runs alone or beside others in a batch (choice i of a request with seed s
draws from seed s + i, so choice 0 of an n > 1 request is the n = 1 text).

Order of operations (vLLM's): penalties -> temperature (0 = greedy: argmax of the penalised
row) -> top-k -> top-p -> min-p -> draw. Log-probabilities reported back to the client are
always the model's own, before any of this.

Penalties act on log-probabilities (which are all <= 0):
- repetition_penalty r (HF / vLLM, 1 = off): a token already in the prompt or the generated
  text has its log-probability multiplied by r (so r > 1 makes it less likely).
- presence_penalty a and frequency_penalty f (OpenAI, 0 = off): a token generated c times so far
  has a * (c > 0) + f * c subtracted. Only generated tokens count, as in OpenAI's API.
"""

from __future__ import annotations

import torch

from xlserve.server.engine.types import SamplingParams


class Sampler:
    """Draws one choice's tokens. `choose` remembers what it drew (for the penalties)."""

    def __init__(self, params: SamplingParams, prompt: list[int] | None = None, index: int = 0):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed + index)
        else:
            self.generator.seed()
        self._prompt = list(prompt or [])
        self._counts: torch.Tensor | None = None  # (V,) float32, how often each token was generated
        self._seen: torch.Tensor | None = None  # (V,) bool, in the prompt or generated

    def _penalise(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if self._counts is None:
            self._counts = torch.zeros(logits.numel())
            self._seen = torch.zeros(logits.numel(), dtype=torch.bool)
            if self._prompt:
                self._seen[torch.tensor(self._prompt)] = True
        if p.repetition_penalty != 1.0:
            # log-probs are <= 0: multiplying by r > 1 pushes a seen token down (HF's rule for
            # negative logits); the positive branch keeps the rule right for any logits
            penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(self._seen, penalised, logits)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            logits = logits - p.frequency_penalty * self._counts - p.presence_penalty * (self._counts > 0).float()
        return logits

    def _record(self, token: int) -> None:
        if self._counts is not None:
            self._counts[token] += 1
            self._seen[token] = True

    def choose(self, log_probs: torch.Tensor) -> int:
        """log_probs (V,) -> token id."""
        p = self.params
        if p.temperature == 0 and not p.penalised:
            return int(log_probs.argmax())
        logits = log_probs.float().cpu()  # (V,)
        if p.penalised:
            logits = self._penalise(logits)
        if p.temperature == 0:
            token = int(logits.argmax())
            self._record(token)
            return token
        logits = logits / p.temperature
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
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)  # the most likely always stays
        token = int(torch.multinomial(probs, 1, generator=self.generator))
        self._record(token)
        return token


def top_alternatives(log_probs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, indices = torch.topk(log_probs.float(), k)
    return [(int(i), float(v)) for i, v in zip(indices.tolist(), values.tolist())]


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
