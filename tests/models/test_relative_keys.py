"""The relative-key tables Transformer-XL, XLNet and others keep between calls
(models/layers/relative.py `RelativeKeys`): kept and sliced while they are needed, rebuilt smaller
once a long history's tables go unneeded, the same numbers either way."""

import torch
from torch import nn

from xlserve.models.layers import relative
from xlserve.models.layers.relative import RelativeKeys


def keys_and_projections():
    torch.manual_seed(0)
    keys = RelativeKeys(d_model=16, n_head=2, d_head=8, dropout=0.0, min_length=8).eval()
    return keys, [nn.Linear(16, 16, bias=False) for _ in range(3)]


def test_tables_a_long_history_grew_are_rebuilt_smaller_once_long_unneeded(monkeypatch):
    """A model whose memory is not bounded (XLNet with mem_len null) asks for its longest history's
    distances: kept for good, they held 2.6 GB of xlnet-base's after one 60k-token document. Past
    KEPT_BYTES_BEFORE_SHRINK, unneeded for SHRINK_AFTER_SECONDS, they are rebuilt at what calls now
    ask for; while a long history is still in use they stay."""
    keys, projections = keys_and_projections()
    like = torch.zeros(1)
    clock = [1000.0]
    monkeypatch.setattr(relative.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(relative, "KEPT_BYTES_BEFORE_SHRINK", 10_000)
    with torch.inference_mode():
        _, long_tables = keys(projections, 0, 999, like)
        assert keys._kept[0] == 1000 and keys._kept_bytes > 10_000
        clock[0] += relative.SHRINK_AFTER_SECONDS / 2
        keys(projections, 0, 300, like)  # a quarter of it and more: still needed
        clock[0] += relative.SHRINK_AFTER_SECONDS / 2 + 1
        keys(projections, 0, 10, like)  # short, but the long one was needed within the minute
        assert keys._kept[0] == 1000
        clock[0] += relative.SHRINK_AFTER_SECONDS + 1
        encoding, tables = keys(projections, 0, 10, like)
        assert keys._kept[0] < 1000 and keys._kept_bytes < 10_000
        assert all(torch.equal(t, long[:11]) for t, long in zip(tables, long_tables))  # the same numbers


def test_tables_under_the_bound_stay_kept():
    keys, projections = keys_and_projections()
    with torch.inference_mode():
        keys(projections, 0, 999, torch.zeros(1))
        kept = keys._kept
        keys(projections, 0, 3, torch.zeros(1))
        assert keys._kept is kept  # 1,000 distances of these sizes are far under 1 GiB
