"""Choosing the next token: penalties, temperature, top-k, top-p, min-p, seeds, stop strings,
logprobs (engine process, the engine's worker thread).

Everything here works on one row of log-probabilities (V,) on the CPU or the model's device.
Each choice of each request draws from its own generator, so the same seed gives the same text
whether the request runs alone or beside others in a batch (choice i of a request with seed s
draws from seed s + i, so choice 0 of an n > 1 request is the n = 1 text).

Order of operations (vLLM's): logit_bias -> penalties -> a structured-output constraint's mask
(server/engine/constraints.py: forbidden tokens to -inf, and "end here" as one more choice where
the output may end) -> temperature (0 = greedy: argmax of the biased, penalised, masked row) ->
top-k -> top-p -> min-p -> draw. Log-probabilities reported back to
the client are always the model's own, before any of this. `logit_bias` (OpenAI's) adds its
value to the log-probability of each token it names; ids outside the vocabulary are refused.

Odd values never make the sampler produce NaN or raise, and one request's trouble stays its
own (the engine fails that request alone, server/engine/scheduler.py):
- temperature < GREEDY_TEMPERATURE (1e-5, as vLLM) is greedy; any other temperature divides
  the row after its largest value is shifted to 0, so the most likely token always survives;
- top_p < SMALLEST_TOP_P (1e-5) keeps only the most likely token; top-p always keeps one;
- a seed is taken modulo 2**64 (choice i of seed s draws from (s + i) mod 2**64), so every
  integer works (the API takes -2**63..2**64-1: OpenAI's signed seeds and unsigned ones);
- a row that is not a distribution (NaN, +inf, or no possible token) raises RequestFailed
  with code "sampling_failed", for that request alone.

Penalties act on log-probabilities (which are all <= 0):
- repetition_penalty r (HF / vLLM, 1 = off): a token already in the prompt or the generated
  text has its log-probability multiplied by r (so r > 1 makes it less likely).
- presence_penalty a and frequency_penalty f (OpenAI, 0 = off): a token generated c times so far
  has a * (c > 0) + f * c subtracted. Only generated tokens count, as in OpenAI's API.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from xlserve.server.engine.errors import InvalidInput, RequestFailed, StateNotUsable
from xlserve.server.engine.types import SamplingParams

GREEDY_TEMPERATURE = 1e-5  # below this a temperature is greedy (vLLM's _SAMPLING_EPS)
SMALLEST_TOP_P = 1e-5  # below this top_p keeps only the most likely token
SEED_MODULUS = 2**64  # torch's generators take 64-bit seeds


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def is_plain_greedy(params: SamplingParams) -> bool:
    """The argmax of the model's own row: no transform changes which token is the most likely."""
    return is_greedy(params) and not params.penalised and not params.logit_bias


def most_likely(row: torch.Tensor) -> tuple[int, float]:
    """(argmax, its value) of a row (V,). A NaN anywhere is what argmax picks, and +inf is the
    largest, so the value is finite exactly when the row can be sampled from. Through `max`,
    whose index is argmax's (the first of equal values, the first NaN) and which takes a third of
    argmax's time over a 267,735-word row on the CPU of 2026-12-05 (117 against 379 us; 614
    against 1,582 for 8 rows), for a reason of torch's kernels, not of the arithmetic."""
    value, token = row.max(dim=-1)
    return int(token), float(value)


def unusable_row(value: float, from_session_state: bool = False) -> RequestFailed | StateNotUsable | None:
    """The error for a row whose `most_likely` value is `value`, or None when it is usable.

    Who is at fault decides the answer. Given `from_session_state` (the row continues a
    session's stored state, which a client can set by import or PUT) the values came from that
    state: StateNotUsable, a 4xx telling the client to replace or delete it. Otherwise (a fresh
    state, the prefix cache's) the server computed them: RequestFailed, internal."""
    if math.isfinite(value):
        return None
    reason = "holds NaN" if math.isnan(value) else ("holds +inf" if value > 0 else "gives no token a chance")
    if from_session_state:
        return StateNotUsable(f"the model's next-token distribution from this session's state {reason}: the state "
                              "cannot be continued; replace it (PUT /v1/sessions/{id}/state) or delete the session. "
                              "Nothing was committed", param="session_id", code="state_not_usable")
    return RequestFailed(f"the model's next-token distribution for this request {reason}; "
                         "its state may be corrupt. Nothing was committed", code="sampling_failed")


