"""Which states batch together (server/engine/batch.py BatchLayout): a class whose concat refuses
rows of different shapes is batched by shape from then on; running out of memory while making
one batch (on an accelerator, or host RAM on the CPU) is not such a refusal, and leaves the class
batching its ragged rows together."""

import pytest
import torch

from xlserve.models.layers.xl_memory import XLMemory
from xlserve.server.engine.batch import BatchLayout


def memory(length: int) -> XLMemory:
    """A two-layer memory of `length` positions (2 heads of 4)."""
    return XLMemory(keys=[torch.zeros(1, length, 2, 4)] * 2, values=[torch.zeros(1, length, 2, 4)] * 2,
                    valid=torch.ones(1, length, dtype=torch.bool))


def host_allocation_failure() -> RuntimeError:
    """What torch's CPU allocator raises when host RAM runs out: a plain RuntimeError."""
    from tests.models.helpers import allocator_refusal

    return allocator_refusal()


@pytest.mark.parametrize("error, ragged_after", [(torch.OutOfMemoryError("out of memory"), True),
                                                 (host_allocation_failure(), True),
                                                 (RuntimeError("cannot pad these"), False)])
def test_only_a_refusal_stops_ragged_batches(monkeypatch, error, ragged_after):
    layout = BatchLayout(max_batch_size=8)
    short, long = memory(3), memory(5)
    assert layout.key(short) == layout.key(long)  # XLMemory pads: rows of any length batch together
    assert layout.concat([short, long]).length == 5

    def failing(states):
        raise error

    monkeypatch.setattr(XLMemory, "concat", staticmethod(failing))
    assert layout.concat([short, long]) is None
    monkeypatch.undo()
    assert (layout.key(short) == layout.key(long)) is ragged_after


def test_a_step_that_runs_out_of_memory_is_a_retryable_503_for_its_request_not_a_failure():
    """A forward, a sampling or a finish that cannot allocate (the device's memory, or host RAM on
    the CPU, where torch raises a plain RuntimeError) is the server's passing trouble: 503
    device_out_of_memory with Retry-After, whichever part of the step it hit; any other error
    stays the request's RequestFailed with its code."""
    from xlserve.server.engine.errors import DeviceOutOfMemory, RequestFailed
    from xlserve.server.engine.scheduler import request_error

    for code in ("forward_failed", "sampling_failed", "finish_failed", "step_failed"):
        for error in (torch.OutOfMemoryError("CUDA out of memory"), host_allocation_failure(), MemoryError()):
            answered = request_error(error, code)
            assert isinstance(answered, DeviceOutOfMemory), (code, error)
            assert answered.retry_after_seconds == 1
        plain = request_error(RuntimeError("shapes do not agree"), code)
        assert isinstance(plain, RequestFailed) and plain.code == code
