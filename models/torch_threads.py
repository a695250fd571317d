"""A thread's own count of torch intra-op threads.

Every thread that runs torch outside an engine's worker (the engine process's session operations,
loading, the session cache's compactor and the prefix cache's writers) runs it on one thread:
with torch's OpenMP each thread that starts a parallel region gets a team of helpers of its own,
and once a process holds more OpenMP threads than cores, every parallel op of every thread waits
for its helpers to be woken (server/engine/threads.py says why, and how the engines share the
cores). Here, below every layer that starts such threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def own_torch_threads(count: int) -> int:
    """Make `count` intra-op threads (0: those it has) the calling thread's own, and return its
    count. torch sets a thread's count from the process-wide default on the thread's first
    parallel op, and every torch.set_num_threads moves that default (engines move it as they
    switch, see server/engine/threads.py `ForwardThreads.use_for`); so a thread that only called
    torch.set_num_threads could later be reset to whatever the default is by then. Asking for the
    count first settles it; the value set after it stays this thread's."""
    torch.get_num_threads()
    if count > 0:
        torch.set_num_threads(count)
    return torch.get_num_threads()


def start_one_threaded(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread that runs `target` with torch on one thread of its own. The calling
    thread's own count is settled first: a thread's torch.set_num_threads moves the process-wide
    default, which a thread that has not asked for its count yet would take up later (the engine
    process's main thread shares the cores out among the engines from its count, after the prefix
    cache started its writers: every engine then ran on one core)."""
    own_torch_threads(0)

    def run() -> None:
        own_torch_threads(1)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
