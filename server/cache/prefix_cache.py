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

Tiers. Entries live on the model's device, within `budget_bytes`. With Redis
(XLSERVE_REDIS_URL), every entry kept is also written to Redis (`RedisPrefixStore`, stores.py)
by a writer thread of its own, never by the engine's worker thread, and a lookup that finds
nothing longer locally asks Redis, in one round trip for the whole chain, so one replica hits
on the states another stored. Redis entries expire a day after their last use and may be
evicted by Redis's own maxmemory policy; a Redis that is slow or down costs reuse, never a
request: the lookup gives up after the store's timeout and the request computes its prompt. An
entry read from Redis is verified (checksum, and the model's own state checks) before use.

Thread-safe: lookups come from the engine process's reader or session-op threads, offers from
engines' worker threads.
"""

from __future__ import annotations

import base64
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from xlserve.server.cache.codec import CorruptState, SessionData, decode, encode, session_data
from xlserve.server.cache.prefix_keys import block_chain, entry_key, scope_key  # noqa: F401  (scope_key: re-exported)
from xlserve.server.cache.stores import RedisPrefixStore, StoreUnavailable

log = logging.getLogger("xlserve.cache")

REMOTE_WRITES_QUEUED = 64  # entries waiting for the Redis writer; beyond, new ones are not shared


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


def encode_entry(model: str, data: SessionData, logprobs: list[float | None]) -> bytes:
    """An entry as the session codec's safetensors bytes; the tokens' log-probs ride in the
    (checksummed) metadata as float32 words, NaN for the first token's None."""
    words = torch.tensor([float("nan") if lp is None else lp for lp in logprobs], dtype=torch.float32)
    meta = {"kind": "prefix", "model": model, "logprobs": base64.b64encode(words.numpy().tobytes()).decode()}
    return encode(data, meta)


def decode_entry(blob: bytes, model: str, state_class, device) -> tuple[SessionData, list[float | None]]:
    """Inverse of encode_entry; CorruptState or ValueError when the bytes are not such an entry."""
    meta, tensors, next_log_probs = decode(blob)
    if meta.get("kind") != "prefix" or meta.get("model") != model:
        raise CorruptState(f"not a prefix entry of model {model!r}")
    data = session_data(state_class, meta, tensors, next_log_probs).to(device)
    words = torch.frombuffer(bytearray(base64.b64decode(meta.get("logprobs", ""))), dtype=torch.float32)
    logprobs = [None if value != value else value for value in words.tolist()]  # NaN: no context
    if len(logprobs) != data.tokens:
        raise CorruptState(f"a prefix entry of {data.tokens} tokens with {len(logprobs)} log-probs")
    return data, logprobs


class PrefixCache:
    def __init__(self, budget_bytes: int, block_tokens: int = 16, metrics=None, remote: RedisPrefixStore | None = None):
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.budget_bytes = max(0, int(budget_bytes))
        self.block_tokens = block_tokens
        self.metrics = metrics
        self.remote = remote
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._by_block: dict[bytes, dict[int, bytes]] = {}  # h_k -> {n: entry key}
        self._bytes = 0
        self._writes: queue.Queue = queue.Queue(maxsize=REMOTE_WRITES_QUEUED)
        if remote is not None:
            threading.Thread(target=self._write_remote, name="prefix-cache-redis", daemon=True).start()

    @classmethod
    def from_settings(cls, settings, metrics=None) -> "PrefixCache | None":
        if settings.prefix_cache_bytes <= 0:
            return None
        remote = None
        if settings.redis_url:
            remote = RedisPrefixStore(settings.redis_url, timeout_s=settings.store_timeout_seconds,
                                      ttl_s=settings.prefix_cache_redis_ttl_seconds)
        return cls(settings.prefix_cache_bytes, settings.prefix_cache_block_tokens, metrics, remote)

    # -- what the engine asks --------------------------------------------------------------------

    def lookup(self, model: str, scope: bytes, tokens: list[int], limit: int | None = None,
               restore: Callable[[bytes], tuple[SessionData, list[float | None]]] | None = None) -> PrefixHit | None:
        """The longest cached prefix of `tokens` (at most `limit` tokens of it), or None. With
        Redis and `restore` (bytes -> checked entry, or raise), entries longer than the local
        one are looked for there too. Counts the prompt's tokens as queried and the hit's as
        hits (vLLM's prefix_cache_queries/hits)."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        hit = None
        if self.budget_bytes > 0 and limit > 0:
            chain = block_chain(scope, tokens[:limit], self.block_tokens)
            hit = self._lookup_local(chain, tokens, limit)
            if self.remote is not None and restore is not None:
                hit = self._lookup_remote(model, scope, chain, tokens, limit, hit, restore) or hit
        if self.metrics is not None:
            self.metrics.prefix_cache_queries.labels(model).inc(len(tokens))
            if hit is not None:
                self.metrics.prefix_cache_hits.labels(model).inc(hit.tokens)
        return hit

    def _lookup_local(self, chain: list[bytes], tokens: list[int], limit: int) -> PrefixHit | None:
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
                        return PrefixHit(entry.n, entry.data, entry.logprobs)
        return None

    def _lookup_remote(self, model: str, scope: bytes, chain: list[bytes], tokens: list[int], limit: int,
                       local: PrefixHit | None, restore) -> PrefixHit | None:
        """An entry in Redis longer than the `local` hit, checked and kept locally, or None."""
        shortest = 0 if local is None else local.tokens + 1
        first_block = shortest // self.block_tokens
        blocks = chain[first_block:]
        try:
            filed = self.remote.filed([block.hex() for block in blocks])
            candidates = sorted(((n, key) for entries in filed for n, key in entries.items()
                                 if shortest <= n <= limit), reverse=True)
            for n, key in candidates[:4]:  # a few tries: entries may have expired since the index said so
                if key != entry_key(chain, tokens, n, self.block_tokens).hex():
                    continue
                blob = self.remote.get_entry(key)
                if blob is None:
                    continue
                try:
                    data, logprobs = restore(blob)
                except (CorruptState, ValueError) as error:
                    log.warning("prefix cache: an entry in Redis was refused (%s)", error)
                    continue
                if data.tokens != n:
                    continue
                self.offer(model, scope, tokens[:n], data, logprobs, share=False)
                return PrefixHit(n, data, logprobs)
        except StoreUnavailable as error:  # reuse lost, the request goes on
            log.warning("prefix cache: Redis lookup failed, computing the prompt (%s)", error)
        return None

    def offer(self, model: str, scope: bytes, tokens: list[int], data: SessionData,
              logprobs: list[float | None], share: bool = True) -> bool:
        """Keep the state after `tokens` (data.tokens == len(tokens)); False when it is not kept
        (larger than the whole budget, or nothing to key). Evicts least recently used entries.
        With Redis and `share`, the entry is also queued for the Redis writer."""
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
        if self.remote is not None and share:
            try:
                self._writes.put_nowait((entry.block.hex(), n, key.hex(), model, data, entry.logprobs))
            except queue.Full:
                log.warning("prefix cache: the Redis writer is behind; an entry stays local")
        self._publish()
        return True

    def _write_remote(self) -> None:
        """The Redis writer thread: encodes and writes queued entries, one at a time."""
        while True:
            block, n, key, model, data, logprobs = self._writes.get()
            try:
                self.remote.put_entry(block, n, key, encode_entry(model, data, logprobs))
            except Exception as error:  # StoreUnavailable, or a state that cannot be encoded
                log.warning("prefix cache: an entry was not written to Redis (%s)", error)
            finally:
                self._writes.task_done()

    def flush_remote(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued Redis writes are done (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._writes.unfinished_tasks

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
