"""What a decoding step reads besides its weights and states (`step_bytes_beside_weights`, the
benches' bandwidth measure): Transformer-XL and XLNet read each layer's kept table of relative
keys for their distances, not r_net, which only builds the tables. Checked against the rows a
real decoding step takes from the tables, at every memory length up to full and past it."""

import pytest
import torch

from xlserve.models.layers.relative import RelativeKeys
from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig
from xlserve.models.xlnet import XLNet, XLNetConfig

MEM_LEN = 8


def models():
    torch.manual_seed(0)
    yield TransformerXL(TransformerXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, vocab_size=50,
                                            mem_len=MEM_LEN)).eval()
    yield XLNet(XLNetConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, vocab_size=50,
                            mem_len=MEM_LEN)).eval()


@pytest.mark.parametrize("model", list(models()), ids=lambda m: m.architecture)
@torch.inference_mode()
def test_a_step_reads_the_rows_of_the_tables_it_takes_and_no_r_net(model, monkeypatch):
    taken = []
    original = RelativeKeys.forward

    def recording(self, projections, low, high, like):
        encoding, tables = original(self, projections, low, high, like)
        taken.append(tables)
        return encoding, tables

    monkeypatch.setattr(RelativeKeys, "forward", recording)
    c = model.config
    r_net = sum(layer.r_net.weight.numel() * 4 for layer in model.layers)
    state = model.init_state(1)
    for positions in range(MEM_LEN + 4):
        taken.clear()
        _, state = model(torch.zeros(1, 1, dtype=torch.long), state)
        (tables,) = taken
        rows = tables[0].shape[0]
        assert all(table.shape == (rows, c.n_head, c.d_head) for table in tables)
        assert model.step_bytes_beside_weights(positions) == c.n_layer * rows * c.n_head * c.d_head * 4 - r_net
