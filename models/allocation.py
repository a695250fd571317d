"""Telling the machine running out of memory apart from a tensor that is wrong.

torch raises `torch.OutOfMemoryError` when an accelerator's allocator fails, but its CPU
allocator (c10's DefaultCPUAllocator) raises a plain RuntimeError, the class torch also raises
for a malformed tensor (shapes that do not agree, an index out of range). The server takes such
a RuntimeError as the fault of the request or the state at hand (a 400, a state refused or
called unusable), so wherever it does, it asks `out_of_memory` first: host RAM running out while
a model on the CPU works is the server's passing trouble, answered 503 and retried, never a
reason to refuse a client's state or to call a stored session damaged.
"""

from __future__ import annotations

import torch

# the text of the CPU allocator's failure (torch 2.x: "[enforce fail at alloc_cpu.cpp:...]
# ... DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes ...")
CPU_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed: an accelerator's, host RAM's (a model on the
    CPU), or Python's own MemoryError."""
    return (isinstance(error, (torch.OutOfMemoryError, MemoryError))
            or (isinstance(error, RuntimeError) and CPU_ALLOCATION_FAILED in str(error)))
