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

Tiers and budgets. Entries live in the sessions' tiers: on the model's device, in host RAM and
on disk (files under `directory`, a cache wiped at start: an entry names its model, not the
weights it was made with), each tier within a cap of its own (`budget_bytes` on the device,
`host_bytes`, `disk_bytes`) and, with `sessions` (the session cache's manager), within the room
sessions leave there: one budget per tier, shared, sessions first. Sessions that need room take
it back (`release`, the manager's `Reclaim`), which drops this cache's least recently used
entries of that tier. An entry pushed out of a tier moves to the next one below that has room
(device → host → disk), else it is dropped. A hit in host RAM or on disk is brought back to the
device. Disk writes are not fsynced: a lost entry costs reuse, never a result. They are made by a
writer thread of their own, never by the thread that offers (an engine's worker, between two
decoding steps of every stream of its model: a real-size state takes a large fraction of a second
to encode and write); until its file is written an entry on disk keeps its state in host RAM and
is found there, and with `DISK_WRITES_BYTES` of entries waiting, one more pushed to disk is
dropped (reuse lost, no stall). A state's copy from the device to host RAM (an entry pushed down,
or kept below the device at once) is booked under the lock and made outside it, by the thread
that booked it, before it returns (`_copy_down`): the lock guards the books only, so a lookup
or the session cache's `release` (called under the session cache's own lock) never waits
behind a copy of hundreds of MB. Until its copy lands an entry keeps its device state and is
found with it.

