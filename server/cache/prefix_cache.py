"""The prefix-state cache: memory reuse for requests that name no session (docs/design.md 6b).

Most clients (the `openai` client, chat front ends) resend the whole conversation at every turn.
A model's state after tokens t_1..t_N is a deterministic function of those tokens, so the engine
can keep states by the token prefix that produced them and start a request from the longest
cached prefix of its prompt, computing only the rest.

Keys. A scope (model, the API key's owner id, an optional `cache_salt`) seeds a hash chain over
blocks of `block_tokens` tokens, as vLLM keys its KV blocks: h_0 = H(scope), h_k = H(h_{k-1} ||
block k). An entry for the first n tokens is filed under h_floor(n/B) with the key H(h_floor(n/B)
|| the tokens of the open block || n), so entries may sit at any n (the end of a prompt, of a
prompt + completion), not only at block boundaries. A lookup hashes the prompt's blocks once
(O(prompt)) and walks the chain from its longest block down, trying the few entries filed under
each: the first match is the longest cached prefix. Different scopes never share a chain, so
one API key cannot learn (not even by timing) what another key's requests held.

What an entry holds: the state after its n tokens, the next-token distribution, and the
log-probability of each of the n tokens given the ones before (4 bytes a token), so that a hit
can also answer `echo` with per-token log-probs.

Which states may be offered is the engine's business (server/engine/scheduler.py): only states
from which resuming gives what one pass over the same tokens gives. This class keeps the books:
entries by scope and prefix, least recently used first, within a byte budget (the entry's
state and distribution); an entry that does not fit is not kept. Entries are values shared by
every request that hits them: a request starts from an entry's state and never changes it (a
forward returns a new state), so nothing is pinned past the lookup and eviction never waits.

Thread-safe: lookups come from the engine process's reader thread, offers from engines' worker
threads.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from xlserve.server.cache.codec import SessionData

DIGEST_BYTES = 16


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def _token_bytes(tokens: list[int]) -> bytes:
    """Token ids as 4-byte little-endian words: one conversion for a whole prompt."""
    words = array("I", tokens)
    if sys.byteorder != "little":
        words.byteswap()
    return words.tobytes()


def scope_key(model: str, owner: str | None, salt: str | None) -> bytes:
    """The seed of a scope's hash chain: entries of one (model, owner, salt) are never another's."""
    fields = [model, "" if owner is None else owner, "" if salt is None else salt]
    return _digest(b"xlserve-prefix-v1\0", *(f.encode("utf-8") + b"\0" for f in fields))


def block_chain(scope: bytes, tokens: list[int], block_tokens: int) -> list[bytes]:
    """[h_0, h_1, ..., h_K], h_k the chain hash of the first k full blocks (K = len // B)."""
    chain, data, width = [scope], _token_bytes(tokens), 4 * block_tokens
    for start in range(0, 4 * (len(tokens) - block_tokens + 1), width):
        chain.append(_digest(chain[-1], data[start : start + width]))
    return chain


def entry_key(chain: list[bytes], tokens: list[int], n: int, block_tokens: int) -> bytes:
    """The key of the entry for tokens[:n] (chain from `block_chain` over at least n tokens)."""
    k = n // block_tokens
    return _digest(chain[k], _token_bytes(tokens[k * block_tokens : n]), n.to_bytes(8, "little"))


@dataclass
class PrefixHit:
    """The longest cached prefix of a prompt: its `tokens` count, the state after them and the
    log-probability of each of them (None for the first token, which has no context)."""

    tokens: int
    data: SessionData
    logprobs: list[float | None]


@dataclass
class _Entry:
    model: str
    block: bytes  # h_floor(n/B): where the entry is filed
    n: int
    data: SessionData
    logprobs: list[float | None]
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.nbytes = self.data.nbytes() + 4 * len(self.logprobs)


class PrefixCache:
    def __init__(self, budget_bytes: int, block_tokens: int = 16, metrics=None):
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.budget_bytes = max(0, int(budget_bytes))
        self.block_tokens = block_tokens
        self.metrics = metrics
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._by_block: dict[bytes, dict[int, bytes]] = {}  # h_k -> {n: entry key}
        self._bytes = 0

    # -- what the engine asks --------------------------------------------------------------------

    def lookup(self, model: str, scope: bytes, tokens: list[int], limit: int | None = None) -> PrefixHit | None:
        """The longest cached prefix of `tokens` (at most `limit` tokens of it), or None. Counts
        the prompt's tokens as queried and the hit's as hits (vLLM's prefix_cache_queries/hits)."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        hit = None
        if self.budget_bytes > 0 and limit > 0:
            chain = block_chain(scope, tokens[:limit], self.block_tokens)
            with self._lock:
                for k in range(len(chain) - 1, -1, -1):
                    filed = self._by_block.get(chain[k])
                    if not filed:
                        continue
                    for n in sorted((n for n in filed if n <= limit), reverse=True):
                        key = entry_key(chain, tokens, n, self.block_tokens)
                        if filed[n] == key and key in self._entries:
                            entry = self._entries[key]
                            self._entries.move_to_end(key)
                            hit = PrefixHit(entry.n, entry.data, entry.logprobs)
                            break
                    if hit is not None:
                        break
        if self.metrics is not None:
            self.metrics.prefix_cache_queries.labels(model).inc(len(tokens))
            if hit is not None:
                self.metrics.prefix_cache_hits.labels(model).inc(hit.tokens)
        return hit

    def offer(self, model: str, scope: bytes, tokens: list[int], data: SessionData,
              logprobs: list[float | None]) -> bool:
        """Keep the state after `tokens` (data.tokens == len(tokens)); False when it is not kept
        (larger than the whole budget, or nothing to key). Evicts least recently used entries."""
        n = len(tokens)
        if n == 0 or data.tokens != n or len(logprobs) != n or self.budget_bytes == 0:
            return False
        chain = block_chain(scope, tokens, self.block_tokens)
        key = entry_key(chain, tokens, n, self.block_tokens)
        entry = _Entry(model, chain[n // self.block_tokens], n, data, list(logprobs))
        if entry.nbytes > self.budget_bytes:
            return False
        evicted = 0
        with self._lock:
            if key in self._entries:  # the same prefix again: the same state (to float rounding)
                self._entries.move_to_end(key)
                return True
            while self._entries and self._bytes + entry.nbytes > self.budget_bytes:
                self._drop(next(iter(self._entries)))
                evicted += 1
            self._entries[key] = entry
            self._by_block.setdefault(entry.block, {})[n] = key
            self._bytes += entry.nbytes
        if self.metrics is not None and evicted:
            self.metrics.prefix_cache_evictions.labels(model).inc(evicted)
        self._publish()
        return True

    # -- books -----------------------------------------------------------------------------------

    def _drop(self, key: bytes) -> None:
        """Under the lock."""
        entry = self._entries.pop(key)
        filed = self._by_block.get(entry.block)
        if filed is not None and filed.get(entry.n) == key:
            del filed[entry.n]
            if not filed:
                del self._by_block[entry.block]
        self._bytes -= entry.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_block.clear()
            self._bytes = 0
        self._publish()

    def usage(self) -> dict[str, tuple[int, int]]:
        """model -> (entries, bytes)."""
        with self._lock:
            counts: dict[str, list[int]] = {}
            for entry in self._entries.values():
                row = counts.setdefault(entry.model, [0, 0])
                row[0] += 1
                row[1] += entry.nbytes
        return {model: (row[0], row[1]) for model, row in counts.items()}

    def _publish(self) -> None:
        if self.metrics is None:
            return
        usage = self.usage()
        for model in set(usage) | self._published:
            entries, nbytes = usage.get(model, (0, 0))
            self.metrics.prefix_cache_entries.labels(model, "device").set(entries)
            self.metrics.prefix_cache_bytes.labels(model, "device").set(nbytes)
        self._published = set(usage) | self._published

    _published: set = frozenset()