class Sampler:
    """Draws one choice's tokens. `choose` remembers what it drew (for the penalties)."""

    def __init__(self, params: SamplingParams, prompt: list[int] | None = None, index: int = 0):
        self.params = params
        self.generator = torch.Generator()
        self._seed = None if params.seed is None else (int(params.seed) + index) % SEED_MODULUS
        if self._seed is not None:
            self.generator.manual_seed(self._seed)
        else:
            self.generator.seed()
        self._noise: np.random.Generator | None = None  # `perturbed`'s Gumbel noise (a constrained row's)
        self._prompt = list(prompt or [])
        self._counts: torch.Tensor | None = None  # (V,) float32, how often each token was generated
        self._seen: torch.Tensor | None = None  # (V,) bool, in the prompt or generated
        self._bias: torch.Tensor | None = None  # (V,) float32, logit_bias laid out over the vocabulary

    def _biased(self, logits: torch.Tensor) -> torch.Tensor:
        if self._bias is None:
            size = logits.numel()
            outside = sorted(token for token in self.params.logit_bias if not 0 <= token < size)
            if outside:
                raise InvalidInput(f"logit_bias names token ids outside the vocabulary 0..{size - 1}: {outside[:5]}",
                                   param="logit_bias", code="invalid_logit_bias")
            self._bias = torch.zeros(size)
            tokens = list(self.params.logit_bias)
            self._bias[torch.tensor(tokens, dtype=torch.long)] = torch.tensor(
                [self.params.logit_bias[token] for token in tokens], dtype=torch.float32)
        return logits + self._bias

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
        if self._counts is not None and token < self._counts.numel():  # not a constraint's "end here"
            self._counts[token] += 1
            self._seen[token] = True

    @property
    def truncates(self) -> bool:
        """Whether a draw is made from only part of the row (top-k, top-p, min-p); greedy is not."""
        p = self.params
        return not is_greedy(p) and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)

    def perturbed(self, log_probs: torch.Tensor) -> np.ndarray:
        """(V,) float64 scores whose argmax over any set of tokens is a draw from the row restricted to
        that set (for a sampler that does not truncate): the biased, penalised row, divided by
        the temperature and plus Gumbel noise from this choice's generator (the Gumbel-max
        trick); greedy, the row itself. A constrained row takes the argmax, and where the
        constraint forbids it, the argmax over the allowed tokens: no second draw."""
        p = self.params
        logits = self._adjusted(log_probs)
        scores = logits.numpy().astype(np.float64)  # NumPy: a few operations on 256 values, each cheaper than torch's
        if is_greedy(p):
            return scores
        if self._noise is None:  # its own stream, seeded as the torch generator is (seed + choice index)
            self._noise = np.random.default_rng(self._seed)
        uniform = self._noise.random(scores.shape[0])  # in [0, 1): a 0 gives a -inf score, never drawn
        with np.errstate(divide="ignore"):
            return (scores - scores.max()) / p.temperature - np.log(-np.log(uniform))

    def _adjusted(self, log_probs: torch.Tensor) -> torch.Tensor:
        """The row (V,) float32 on the CPU with logit_bias and the penalties applied: the first two
        steps of the order, shared by every way of drawing."""
        logits = log_probs.float().cpu()
        if self.params.logit_bias:
            logits = self._biased(logits)
        if self.params.penalised:
            logits = self._penalise(logits)
        return logits

    def record(self, token: int) -> None:
        """Count a token drawn with `choose(..., record=False)` and kept (for the penalties)."""
        self._record(token)

    def choose(self, log_probs: torch.Tensor, allowed: torch.Tensor | None = None, may_end: bool = False,
               record: bool = True) -> int:
        """log_probs (V,) -> token id. Raises RequestFailed for a row that is no distribution,
        InvalidInput for a logit_bias that does not fit the vocabulary.

        With `allowed` ((V,) bool, a structured-output constraint's mask, server/engine/constraints.py)
        only those tokens may be drawn; with `may_end` too, "end here" is one more choice, token
        V, whose probability after the temperature is the mass the biased, penalised and tempered
        row puts on every forbidden token: what a draw without truncation gives it (the perturbed
        row's argmax is forbidden, scheduler.py `_draw_constrained`), so that top-k, top-p or
        min-p, even one that removes nothing, does not change how often a row ends. The mask goes
        after logit_bias and the penalties and before the temperature, so the rest of the order
        stands; it needs at least one allowed token or `may_end`."""
        p = self.params
        logits = self._adjusted(log_probs)
        if allowed is not None:
            masked = logits.masked_fill(~allowed, float("-inf"))
            if may_end:  # "end here" as token V; with nothing forbidden the model wants nothing the
                # output may not hold: it never ends here
                forbidden = logits.masked_fill(allowed, float("-inf"))
                if is_greedy(p):  # the most likely token is forbidden: end
                    end = forbidden.max()
                else:  # T log sum exp(l / T) over the forbidden tokens, shifted by the row's largest
                    # value so that nothing overflows (logit_bias can lift a value to +100): after the
                    # division by T below, its share of the softmax is exactly their tempered mass
                    top = logits.max()
                    end = top + p.temperature * torch.logsumexp((forbidden - top) / p.temperature, dim=0)
                masked = torch.cat([masked, end.reshape(1)])  # (V + 1,)
            logits = masked
        best, value = most_likely(logits)
        failure = unusable_row(value)
        if failure is not None:
            raise failure
        if is_greedy(p):
            if record:
                self._record(best)
            return best
        # shifted so that the most likely is 0: dividing by any temperature keeps it at 0, and
        # the rest only fall (to -inf at worst), so the softmax below is always defined
        logits = (logits - value) / p.temperature
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < SMALLEST_TOP_P:
            logits = torch.full_like(logits, float("-inf"))
            logits[best] = 0.0
        elif p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            outside = probs.cumsum(-1) - probs >= p.top_p
            outside[0] = False
            sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)  # the most likely always stays
        token = int(torch.multinomial(probs, 1, generator=self.generator))
        if record:
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
