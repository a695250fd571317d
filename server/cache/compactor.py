"""Compactions behind the answer: one background thread that compacts the sessions whose logs of
delta commits have passed `compact_ratio` times their base (durable.py), after their commits were
answered.

At real size a compaction rewrites the whole state (237 MB at transfo-xl-wt103's shape, about 3 s
on the machine of 2026-12-04); inside the commit that triggered it, one turn in twelve of a chat
paid that (eighteen at today's default ratio of 1.5). Here the commit answers after writing its delta block, and the session is compacted
next, under a hold that a request for the session waits for rather than being refused
(session_cache.py `compact`). A session held by a request when its turn comes is skipped: its
next commit asks again, and a log that reaches LOG_SLACK times the ratio meanwhile is compacted by
that commit itself. Sessions are compacted one at a time, in the order asked, each once however
often it was asked while waiting.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from xlserve.models.torch_threads import start_one_threaded

log = logging.getLogger("xlserve.cache")


class Compactor:
    def __init__(self, compact: Callable[[str], bool]):
        """`compact(session_id)`: compact one session (False when it could not be now)."""
        self._compact = compact
        self._waiting: OrderedDict[str, None] = OrderedDict()  # session ids, oldest first, each once
        self._running: str | None = None
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, session_id: str) -> None:
        """Compact the session soon (the thread starts with the first one)."""
        with self._changed:
            if self._closed:
                return
            self._waiting[session_id] = None
            if self._thread is None:
                # a compaction encodes a whole state: beside the engines, on one core of its own
                self._thread = start_one_threaded(self._run, "xlserve-compactor")
            self._changed.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Until no compaction runs or waits (tests, shutdown); False when `timeout` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._waiting and self._running is None, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop: the compaction that runs ends first (bounded by `timeout`); the ones still waiting
        are dropped, their logs valid as they are."""
        with self._changed:
            self._closed = True
            self._waiting.clear()
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting or self._closed)
                if self._closed:
                    return
                session_id, _ = self._waiting.popitem(last=False)
                self._running = session_id
            try:
                self._compact(session_id)
            except Exception:  # never the thread's end: the next session is compacted all the same
                log.exception("session %s: compaction failed; its log stays as it is", session_id)
            finally:
                with self._changed:
                    self._running = None
                    self._changed.notify_all()
