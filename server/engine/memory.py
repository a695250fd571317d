"""The engine process's memory policy: hand freed memory back to the system once the engines
are idle, so that the process's resident memory comes back down after sessions are deleted.

Why it is needed (`xlserve bench soak` measures it; the numbers are in docs/benchmarks.md).
Sessions come and go, and with them their states, their encoded copies, prompt activations and
the batches of the step loop, allocated by several threads (the engines' workers, torch's
intra-op threads, the session-op pool). Without this policy the engine process's resident
memory grows with rounds of session work and stays there after every session is deleted, for
two reasons:

- glibc's malloc keeps what is freed. It raises its mmap threshold each time a large block is
  freed (up to 32 MB), so later blocks of that size come from its heaps instead of fresh
  mappings; a heap gives memory back only from its top, which one live block pins; and each
  thread may get an arena (heap) of its own, up to eight per core. `malloc_trim(0)` returns the
  free pages inside every heap.
- Garbage that only the cyclic collector frees: a finished request and its rows refer to each
  other, and hold the state the request started from and each row's last state. The collector
  counts objects, not bytes, and in a process whose heap holds torch's many objects a full
  collection comes rarely (and is slow). The engine process
  unlinks a request from its rows when the request ends (process.py `_ended`); the collection
  here catches any other cycle.

The policy:

- `MemoryReturner`: whenever something may have freed memory (a request ended, a session
  operation ran: a delete, a release, a commit that replaced a state) it is told (`freed`); once
  every engine has been idle for QUIET_SECONDS, and at most once every TRIM_INTERVAL_SECONDS, it
  collects garbage and calls glibc's `malloc_trim(0)` from its own thread. Only when idle: pages
  handed back while the engines step would be faulted in again at the next step, and a trim
  holds the allocator's locks for milliseconds. Without glibc (musl, macOS) it only collects.
- `freeze_start_up_objects`: after start-up everything alive (modules, models, weights) lives as
  long as the process, so it is moved out of the collector's sight (`gc.freeze`): a collection
  then scans only what serving created.
- `engine_environment`: the engine process starts with MALLOC_ARENA_MAX=MALLOC_ARENAS (unless the
  environment sets it): fewer heaps, so fewer partly used pages that no trim can return.

The bound (docs/design.md section 8): once every session is deleted and the server has idled
for a few seconds, the engine process's resident memory is within IDLE_GROWTH_BOUND_MB of what it
was right after start-up, however many rounds of work came before. What stays above start-up is
what the first requests leave for good (torch's thread pools and kernel caches, the allocator's
bookkeeping). tests/e2e/test_memory_bound.py checks the bound against a
real server. XLSERVE_RETURN_MEMORY=false turns the returner off.

This module is torch-free: the API process (client.py) and the soak benchmark import it.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
from typing import Callable

log = logging.getLogger("xlserve.engine_memory")

IDLE_GROWTH_BOUND_MB = 64  # engine RSS once every session is deleted and it idles, over its RSS after start-up
MALLOC_ARENAS = 2  # MALLOC_ARENA_MAX of the engine process
TRIM_INTERVAL_SECONDS = 1.0  # at most one trim a second: under a steady trickle of requests its cost stays small
QUIET_SECONDS = 0.25  # the engines must stay idle this long first, so that a burst of requests ends before


def engine_environment() -> dict[str, str]:
    """The environment the engine process is started with (server/engine/client.py): this one,
    with glibc's arenas limited to MALLOC_ARENAS unless MALLOC_ARENA_MAX is already set (on a
    machine with many cores an operator may want more: with fewer arenas, threads that allocate
    at once wait for each other's locks). Without the API keys: authentication stays in the API
    process (server/settings.py), and the engine process, which runs models and reads files, never
    needs them."""
    environment = {"MALLOC_ARENA_MAX": str(MALLOC_ARENAS), **os.environ}
    return {name: value for name, value in environment.items() if name.upper() != "XLSERVE_API_KEYS"}  # any case, as read


def malloc_trim_function() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)` as a function of no arguments, or None without glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # no C library to open, or one without malloc_trim (musl, macOS)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def freeze_start_up_objects() -> None:
    """Collect what start-up left behind, then move every object alive now out of the garbage
    collector's sight (`gc.freeze`): they live as long as the process. Collections then scan only
    what serving created since, and as often as those objects call for instead of once the whole
    heap has grown by a quarter."""
    gc.collect()
    gc.freeze()


class MemoryReturner:
    """Once the engines are idle after something was freed, at most once per `interval` seconds,
    collects garbage and calls `trim` (default: glibc's malloc_trim(0), None: collect only), from
    its own thread. `is_idle` says whether every engine is idle; it is called from that thread.
    Disabled, it does nothing."""

    def __init__(self, is_idle: Callable[[], bool], enabled: bool = True,
                 trim: Callable[[], object] | None = None,
                 interval: float = TRIM_INTERVAL_SECONDS, quiet: float = QUIET_SECONDS):
        self.is_idle = is_idle
        self.trim = trim if trim is not None else malloc_trim_function()
        self.interval, self.quiet = interval, quiet
        self.returns = 0  # how many times memory was handed back
        self._freed = threading.Event()
        self._closing = threading.Event()
        self._thread = None
        if enabled:
            self._thread = threading.Thread(target=self._loop, name="memory-return", daemon=True)
            self._thread.start()

    @classmethod
    def for_engine_process(cls, is_idle: Callable[[], bool], enabled: bool) -> "MemoryReturner":
        """The engine process's returner, made once its models are loaded: what exists then is
        frozen first (`freeze_start_up_objects`)."""
        if enabled:
            freeze_start_up_objects()
        return cls(is_idle, enabled)

    def freed(self) -> None:
        """Something may have been freed (any thread; cheap: it sets a flag)."""
        self._freed.set()

    def close(self) -> None:
        self._closing.set()
        self._freed.set()  # wake the thread, so that it sees `_closing`
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            self._freed.wait()
            if self._closing.wait(self.interval):  # the rate limit; a burst of endings finishes meanwhile
                return
            self._freed.clear()
            if not self._idle_for(self.quiet):
                self._freed.set()  # busy: look again after another interval
                continue
            try:
                gc.collect()
                if self.trim is not None:
                    self.trim()
                self.returns += 1
            except Exception as error:  # the policy must never take the process down
                log.warning("returning memory to the system failed: %r", error)

    def _idle_for(self, seconds: float) -> bool:
        """Idle now, and still idle `seconds` later."""
        if not self.is_idle():
            return False
        if self._closing.wait(seconds):
            return False
        return self.is_idle()
