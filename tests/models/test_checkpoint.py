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


def rewrite_config(path, change) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("config_text, words", [
    ("[]", "is not an xlserve checkpoint"),
    ('{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}',
     "it reads as a Hugging Face model's: convert it first (xlserve convert"),
    ('{"format": "xlserve-checkpoint", "architecture": []}', "names architecture []"),
    ('{"format": "xlserve-checkpoint", "architecture": "transformer-xl"}', '"config" must be an object'),
    ('{"format": "xlserve-checkpoint", "architecture": "transformer-xl", "config": [1]}', '"config" must be an object'),
])
def test_a_config_json_of_the_wrong_form_names_the_file(saved, config_text, words):
    _, path = saved
    (path / "config.json").write_text(config_text)
    with pytest.raises(CheckpointError, match="config.json") as refused:
        load_checkpoint(path)
    assert words in str(refused.value)


@pytest.mark.parametrize("field, value, words", [
    ("n_layer", "2", "TransformerXLConfig.n_layer must be an integer, not '2'"),
    ("same_length", 1, "TransformerXLConfig.same_length must be true or false, not 1"),
    ("cutoffs", [1, "x"], "TransformerXLConfig.cutoffs must be a list of integers"),
    ("d_inner", -1, "TransformerXLConfig.d_inner must be at least 1, not -1"),  # of its type, and no model has it
    ("n_layer", 0, "TransformerXLConfig.n_layer must be at least 1, not 0"),
])
def test_a_hyperparameter_of_the_wrong_type_or_value_is_named(saved, field, value, words):
    _, path = saved
    rewrite_config(path, lambda config: config["config"].update({field: value}))
    with pytest.raises(CheckpointError, match="config.json") as refused:
        load_checkpoint(path)
    assert words in str(refused.value)


@pytest.mark.parametrize("field, value, words", [
    ("n_layer", 10**9, "n_layer is 1000000000, but"),  # would build a billion layers first
    ("vocab_size", 2**40, "tensor 'embedding.weight' has shape (256, 32), expected (1099511627776, 32)"),
])
def test_a_config_the_file_does_not_hold_fails_before_the_model_is_allocated(saved, field, value, words):
    """Checked against the file's header and a model on the meta device: 2**40 x 32 float32 would
    be 140 TB, and a billion layers would take hours to build."""
    _, path = saved
    rewrite_config(path, lambda config: config["config"].update({field: value}))
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path)
    assert words in str(refused.value)


def test_a_tied_weight_stored_under_both_names_must_hold_one_value(saved):
    model, path = saved
    tensors = load_file(str(path / "model.safetensors"))
    tensors["head.weight"] = tensors["embedding.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"))
    assert torch.equal(load_checkpoint(path).head.weight, model.head.weight)  # the same value: taken
    tensors["head.weight"] = torch.zeros_like(tensors["embedding.weight"])
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'embedding.weight' and 'head.weight' are one weight"):
        load_checkpoint(path)


def test_building_without_random_init_leaves_only_what_the_file_fills():
    """load_checkpoint builds its model without drawing random weights (checkpoint._NoRandomInit)
    because the file fills every parameter and persistent buffer: so in every architecture,
    whatever the state dict does not hold (non-persistent buffers) must come out the same."""
    from xlserve.models.checkpoint import _NoRandomInit
    from xlserve.models.registry import ARCHITECTURES, build_model

    for architecture in sorted(ARCHITECTURES):
        torch.manual_seed(0)
        drawn = build_model(architecture, {})
        with _NoRandomInit():
            skipped = build_model(architecture, {})
        assert skipped.state_dict().keys() == drawn.state_dict().keys(), architecture
        persistent = set(drawn.state_dict())
        others = [(name, buffer, dict(skipped.named_buffers())[name]) for name, buffer in drawn.named_buffers()
                  if name not in persistent]
        for name, one, other in others:
            assert torch.equal(one, other), (architecture, name)


def test_converting_an_xlserve_checkpoint_says_to_serve_it_as_it_is(saved, tmp_path):
    from xlserve.models.convert import ConversionError, convert

    _, path = saved
    with pytest.raises(ConversionError, match="is an xlserve checkpoint already: serve it as it is"):
        convert(path, tmp_path / "out")


def test_loading_in_the_serving_dtype_gives_what_casting_the_loaded_model_gives(saved):
    """The model moves to its device in the serving dtype before its weights are copied in, so a
    bfloat16 model on a GPU never holds a float32 copy there (twice the served model's memory
    while loading): the same tensors as loading in float32 and casting after, bit for bit."""
    _, path = saved
    cast_after = load_checkpoint(path).to(torch.bfloat16)
    loaded = load_checkpoint(path, dtype=torch.bfloat16)
    expected = cast_after.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert all(buffer.dtype == other.dtype for buffer, other in zip(loaded.buffers(), cast_after.buffers()))


def test_a_model_larger_than_the_machine_is_refused_before_it_is_built(saved, monkeypatch):
    """Under Linux's overcommit (and a container's limit) every allocation of a model past the
    machine's memory succeeds and filling it brings the OOM killer: the process ended without a
    word. It is refused first, naming the model's size and the machine's."""
    import xlserve.models.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "machine_memory_bytes", lambda: 1 << 10)
    with pytest.raises(CheckpointError, match=r"GiB in float32 while it is built, more than this machine's memory"):
        load_checkpoint(saved[1])


@pytest.mark.parametrize("architecture", ["vanilla", "xlnet", "transformer-xl", "mamba"])
def test_no_architecture_is_built_with_no_layers_or_a_width_below_one(architecture):
    """`xlserve new --config '{"n_layer": -1}'` wrote a checkpoint of a vanilla or XLNet model
    with no layers: only some architectures checked their sizes."""
    from xlserve.models.registry import build_model
    from xlserve.models.training.presets import preset_config

    for field in ("n_layer", "d_model"):
        with pytest.raises(ValueError, match=f"{field} must be at least 1, not -1"):
            build_model(architecture, {**preset_config(architecture, "tiny"), field: -1})
