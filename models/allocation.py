"""Telling the machine running out of memory apart from a tensor that is wrong.

torch raises `torch.OutOfMemoryError` when an accelerator's allocator fails, but its CPU
allocator (c10's DefaultCPUAllocator) raises a plain RuntimeError, the class torch also raises
for a malformed tensor (shapes that do not agree, an index out of range). The server takes such
a RuntimeError as the fault of the request or the state at hand (a 400, a state refused or
called unusable), so wherever it does, it asks `out_of_memory` first: host RAM running out while
a model on the CPU works is the server's passing trouble, answered 503 and retried, never a
reason to refuse a client's state or to call a stored session damaged.

Passing only: an allocation larger than the machine's memory (physical RAM, or the cgroup's
limit when lower) can never succeed, and a retry would fail the same way forever, so it is not
counted. Under Linux's default overcommit a refused allocation is mostly such a one, and real
pressure ends in the kernel's OOM killer instead; the allocator's refusal of a size that fits
comes from a container's limit or a strict overcommit policy.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import torch

# the text of the CPU allocator's failure (torch 2.x: "[enforce fail at alloc_cpu.cpp:...]
# ... DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes ...")
CPU_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"
_TRIED = re.compile(r"you tried to allocate (\d+) bytes")


@functools.cache
def machine_memory_bytes() -> int:
    """Physical RAM, or the cgroup's memory limit (v2 `memory.max`) when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed for want of memory a retry may find: an
    accelerator's, host RAM's (a model on the CPU) for a size the machine holds, or Python's own
    MemoryError."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(error, RuntimeError) or CPU_ALLOCATION_FAILED not in str(error):
        return False
    tried = _TRIED.search(str(error))
    return tried is None or int(tried.group(1)) < machine_memory_bytes()
