"""Which states batch together (server/engine/batch.py BatchLayout): a class whose concat refuses
rows of different shapes is batched by shape from then on; running out of memory while making
one batch is not such a refusal, and leaves the class batching its ragged rows together."""

import pytest
import torch

from xlserve.models.layers.xl_memory import XLMemory
from xlserve.server.engine.batch import BatchLayout


def memory(length: int) -> XLMemory:
    """A two-layer memory of `length` positions (2 heads of 4)."""
    return XLMemory(keys=[torch.zeros(1, length, 2, 4)] * 2, values=[torch.zeros(1, length, 2, 4)] * 2,
                    valid=torch.ones(1, length, dtype=torch.bool))


@pytest.mark.parametrize("error, ragged_after", [(torch.OutOfMemoryError("out of memory"), True),
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
