"""A loaded model's large weights moved onto transparent huge pages (CPU only).

A decode step on the CPU reads every weight once: 1.1 GB at transfo-xl-wt103's shape. Through
4 kB pages that is a TLB miss every 4 kB of it; through 2 MB pages, one every 2 MB. On the
machine of 2026-12-05 (THP in `madvise` mode, so nothing gets huge pages unless it asks) a
wt103-shaped batch-1 step took about 5.5% less time with the weights on huge pages: 50.2 and
51.8 ms with them, 53.2 and 54.8 without (processes alternating; docs/benchmarks.md, "Huge pages").

Only the weights move. torch's allocator can put every tensor of 2 MB or more on huge pages
(THP_MEM_ALLOC_ENABLE=1), but it then aligns each of them to 2 MB, and a 128-token append
(prefill) at the same shape took 32-48% longer that way: 869-969 ms with it, 654-658 without.
The activations, allocated and freed at every forward, are what its products and element-wise
passes read and write together, and tensors that all start at the same offset of a 2 MB page
compete for the same cache sets. Here the weights lie in one mapping, one after the other at
64-byte boundaries, and nothing else changes: the append took 667 and 681 ms with the weights
moved, 637 and 677 without (the same within the machine's noise).

`weights_on_huge_pages(model)` copies every CPU tensor of at least HUGE_PAGE_BYTES that the
model holds alone (a parameter or buffer whose storage no other of its tensors shares, covering
all of it) into one anonymous mapping advised MADV_HUGEPAGE, and points the tensor at its copy
(`tensor.data = ...`: the same Parameter objects, names, ties and state dict). The old storage
is freed; the mapping lives as long as any tensor in it. Faulting in its huge pages makes the
copy slower than a plain one: about 2 s for wt103's 1.1 GB at load. It does nothing off the CPU,
without `madvise` (not Linux), or where the kernel's THP mode is `never`.

What it moves is what the model holds as tensors. Call it after quantization (models/quantize.py):
an int8 layer's packed weights belong to fbgemm, not to the model's tensors, and stay on 4 kB
pages, while a float weight an int8 copy replaced would otherwise be moved for nothing. A
`copy.deepcopy` of a moved model gets every moved tensor as a view of one new storage (deepcopy
copies a shared storage once): give each tensor its own storage (`t.data = t.data.clone()`)
before moving or quantizing such a copy, or the copy keeps all of it alive.
"""

from __future__ import annotations

import logging
import mmap
from collections import Counter
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE_BYTES = 2 << 20  # a tensor smaller than one huge page gains nothing from the mapping
ALIGNMENT = 64  # bytes: a cache line, which the kernels' vector loads expect
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

log = logging.getLogger("xlserve.models")


def transparent_huge_pages_mode() -> str | None:
    """The kernel's THP mode (`always`, `madvise` or `never`), None where it has none."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


def weights_on_huge_pages(model: nn.Module) -> nn.Module:
    """`model`, its large CPU tensors moved onto huge pages in place (the module docstring)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or transparent_huge_pages_mode() not in ("always", "madvise"):
        return model
    # dense CPU tensors only (a sparse, meta or quantized tensor has no plain storage to copy)
    tensors = [t for t in (*model.parameters(), *model.buffers())
               if t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized]
    holders = Counter(t.untyped_storage().data_ptr() for t in tensors)  # storage -> the model's tensors on it
    moving = [t for t in tensors
              if t.nbytes >= HUGE_PAGE_BYTES and t.is_contiguous() and t.storage_offset() == 0
              and t.nbytes == t.untyped_storage().nbytes() and holders[t.untyped_storage().data_ptr()] == 1]
    if not moving:
        return model
    sizes = [-(-t.nbytes // ALIGNMENT) * ALIGNMENT for t in moving]
    mapping = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first write faults any page in
    except OSError as error:  # a sandbox's seccomp filter, a kernel that says THP but refuses the advice
        mapping.close()
        log.warning("weights left on 4 kB pages: the kernel refused MADV_HUGEPAGE (%s)", error)
        return model
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive while any view is
    offset = 0
    with torch.no_grad():
        for tensor, size in zip(moving, sizes):
            copy = whole[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            copy.copy_(tensor)
            tensor.data = copy
            offset += size
    return model
