import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from xlserve.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = TransformerXL(TransformerXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=8)).eval()
    save_checkpoint(model, tmp_path)
    return model, tmp_path


def test_save_load_gives_identical_log_probs(saved):
    model, path = saved
    loaded = load_checkpoint(path)
    tokens = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        a, _ = model(tokens, model.init_state(1))
        b, _ = loaded(tokens, loaded.init_state(1))
    assert torch.equal(a, b)
    assert loaded.head.weight is loaded.embedding.weight  # tying survives the round trip


def test_wrong_shape_names_the_tensor(saved):
    _, path = saved
    tensors = load_file(str(path / "model.safetensors"))
    tensors["layers.1.r_net.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.r_net\.weight.*shape"):
        load_checkpoint(path)


def test_missing_and_unexpected_tensors_are_named(saved):
    _, path = saved
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["layers.0.ff.0.bias"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.0\.ff\.0\.bias.*missing"):
        load_checkpoint(path)
    tensors["layers.0.ff.0.bias"] = torch.zeros(64)
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'extra\.weight'"):
        load_checkpoint(path)


def test_wrong_dtype_is_named(saved):
    _, path = saved
    tensors = load_file(str(path / "model.safetensors"))
    tensors["r_w_bias"] = tensors["r_w_bias"].half()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"r_w_bias.*dtype"):
        load_checkpoint(path)


def test_corrupted_file_and_wrong_architecture(saved):
    _, path = saved
    (path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    config["architecture"] = "no-such-model"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no-such-model"):
        load_checkpoint(path)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path / "nothing")


def test_float16_storage_halves_the_file_and_loads_as_the_rounded_float32_model(tmp_path):
    torch.manual_seed(0)
    model = TransformerXL(TransformerXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=16)).eval()
    save_checkpoint(model, tmp_path / "wide")
    save_checkpoint(model, tmp_path / "narrow", storage_dtype="float16")
    wide, narrow = (tmp_path / "wide" / "model.safetensors"), (tmp_path / "narrow" / "model.safetensors")
    assert narrow.stat().st_size < 0.6 * wide.stat().st_size
    assert all(t.dtype == torch.float16 for t in load_file(str(narrow)).values())
    assert json.loads((tmp_path / "narrow" / "config.json").read_text())["storage_dtype"] == "float16"

    loaded = load_checkpoint(tmp_path / "narrow")
    for name, tensor in loaded.state_dict().items():  # float32 again, holding the float16-rounded values
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, model.state_dict()[name].half().float())
    tokens = torch.randint(0, 256, (1, 40))
    rounded = TransformerXL(model.config).eval()
    rounded.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    assert torch.equal(loaded(tokens, loaded.init_state(1))[0], rounded(tokens, rounded.init_state(1))[0])


def test_storage_dtype_refusals(tmp_path):
    model = TransformerXL(TransformerXLConfig(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=8))
    with pytest.raises(CheckpointError, match="storage dtype 'int8'"):
        save_checkpoint(model, tmp_path / "a", storage_dtype="int8")
    with torch.no_grad():
        next(model.parameters()).fill_(1e6)  # beyond float16's range
    with pytest.raises(CheckpointError, match="does not fit float16"):
        save_checkpoint(model, tmp_path / "b", storage_dtype="float16")
    save_checkpoint(model.__class__(model.config), tmp_path / "c", storage_dtype="float16")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({**config, "storage_dtype": "float8"}))
    with pytest.raises(CheckpointError, match="storage_dtype 'float8'"):
        load_checkpoint(tmp_path / "c")
