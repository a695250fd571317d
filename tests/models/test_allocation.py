"""`out_of_memory` (models/allocation.py): an allocation refused for want of memory a retry may
find is the server's passing trouble; one larger than the machine can ever hold is not, and
neither is any other RuntimeError."""

import torch

from tests.models.helpers import allocator_refusal
from xlserve.models.allocation import machine_memory_bytes, out_of_memory


def test_a_refused_allocation_the_machine_could_hold_is_out_of_memory():
    assert out_of_memory(allocator_refusal(2**30))
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out_of_memory(MemoryError())


def test_an_allocation_beyond_the_machine_or_another_error_is_not():
    try:
        torch.empty(2**50, dtype=torch.uint8)  # a real refusal, of a size no machine holds
    except RuntimeError as error:
        assert not out_of_memory(error)
    assert not out_of_memory(allocator_refusal(machine_memory_bytes() + 1))
    assert not out_of_memory(RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"))
    assert not out_of_memory(ValueError("can't allocate memory"))