With Redis (XLSERVE_REDIS_URL), every entry kept is also written to Redis (`RedisPrefixStore`,
stores.py) by a writer thread of its own, never by the engine's worker thread, and a lookup
that finds nothing longer locally asks Redis, in one round trip for the whole chain, so one
replica hits on the states another stored. Redis entries expire a day after their last use and
may be evicted by Redis's own maxmemory policy; a Redis that is slow or down costs reuse, never
a request: the lookup gives up after the store's timeout and the request computes its prompt.
An entry read from Redis or from disk is verified (checksum, and the model's own state checks)
before use.

Thread-safe: lookups come from the engine process's reader or session-op threads, offers from
engines' worker threads.
"""

from __future__ import annotations

import base64
import logging
import os
import queue
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from xlserve.models.torch_threads import start_one_threaded
from xlserve.server.cache.codec import CorruptState, SessionData, decode, encode, session_data
from xlserve.server.cache.prefix_keys import block_chain, entry_key, scope_key  # noqa: F401  (scope_key: re-exported)
from xlserve.server.cache.stores import RedisPrefixStore, StoreUnavailable

log = logging.getLogger("xlserve.cache")

REMOTE_WRITES_QUEUED = 64  # entries waiting for the Redis writer; beyond, new ones are not shared
# and bytes of them: each holds its state where the request left it (the model's device) until it is
# written, outside every budget; beyond, a new entry is not shared (one is always taken)
REMOTE_WRITES_BYTES = 1 << 30
# bytes of entries waiting for the disk writer, each holding its state in host RAM meanwhile; beyond,
# an entry pushed to disk is dropped (one entry is always taken, whatever its size)
DISK_WRITES_BYTES = 1 << 30
# after Redis failed a lookup or a write, the cache goes without it for this long: a Redis that is
# down or slow would otherwise add its store timeout to every request without a session
REMOTE_QUIET_SECONDS = 30.0
# entries are shared only while Redis holds less than this part of its maxmemory: the sessions'
# commits need the rest (with `noeviction`, a Redis full of entries refuses every commit for the
# entries' TTL; with an eviction policy it would evict sessions). Redis's own report, read at most
# every REDIS_MEMORY_SECONDS; without a maxmemory, nothing bounds Redis (deploy/README.md sets one)
REDIS_SHARE_OF_MAXMEMORY = 0.5
REDIS_MEMORY_SECONDS = 10.0


@dataclass
class PrefixHit:
    """The longest cached prefix of a prompt: its `tokens` count, the state after them and the
    log-probability of each of them (None for the first token, which has no context)."""

    tokens: int
    data: SessionData
    logprobs: list[float | None]


PREFIX_TIERS = ("device", "host", "disk")


@dataclass
class _Entry:
    key: bytes  # entry_key: what it is found by
    model: str
    block: bytes  # h_floor(n/B): where the entry is filed
    n: int
    data: SessionData | None  # None while on disk (the file holds it)
    logprobs: list[float | None] | None
    nbytes: int  # the state, its distribution and 4 bytes a token, in whichever tier
    device: torch.device | None  # where the model runs: a promoted entry goes back there
    tier: str = "device"
    writing: int = 0  # on disk with its file not yet written: the id of the write queued for it (else 0)
    copying: int = 0  # below the device with its state still there: the id of its copy to host RAM (else 0)


def _entry_bytes(data: SessionData, logprobs: list) -> int:
    return data.nbytes() + 4 * len(logprobs)


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
    def __init__(self, budget_bytes: int, block_tokens: int = 16, metrics=None, remote: RedisPrefixStore | None = None,
                 host_bytes: int = 0, disk_bytes: int = 0, directory: str | Path | None = None, sessions=None,
                 remote_holds_sessions: bool = True):
        """`budget_bytes`, `host_bytes`, `disk_bytes`: this cache's cap on each tier (disk only
        with a `directory`); `sessions`: the session cache's manager, whose tiers' free room
        bounds each cap (None: the caps alone). `remote_holds_sessions`: `remote` is the sessions'
        Redis, whose maxmemory entries may fill only up to REDIS_SHARE_OF_MAXMEMORY; a Redis of
        their own evicts them by its own policy (deploy/README.md: allkeys-lru)."""
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.budget_bytes = max(0, int(budget_bytes))
        self.caps = {"device": self.budget_bytes, "host": max(0, int(host_bytes)),
                     "disk": max(0, int(disk_bytes)) if directory is not None else 0}
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:  # last run's entries: their weights may have changed since
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory.mkdir(parents=True, exist_ok=True)
        self.sessions = sessions
        self.block_tokens = block_tokens
        self.metrics = metrics
        self.remote = remote
        self.remote_holds_sessions = remote_holds_sessions
        self._lock = threading.Lock()
        self._publishing = threading.Lock()  # `_publish`, outside the books' lock
        self._tiers: dict[str, OrderedDict[bytes, _Entry]] = {t: OrderedDict() for t in PREFIX_TIERS}  # LRU first
        self._bytes = {t: 0 for t in PREFIX_TIERS}
        self._index: dict[bytes, _Entry] = {}
        self._by_block: dict[bytes, dict[int, bytes]] = {}  # h_k -> {n: entry key}
        self._evictions: dict[str, int] = {}  # model -> entries dropped, counted outside the lock
        self._writes: queue.Queue = queue.Queue(maxsize=REMOTE_WRITES_QUEUED)
        self._remote_writes_bytes = 0  # of the entries queued for the Redis writer (under the lock)
        self._remote_quiet_until = 0.0  # monotonic: Redis is not asked before (REMOTE_QUIET_SECONDS)
        # (read at, [(used, maxmemory) of each node]): the writer's, `_room_in_redis`
        self._redis_memory: tuple[float, list[tuple[int, int]]] | None = None
        if remote is not None:
            start_one_threaded(self._write_remote, "prefix-cache-redis")
        self._disk_writes: queue.Queue = queue.Queue()
        self._write_ids = 0
        # copies to host RAM booked under the lock, made outside it by the thread that booked them
        # (`_copy_down`): .copies, that thread's [(entry, copy id, its state, the disk write it waits for or 0)]
        self._booked = threading.local()
        self._copy_ids = 0
        self._disk_writes_bytes = 0  # of the entries queued for the disk writer (under the lock)
        if self.caps["disk"]:
            start_one_threaded(self._write_disk, "prefix-cache-disk")

    @classmethod
    def from_settings(cls, settings, session_settings, metrics=None, sessions=None) -> "PrefixCache | None":
        """From the prefix cache's group of the server's settings (`settings.prefix_cache`) and the
        session cache's (`settings.cache`: the state directory it shares, and its Redis unless
        XLSERVE_PREFIX_CACHE_REDIS_URL names another or `none`);
        None when its device cap is 0. Duck-typed: the cache imports nothing of server/settings.py."""
        if settings.bytes <= 0:
            return None
        remote = None
        url = getattr(settings, "redis_url", "") or session_settings.redis_url  # "none": shared nowhere
        if url and url != "none":
            remote = RedisPrefixStore(url, timeout_s=session_settings.store_timeout_seconds,
                                      ttl_s=settings.redis_ttl_seconds)
        return cls(settings.bytes, settings.block_tokens, metrics, remote,
                   host_bytes=settings.host_bytes, disk_bytes=settings.disk_bytes,
                   directory=Path(session_settings.state_dir) / "prefix-cache", sessions=sessions,
                   remote_holds_sessions=url == session_settings.redis_url)

    # -- the shared budgets ------------------------------------------------------------------------

    def held(self, tier: str) -> int:
        """Bytes this cache holds in `tier` (the session cache's manager asks; no lock, an int)."""
        return self._bytes.get(tier, 0)

    def limit(self, tier: str) -> int:
        """What this cache may hold in `tier` now: its cap, and never more than sessions leave."""
        cap = self.caps.get(tier, 0)
        if self.sessions is None or tier not in self.sessions.budgets:
            return cap
        free = self.sessions.free(tier)
        return cap if free is None else max(0, min(cap, free))

    def release(self, tier: str, nbytes: int) -> None:
        """Give at least `nbytes` of `tier` back to the sessions, dropping least recently used
        entries there (called under the session cache's lock: takes only this cache's lock)."""
        with self._lock:
            entries = self._tiers.get(tier, {})
            freed = 0
            while entries and freed < nbytes:
                entry = entries[next(iter(entries))]
                freed += entry.nbytes
                self._drop(entry, counted=True)
        self._count_evictions()
        self._publish()

    # -- what the engine asks --------------------------------------------------------------------

    def lookup(self, model: str, scope: bytes, tokens: list[int], limit: int | None = None,
               restore: Callable[[bytes], tuple[SessionData, list[float | None]]] | None = None) -> PrefixHit | None:
        """The longest cached prefix of `tokens` (at most `limit` tokens of it), or None. With
        `restore` (bytes -> checked entry, or raise), entries on disk count, and with Redis,
        entries longer than the local one are looked for there too. Counts the prompt's tokens
        as queried and the hit's as hits (vLLM's prefix_cache_queries/hits)."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        hit = None
        if any(self.caps.values()) and limit > 0:
            chain = block_chain(scope, tokens[:limit], self.block_tokens)
            candidates = self._candidates(chain, tokens, limit, on_disk=restore is not None)
            # Redis is asked for a longer entry before a local one is read back and moved up: a
            # replica's local entry is often a turn behind the one another replica shared, and
            # bringing it back (237 MB read and checked at real size, another entry pushed down)
            # only to take Redis's instead cost both
            local = candidates[0].n if candidates else 0
            if (self.remote is not None and restore is not None and local < limit
                    and time.monotonic() >= self._remote_quiet_until):
                try:
                    hit = self._lookup_remote(model, scope, chain, tokens, limit, local, restore)
                except Exception as error:  # whatever it is, the local hit stands and the request goes on
                    log.warning("prefix cache: the Redis lookup failed (%s: %s)", type(error).__name__, error)
            if hit is None:
                hit = self._lookup_local(candidates, restore)
        if self.metrics is not None:
            self.metrics.prefix_cache_queries.labels(model).inc(len(tokens))
            if hit is not None:
                self.metrics.prefix_cache_hits.labels(model).inc(hit.tokens)
        return hit

    def resident(self) -> set[int]:
        """The ids of the states its device and host entries hold: a hit's state that is one of
        them is the cache's memory, counted on its books (Engine._hits_waiting_bytes)."""
        with self._lock:
            return {id(entry.data) for tier in ("device", "host") for entry in self._tiers[tier].values()
                    if entry.data is not None}

    def missed(self, model: str, tokens: int) -> None:
        """Count a prompt of `tokens` tokens that was not looked up (echo with alternatives, which
        no entry answers; a lookup its engine skipped) as queried and missed, so that the hit
        rate (hits / queries) reads what the prompts got."""
        if self.metrics is not None:
            self.metrics.prefix_cache_queries.labels(model).inc(tokens)

    def _lookup_local(self, candidates: list[_Entry], restore) -> PrefixHit | None:
        """The first of `candidates` (longest first) that is still there, brought back."""
        for entry in candidates:
            hit = self._bring_back(entry, restore)
            if hit is not None:
                return hit
        return None

    def _candidates(self, chain: list[bytes], tokens: list[int], limit: int, on_disk: bool) -> list[_Entry]:
        """Entries that are prefixes of `tokens`, longest first."""
        found = []
        with self._lock:
            for k in range(len(chain) - 1, -1, -1):
                filed = self._by_block.get(chain[k])
                if not filed:
                    continue
                for n in sorted((n for n in filed if n <= limit), reverse=True):
                    key = entry_key(chain, tokens, n, self.block_tokens)
                    entry = self._index.get(key) if filed[n] == key else None
                    if entry is not None and (entry.tier != "disk" or on_disk):
                        found.append(entry)
        return found

    def _bring_back(self, entry: _Entry, restore) -> PrefixHit | None:
        """A hit on `entry`, its state on the model's device: a device entry as it is; one in
        host RAM or on disk is read back (a disk file checked by `restore`) and moved up to the
        device when there is room. None when it vanished or its file was refused."""
        with self._lock:
            if self._index.get(entry.key) is not entry:
                return None
            if entry.tier == "device":
                self._tiers["device"].move_to_end(entry.key)
                return PrefixHit(entry.n, entry.data, entry.logprobs)
            tier, data, logprobs = entry.tier, entry.data, entry.logprobs
        # on disk: its file, read back and checked; an entry whose file the disk writer has not
        # written yet still holds its state in host RAM, taken from there as a host entry's
        if tier == "disk" and data is None:
            try:
                data, logprobs = restore(self._path(entry).read_bytes())
            except (OSError, CorruptState, ValueError) as error:
                with self._lock:  # refused, unless another lookup of it moved it up meanwhile (and took its file)
                    refused = self._index.get(entry.key) is entry and entry.tier == "disk" and entry.data is None
                    if refused:
                        log.warning("prefix cache: an entry on disk was refused (%s)", error)
                        self._drop(entry, counted=True)
                if not refused:
                    return self._bring_back(entry, restore)  # where the other lookup put it
                self._count_evictions()
                return None
        else:
            data = data.to(entry.device) if entry.device is not None else data
        with self._lock:
            if self._index.get(entry.key) is entry and entry.tier == tier:
                self._move(entry, tier, "device", data, logprobs)
        self._copy_down()  # of the entries its room pushed down
        self._count_evictions()
        self._publish()
        return PrefixHit(entry.n, data, logprobs)

    def _lookup_remote(self, model: str, scope: bytes, chain: list[bytes], tokens: list[int], limit: int,
                       local: int, restore) -> PrefixHit | None:
        """An entry in Redis longer than `local` tokens (the longest local entry's), checked and
        kept locally, or None."""
        shortest = local + 1
        first_block = shortest // self.block_tokens
        blocks = chain[first_block:]
        try:
            names = [block.hex() for block in blocks]
            filed = self.remote.filed(names)
            # the entries of this prompt (a block also files other prompts' entries: the same
            # tokens up to it, others after), longest first
            candidates = sorted(((n, key, block) for block, entries in zip(names, filed) for n, key in entries.items()
                                 if shortest <= n <= limit
                                 and key == entry_key(chain, tokens, n, self.block_tokens).hex()), reverse=True)
            for n, key, block in candidates[:4]:  # a few tries: entries may have expired since the index said so
                blob = self.remote.get_entry(key)
                if blob is None:
                    continue
                try:
                    data, logprobs = restore(blob)
                    if data.tokens != n:
                        raise ValueError(f"it holds {data.tokens} tokens, filed as {n}")
                except (CorruptState, ValueError) as error:  # damaged or foreign: it goes, never to cost a lookup again
                    log.warning("prefix cache: an entry in Redis was refused and removed (%s)", error)
                    self.remote.drop_entry(key, block, n)
                    continue
                except Exception as error:  # this replica's trouble (the device out of memory): the entry stays
                    log.warning("prefix cache: an entry in Redis could not be taken here (%s: %s)",
                                type(error).__name__, error)
                    continue
                try:  # a use: its TTL and its block's renewed, once it proved good
                    self.remote.touch_entry(key, block)
                except StoreUnavailable as error:  # the hit stands; the entry expires a day after its last renewal
                    log.warning("prefix cache: an entry's TTL in Redis was not renewed (%s)", error)
                self.offer(model, scope, tokens[:n], data, logprobs, share=False)
                return PrefixHit(n, data, logprobs)
        except StoreUnavailable as error:  # reuse lost, the request goes on; and the next ones go without Redis
            self._remote_quiet_until = time.monotonic() + REMOTE_QUIET_SECONDS
            log.warning("prefix cache: Redis lookup failed, computing the prompt; Redis is not asked for %gs (%s)",
                        REMOTE_QUIET_SECONDS, error)
        return None

    def offer(self, model: str, scope: bytes, tokens: list[int], data: SessionData,
              logprobs: list[float | None], share: bool = True,
              copy: Callable[[SessionData], SessionData] | None = None) -> bool:
        """Keep the state after `tokens` (data.tokens == len(tokens)); False when it is not kept
        (no tier has room for it, or nothing to key). Pushes least recently used entries down a
        tier. With Redis and `share`, the entry is also queued for the Redis writer. With `copy`
        (SessionData.clone, or .compact), what is kept is copy(data), made only when the prefix is
        not cached already and outside the cache's lock (a whole state: 237 MB at real size)."""
        n = len(tokens)
        if n == 0 or data.tokens != n or len(logprobs) != n or not any(self.caps.values()):
            return False
        chain = block_chain(scope, tokens, self.block_tokens)
        key = entry_key(chain, tokens, n, self.block_tokens)
        if copy is not None:
            with self._lock:
                if self._seen_again(key):
                    return True
                # no tier could take it (the sessions hold the room, or a cap is below one state):
                # not copied for nothing, on the engine's step thread (93 ms of 237 MB)
                nbytes = _entry_bytes(data, logprobs)
                if not any(self.limit(tier) >= nbytes for tier in PREFIX_TIERS):
                    return False
            data = copy(data)
        entry = _Entry(key, model, chain[n // self.block_tokens], n, data, list(logprobs),
                       _entry_bytes(data, logprobs), _device_of(data))
        with self._lock:
            if self._seen_again(key):
                return True
            kept = False
            for tier in PREFIX_TIERS:
                if self._make_room(tier, entry.nbytes):
                    kept = self._place(key, entry, tier, data, entry.logprobs)  # False: dropped on the way to disk
                    break
            if kept and self.remote is not None and share:
                queued = self._remote_writes_bytes
                behind = bool(queued) and queued + entry.nbytes > REMOTE_WRITES_BYTES  # in bytes waiting
                if not behind:
                    try:
                        self._writes.put_nowait((entry.block.hex(), n, key.hex(), model, data, entry.logprobs,
                                                 entry.nbytes))
                        self._remote_writes_bytes += entry.nbytes
                    except queue.Full:  # in entries waiting
                        behind = True
                if behind:
                    log.warning("prefix cache: the Redis writer is behind; an entry stays local")
        self._copy_down()
        kept = kept and self._index.get(key) is entry  # a copy down that failed dropped it
        self._count_evictions()
        self._publish()
        return kept

    def _write_remote(self) -> None:
        """The Redis writer thread: encodes and writes queued entries, one at a time."""
        while True:
            block, n, key, model, data, logprobs, nbytes = self._writes.get()
            try:
                if time.monotonic() >= self._remote_quiet_until and (not self.remote_holds_sessions
                                                                     or self._room_in_redis(nbytes)):
                    self.remote.put_entry(block, n, key, encode_entry(model, data, logprobs))
            except StoreUnavailable as error:  # down, slow or full (StoreFull): the entries wait for nobody
                self._remote_quiet_until = time.monotonic() + REMOTE_QUIET_SECONDS
                log.warning("prefix cache: an entry was not written to Redis; none is for %gs (%s)",
                            REMOTE_QUIET_SECONDS, error)
            except Exception as error:  # a state that cannot be encoded
                log.warning("prefix cache: an entry was not written to Redis (%s)", error)
            finally:
                del data  # the state it held, wherever it lies, is not kept past its write
                with self._lock:
                    self._remote_writes_bytes -= nbytes
                self._writes.task_done()

    def _room_in_redis(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` may be shared: Redis would still hold less than
        REDIS_SHARE_OF_MAXMEMORY of its maxmemory (its report at most REDIS_MEMORY_SECONDS old,
        plus what this writer wrote since). The writer thread only."""
        now = time.monotonic()
        fresh = self._redis_memory is None or now - self._redis_memory[0] > REDIS_MEMORY_SECONDS
        if fresh:
            self._redis_memory = (now, self.remote.memory())
        read_at, nodes = self._redis_memory
        # a cluster's entries spread over every primary: each must keep room for its sessions
        full = [(used, most) for used, most in nodes if most and used + nbytes > REDIS_SHARE_OF_MAXMEMORY * most]
        if full:
            if fresh:  # said once a reading, not for every entry
                log.warning("prefix cache: Redis holds %d of its %d bytes of maxmemory; entries are not shared while "
                            "it holds more than %g of it (the sessions need the rest)", *full[0],
                            REDIS_SHARE_OF_MAXMEMORY)
            return False
        self._redis_memory = (read_at, [(used + nbytes, most) for used, most in nodes])
        return True

    def _write_disk(self) -> None:
        """The disk writer thread: encodes and writes queued entries, one at a time, in the order
        their copies to host RAM landed (`_copy_down`); then, under the lock, the entry lets go
        of its host copy, or, moved or dropped meanwhile (or placed on disk again: a later write
        of the same file follows), the file goes. An entry whose file cannot be written is
        dropped."""
        while True:
            entry, write_id, data, logprobs = self._disk_writes.get()
            try:
                with self._lock:  # moved, dropped or written again since: not worth encoding
                    current = (self._index.get(entry.key) is entry and entry.tier == "disk"
                               and entry.writing == write_id)
                    if not current:
                        self._disk_writes_bytes -= entry.nbytes
                        continue
                path = self._path(entry)
                temporary = path.with_suffix(".tmp")
                try:
                    temporary.write_bytes(encode_entry(entry.model, data, logprobs))
                    os.replace(temporary, path)
                    written = True
                except Exception as error:  # a full disk, or anything else: costs reuse only, never the writer
                    temporary.unlink(missing_ok=True)
                    log.warning("prefix cache: an entry could not be written to disk (%s)", error)
                    written = False
                with self._lock:
                    self._disk_writes_bytes -= entry.nbytes
                    if self._index.get(entry.key) is entry and entry.tier == "disk" and entry.writing == write_id:
                        if written:
                            entry.data, entry.logprobs, entry.writing = None, None, 0
                        else:
                            self._drop(entry, counted=True)
                    elif written:
                        path.unlink(missing_ok=True)
            finally:
                self._disk_writes.task_done()
            self._count_evictions()
            self._publish()

    def flush_disk(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued disk writes are done (tests); False on timeout."""
        return _drained(self._disk_writes, timeout_s)

    def flush_remote(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued Redis writes are done (tests, shutdown); False on timeout."""
        return _drained(self._writes, timeout_s)

    # -- books (every method below runs under the lock) -------------------------------------------

    def _path(self, entry: _Entry) -> Path:
        return self.directory / (entry.key.hex() + ".safetensors")

    def _make_room(self, tier: str, nbytes: int) -> bool:
        """Room for `nbytes` in `tier`, pushing its least recently used entries down; False
        (nothing moved) when the tier cannot hold that much now."""
        limit = self.limit(tier)
        if nbytes > limit:
            return False
        entries = self._tiers[tier]
        while entries and self._bytes[tier] + nbytes > limit:
            self._push_down(entries[next(iter(entries))])
        return self._bytes[tier] + nbytes <= limit

    def _push_down(self, entry: _Entry) -> None:
        """Move `entry` to the nearest tier below with room, or drop it."""
        for tier in PREFIX_TIERS[PREFIX_TIERS.index(entry.tier) + 1:]:
            if self._move(entry, entry.tier, tier, entry.data, entry.logprobs):
                return
            if self._index.get(entry.key) is not entry:  # dropped on its way to disk (the disk writer is behind)
                return
        self._drop(entry, counted=True)

    def _move(self, entry: _Entry, source: str, target: str, data: SessionData | None, logprobs) -> bool:
        """Take `entry` from `source` and place it in `target` (data: its state, wherever it is
        now). False when `target` has no room (the entry stays in `source`) or it was dropped on
        its way to disk (the disk writer is behind). While it moves, the room made for it never
        evicts it."""
        key = entry.key
        del self._tiers[source][key]
        self._bytes[source] -= entry.nbytes
        if not self._make_room(target, entry.nbytes):
            self._tiers[source][key] = entry
            self._bytes[source] += entry.nbytes
            return False
        if source == "disk":
            self._path(entry).unlink(missing_ok=True)
        return self._place(key, entry, target, data, logprobs)

    def _place(self, key: bytes, entry: _Entry, tier: str, data: SessionData, logprobs) -> bool:
        """File `entry` in `tier` with its state `data` (wherever it is now). Below the device the
        copy to host RAM is only booked here (this thread's `_bookings`), and made by
        `_copy_down`; on disk the file is written by the disk writer (`_write_disk`) once that
        copy is made, the entry holding its state in memory till then."""
        entry.writing = entry.copying = 0
        if tier == "disk":
            if self._disk_writes_bytes and self._disk_writes_bytes + entry.nbytes > DISK_WRITES_BYTES:
                log.warning("prefix cache: the disk writer is behind; an entry is dropped")
                self._index.pop(key, None)
                self._unfile(entry, key)
                self._evictions[entry.model] = self._evictions.get(entry.model, 0) + 1
                return False
            self._write_ids += 1
            self._disk_writes_bytes += entry.nbytes  # booked now: the writer's queue bounds what waits
            entry.writing = self._write_ids
        if tier != "device":
            self._copy_ids += 1
            entry.copying = self._copy_ids
            self._bookings().append((entry, entry.copying, data, entry.writing))
        entry.data, entry.logprobs = data, logprobs
        entry.tier = tier
        self._tiers[tier][key] = entry
        self._bytes[tier] += entry.nbytes
        self._index[key] = entry
        filed = self._by_block.setdefault(entry.block, {})
        shadowed = self._index.get(filed.get(entry.n, key))
        if shadowed is not None and shadowed is not entry:  # the same block and length, other open tokens:
            self._drop(shadowed, counted=True)  # one entry per (block, n) can be found, so the other one goes
        self._by_block.setdefault(entry.block, {})[entry.n] = key
        return True

    def _bookings(self) -> list:
        """This thread's copies booked and not yet made."""
        booked = getattr(self._booked, "copies", None)
        if booked is None:
            booked = self._booked.copies = []
        return booked

    def _copy_down(self) -> None:
        """Make the copies to host RAM this thread booked (`_place`), outside the lock, one at a
        time (its caller counts the evictions after it): a copy is made only while its entry still waits for it (not moved, dropped or
        placed again since), lands under the lock if it still does, and goes to the disk writer
        when the entry is on disk. Each device state is let go as soon as its copy lands. An
        entry whose copy fails (host memory) is dropped: it costs reuse, never the request that
        offered or looked up."""
        booked, interrupted = self._bookings(), None
        while booked:
            entry, copy_id, data, write_id = booked.pop(0)
            with self._lock:
                current = self._index.get(entry.key) is entry and entry.copying == copy_id
            held = error = None
            if current:
                try:
                    held = data.to("cpu")
                except BaseException as failure:  # noqa: BLE001 - the books are kept first, then re-raised if not an Exception
                    error = failure
                    if not isinstance(failure, Exception):
                        interrupted = failure
            del data
            with self._lock:
                current = self._index.get(entry.key) is entry and entry.copying == copy_id
                if current and error is not None:
                    log.warning("prefix cache: an entry could not be copied to host RAM (%s: %s); it is dropped",
                                type(error).__name__, error)
                    self._drop(entry, counted=True)
                elif current:
                    entry.data, entry.copying = held, 0
                    if entry.tier == "disk" and entry.writing == write_id:
                        self._disk_writes.put_nowait((entry, write_id, held, entry.logprobs))
                        continue
                if write_id:  # booked in `_place`, and never queued: the writer will not give it back
                    self._disk_writes_bytes -= entry.nbytes
        if interrupted is not None:
            raise interrupted

    def _seen_again(self, key: bytes) -> bool:
        """(Under the lock.) Whether the entry of `key` is cached already, which an offer of the
        same prefix again then only marks as used (the same state, to float rounding)."""
        known = self._index.get(key)
        if known is None:
            return False
        self._tiers[known.tier].move_to_end(key)
        return True

    def _drop(self, entry: _Entry, counted: bool = False) -> None:
        """The entry leaves every table first, then its file goes: a file that cannot be removed
        (a disk remounted read-only, an I/O error) is logged and left for the start-up wipe,
        never raised into the session request whose room this frees, nor left half in the books."""
        key = entry.key
        if self._tiers[entry.tier].pop(key, None) is not None:
            self._bytes[entry.tier] -= entry.nbytes
        self._index.pop(key, None)
        self._unfile(entry, key)
        if counted:
            self._evictions[entry.model] = self._evictions.get(entry.model, 0) + 1
        if entry.tier == "disk" and self.directory is not None:
            try:
                self._path(entry).unlink(missing_ok=True)
            except OSError as error:
                log.warning("prefix cache: the file of a dropped entry could not be removed (%s); it goes when the "
                            "server next starts", error)

    def _unfile(self, entry: _Entry, key: bytes) -> None:
        filed = self._by_block.get(entry.block)
        if filed is not None and filed.get(entry.n) == key:
            del filed[entry.n]
            if not filed:
                del self._by_block[entry.block]

    def _count_evictions(self) -> None:
        with self._lock:
            counts, self._evictions = self._evictions, {}
        if self.metrics is not None:
            for model, count in counts.items():
                self.metrics.prefix_cache_evictions.labels(model).inc(count)

    def clear(self) -> None:
        with self._lock:
            for entry in list(self._index.values()):
                self._drop(entry)
        self._publish()

    def usage(self, tier: str = "device") -> dict[str, tuple[int, int]]:
        """model -> (entries, bytes) in `tier`."""
        with self._lock:
            counts: dict[str, list[int]] = {}
            for entry in self._tiers[tier].values():
                row = counts.setdefault(entry.model, [0, 0])
                row[0] += 1
                row[1] += entry.nbytes
        return {model: (row[0], row[1]) for model, row in counts.items()}

    def _publish(self) -> None:
        """Set the gauges from the books; one thread at a time, so that an older reading (the
        disk writer's, an engine worker's) is never set after a newer one."""
        if self.metrics is None:
            return
        with self._publishing:
            for tier in PREFIX_TIERS:
                usage = self.usage(tier)
                for model in set(usage) | self._published:
                    entries, nbytes = usage.get(model, (0, 0))
                    self.metrics.prefix_cache_entries.labels(model, tier).set(entries)
                    self.metrics.prefix_cache_bytes.labels(model, tier).set(nbytes)
                self._published = set(usage) | self._published

    _published: set = frozenset()


def _drained(writes: queue.Queue, timeout_s: float) -> bool:
    """Wait until a writer thread has done every write queued in `writes`; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while writes.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    return not writes.unfinished_tasks


def _device_of(data: SessionData) -> torch.device | None:
    """The device of a state's tensors (where its model runs)."""
    tensors = [t for _, t in data.state._named_tensors()]
    return tensors[0].device if tensors else None
