"""`xlserve convert` for Hugging Face MambaForCausalLM, Mamba2ForCausalLM and RwkvForCausalLM:
parity with transformers 4.57.1 (the second reference environment, tests/models/hf_reference.py)
on three random configurations of each, the tokenizer.json tokenizer with its chat template, and
the refusals, which name the problem and write nothing. Nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.hf_reference import reference_runs
from xlserve.models.checkpoint import load_checkpoint, read_config
from xlserve.models.convert import ConversionError, convert
from xlserve.models.tokenizer import TokenizersTokenizer, tokenizer_for_checkpoint

TOLERANCE = 1e-4
LENGTH, PROMPT, NEW = 80, 24, 12

# three configurations per architecture: depth, widths, kernel, groups, biases, tying and
# rescaling vary; the sequences are longer than our prefill chunks (64 for the two Mambas, 16 for
# RWKV's WKV) and than transformers' Mamba-2 chunks (chunk_size), so both carry state across chunks
CONFIGS = {
    "mamba": [
        dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2,
             time_step_rank=4),
        dict(vocab_size=120, hidden_size=48, num_hidden_layers=3, state_size=4, conv_kernel=3, expand=1,
             time_step_rank="auto", use_bias=True, use_conv_bias=False, tie_word_embeddings=False),
        dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=16, conv_kernel=2, expand=3,
             time_step_rank=2),
    ],
    "mamba2": [
        dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2,
             num_heads=8, head_dim=8, n_groups=2, chunk_size=16),
        dict(vocab_size=120, hidden_size=24, num_hidden_layers=3, state_size=16, conv_kernel=3, expand=2,
             num_heads=4, head_dim=12, n_groups=1, chunk_size=32, use_bias=True,
             time_step_limit=(0.0, 0.5)),
        dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4, conv_kernel=4, expand=4,
             num_heads=16, head_dim=4, n_groups=4, chunk_size=8, use_conv_bias=False),
    ],
    "rwkv": [
        dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, intermediate_size=64, rescale_every=2,
             context_length=128),
        dict(vocab_size=120, hidden_size=24, num_hidden_layers=3, rescale_every=0, context_length=128,
             tie_word_embeddings=True, layer_norm_epsilon=1e-6),
        dict(vocab_size=64, hidden_size=16, num_hidden_layers=7, intermediate_size=24, rescale_every=6,
             context_length=128),
    ],
}
CASES = [(arch, i) for arch in CONFIGS for i in range(len(CONFIGS[arch]))]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """Every configuration's reference, built, saved and run in one reference subprocess."""
    root = tmp_path_factory.mktemp("references")
    generator = torch.Generator().manual_seed(0)
    specs = []
    for seed, (arch, i) in enumerate(CASES):
        vocab = CONFIGS[arch][i]["vocab_size"]
        specs.append(dict(arch=arch, config=CONFIGS[arch][i], seed=seed, dir=str(root / f"{arch}-{i}"),
                          tokens=torch.randint(0, vocab, (2, LENGTH), generator=generator).tolist(),
                          prompt=PROMPT, new=NEW))
    reference_runs(specs)
    return {(spec["arch"], i): spec for spec, (_, i) in zip(specs, CASES)}


def converted(spec: dict, tmp_path: Path):
    summary = convert(Path(spec["dir"]) / "hf", tmp_path / "ours")
    return load_checkpoint(tmp_path / "ours"), summary


def greedy(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    log_probs, state = model(prompt, model.init_state(prompt.shape[0]))
    chosen = []
    for _ in range(new):
        token = log_probs[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        chosen.append(token)
        log_probs, state = model(token, state)
    return torch.cat(chosen, dim=1)


@pytest.mark.parametrize("arch,index", CASES)
@torch.no_grad()
def test_parity_with_transformers(references, tmp_path, arch, index):
    """One pass and token by token (the reference's own cache) within 1e-4 of the reference's
    log-probabilities; greedy tokens identical to its generate()."""
    spec = references[(arch, index)]
    expected = load_file(str(Path(spec["dir"]) / "ref.safetensors"))
    model, summary = converted(spec, tmp_path)
    assert summary["architecture"] == arch
    tokens = torch.tensor(spec["tokens"])
    assert expected["one_pass"].std() > 0.1  # logits spread wider than the tolerance: a comparison that can fail

    one_pass, _ = model(tokens, model.init_state(2))
    assert (one_pass - expected["one_pass"]).abs().max() < TOLERANCE

    state, steps = model.init_state(2), []
    for t in range(LENGTH):
        out, state = model(tokens[:, t : t + 1], state)
        steps.append(out)
    assert (torch.cat(steps, dim=1) - expected["step_by_step"]).abs().max() < TOLERANCE
    assert torch.equal(greedy(model, tokens[:, :PROMPT], NEW), expected["greedy"])


# -- the tokenizer ------------------------------------------------------------------------------------


TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_level_tokenizer_json(vocab_size: int) -> str:
    """A small byte-level BPE (GPT-NeoX's kind) trained here on stdlib source."""
    import inspect
    import json as json_module

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([inspect.getsource(json_module.decoder)], trainer)
    return tokenizer.to_str()


def with_tokenizer(spec: dict, tmp_path: Path, vocab_size: int) -> Path:
    source = tmp_path / "hf"
    shutil.copytree(Path(spec["dir"]) / "hf", source)
    (source / "tokenizer.json").write_text(byte_level_tokenizer_json(vocab_size))
    (source / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    return source


def wide_source(references, source: Path) -> Path:
    """mamba 0's source with its embeddings widened to 300 rows, for a byte-level tokenizer.json
    of 290 tokens (fewer than the rows, as GPT-NeoX's 50,277 in 50,280) and a tokenizer_config.json
    whose eos_token is <|endoftext|>."""
    spec = references[("mamba", 0)]
    config = json.loads((Path(spec["dir"]) / "hf" / "config.json").read_text())
    config["vocab_size"] = 300
    tensors = load_file(str(Path(spec["dir"]) / "hf" / "model.safetensors"))
    tensors["backbone.embeddings.weight"] = torch.randn(300, config["hidden_size"])
    tensors.pop("lm_head.weight", None)
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(source / "model.safetensors"))
    (source / "tokenizer.json").write_text(byte_level_tokenizer_json(290))
    (source / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    return source


def test_tokenizer_json_and_chat_template_go_with_the_weights(references, tmp_path):
    spec = references[("mamba", 1)]  # vocabulary 120 < 256 + merges: a larger tokenizer is refused
    source = with_tokenizer(spec, tmp_path, 300)
    with pytest.raises(ConversionError, match=r"tokenizer.json has \d+ tokens, more than the model's vocab_size 120"):
        convert(source, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()

    source = wide_source(references, tmp_path / "wide")
    summary = convert(source, tmp_path / "ours")
    assert summary["tokenizer"] == "tokenizers"
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(summary["files"])
    tokenizer = tokenizer_for_checkpoint(read_config(tmp_path / "ours"), tmp_path / "ours")
    assert isinstance(tokenizer, TokenizersTokenizer) and tokenizer.vocab_size == 290
    text = 'def decode(self, s):\n    """Return the Python representation of ``s``."""\n  ünïcode ✓'
    ids = tokenizer.encode(text)
    assert len(ids) < len(text.encode()) and tokenizer.decode(ids) == text  # merges used, byte-exact round trip
    assert tokenizer.encode("a<|endoftext|>b")[1] == tokenizer.tokenizer.token_to_id("<|endoftext|>")
    detokenizer = tokenizer.detokenizer()
    assert "".join(detokenizer.push(t) for t in ids) + detokenizer.flush() == text  # streamed: the same text

    from xlserve.server.api.chat import load_chat_template

    template = load_chat_template(read_config(tmp_path / "ours"), tmp_path / "ours")
    assert template.render([{"role": "user", "content": "hi"}]) == "<|user|>hi<|endoftext|><|assistant|>"


def test_the_end_of_text_tokens_are_the_sources(references, tmp_path):
    """Where a generation ends, as transformers' generate() takes it: generation_config.json's
    eos_token_id (an id or a list), else config.json's, else tokenizer_config.json's eos_token
    as the tokenizer encodes it; recorded in the converted config.json and said in the notes. A
    checkpoint converted before they were recorded finds them at load from its copied
    tokenizer_config.json; a malformed list is refused at load, naming the field."""
    source = wide_source(references, tmp_path / "source")
    config = json.loads((source / "config.json").read_text())

    def converted_stops(name: str) -> tuple[frozenset, list[str]]:
        summary = convert(source, tmp_path / name)
        tokenizer = tokenizer_for_checkpoint(read_config(tmp_path / name), tmp_path / name)
        return tokenizer.stop_token_ids, summary["notes"]

    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "bos_token_id": 0}))
    config["eos_token_id"] = 5
    (source / "config.json").write_text(json.dumps(config))
    stops, notes = converted_stops("generation-config")
    assert stops == {7, 9} and read_config(tmp_path / "generation-config")["stop_token_ids"] == [7, 9]
    assert any("a generation ends at" in note and "ignore_eos" in note for note in notes), notes
    (source / "generation_config.json").unlink()
    assert converted_stops("config")[0] == {5}
    config["eos_token_id"] = None
    (source / "config.json").write_text(json.dumps(config))
    stops, _ = converted_stops("tokenizer-config")
    end = TokenizersTokenizer.from_file(source / "tokenizer.json").tokenizer.token_to_id("<|endoftext|>")
    assert stops == {end}

    ours = tmp_path / "config"
    written = json.loads((ours / "config.json").read_text())
    del written["stop_token_ids"]  # converted before they were recorded
    (ours / "config.json").write_text(json.dumps(written))
    assert tokenizer_for_checkpoint(read_config(ours), ours).stop_token_ids == {end}
    written["stop_token_ids"] = [5, 300]  # past the model's vocabulary
    (ours / "config.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match="stop_token_ids"):
        tokenizer_for_checkpoint(read_config(ours), ours)


def test_a_tokenizer_json_put_beside_the_converted_weights_later_keeps_the_sources_end_of_text(references, tmp_path):
    """A source without tokenizer.json (state-spaces' own directories, RWKV World) converts, and the
    note says to put the tokenizer beside the converted weights. Its end of text must survive
    that: the source's eos_token_id is recorded at conversion, and tokenizer_config.json (whose
    eos_token the load reads when no id was given) goes with the weights."""
    source = wide_source(references, tmp_path / "source")
    tokenizer_json = (source / "tokenizer.json").read_bytes()
    (source / "tokenizer.json").unlink()
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    summary = convert(source, tmp_path / "by-id")
    assert any("put it in the output directory" in note for note in summary["notes"]), summary["notes"]
    assert any("a generation ends at token 0" in note for note in summary["notes"]), summary["notes"]
    (tmp_path / "by-id" / "tokenizer.json").write_bytes(tokenizer_json)
    loaded = tokenizer_for_checkpoint(read_config(tmp_path / "by-id"), tmp_path / "by-id")
    assert loaded.stop_token_ids == {0}

    (source / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))  # only the eos_token's text
    convert(source, tmp_path / "by-text")
    assert "stop_token_ids" not in read_config(tmp_path / "by-text")
    assert (tmp_path / "by-text" / "tokenizer_config.json").is_file()
    (tmp_path / "by-text" / "tokenizer.json").write_bytes(tokenizer_json)
    loaded = tokenizer_for_checkpoint(read_config(tmp_path / "by-text"), tmp_path / "by-text")
    assert loaded.stop_token_ids == {loaded.tokenizer.token_to_id("<|endoftext|>")}


# -- refusals: each names the problem and writes nothing -------------------------------------------------


def refused(source: Path, out: Path, match: str) -> None:
    with pytest.raises(ConversionError, match=match):
        convert(source, out)
    assert not out.exists() and not any(p.name.startswith(f".{out.name}.") for p in out.parent.iterdir())


def copy_of(spec: dict, tmp_path: Path) -> Path:
    source = tmp_path / "source"
    shutil.copytree(Path(spec["dir"]) / "hf", source)
    return source


def edit_tensors(source: Path, edit) -> None:
    tensors = load_file(str(source / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(source / "model.safetensors"))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_refusals_name_the_problem_and_write_nothing(references, tmp_path, arch):
    spec = references[(arch, 0)]
    prefix = {"mamba": "backbone.layers.0.mixer.", "mamba2": "backbone.layers.0.mixer.", "rwkv": "rwkv.blocks.0.attention."}[arch]
    name = prefix + ("in_proj.weight" if arch != "rwkv" else "key.weight")

    source = copy_of(spec, tmp_path / "missing")
    edit_tensors(source, lambda t: t.pop(name))
    refused(source, tmp_path / "out", f"tensor '{name}' is missing")

    source = copy_of(spec, tmp_path / "shape")
    edit_tensors(source, lambda t: t.__setitem__(name, t[name][:-1]))
    refused(source, tmp_path / "out", f"tensor '{name}' has shape")

    source = copy_of(spec, tmp_path / "nan")
    edit_tensors(source, lambda t: t[name].view(-1).__setitem__(3, float("nan")))
    refused(source, tmp_path / "out", f"tensor '{name}' contains NaN")

    source = copy_of(spec, tmp_path / "extra")
    edit_tensors(source, lambda t: t.__setitem__("backbone.stray", torch.zeros(2)))
    refused(source, tmp_path / "out", "cannot place tensor 'backbone.stray'")

    source = copy_of(spec, tmp_path / "type")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    refused(source, tmp_path / "out", r"type 'gpt2'.*imports: \[.*'mamba', 'mamba2'.*'rwkv'")

    source = copy_of(spec, tmp_path / "head")
    (source / "config.json").write_text(json.dumps({**config, "architectures": ["SomethingForSequenceClassification"]}))
    refused(source, tmp_path / "out", "only .*ForCausalLM .*converts")

    source = copy_of(spec, tmp_path / "null")  # a number given as null: named, not a TypeError's traceback
    (source / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": None}))
    refused(source, tmp_path / "out", r"layer_norm_epsilon must be a finite number, got None")
    if arch != "rwkv":
        (source / "config.json").write_text(json.dumps({**config, "expand": None, "intermediate_size": None}
                                                       if arch == "mamba" else {**config, "expand": "2"}))
        refused(source, tmp_path / "out", "expand must be a finite number" if arch == "mamba2"
                else "(expand|intermediate_size) must be")

    source = copy_of(spec, tmp_path / "sharded")  # a tensor in two .bin shards: which one is the model's?
    tensors = load_file(str(source / "model.safetensors"))
    (source / "model.safetensors").unlink()
    shards = {"a.bin": dict(tensors), "b.bin": {name: tensors[name]}}
    for shard, held in shards.items():
        torch.save(held, source / shard)
    weight_map = {**{n: "a.bin" for n in tensors}, name: "b.bin"}
    (source / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    refused(source, tmp_path / "out", f"tensor '{name}' is in two shards")


@torch.no_grad()
def assert_gives_the_references_one_pass(spec: dict, converted_directory: Path) -> None:
    model = load_checkpoint(converted_directory)
    expected = load_file(str(Path(spec["dir"]) / "ref.safetensors"))["one_pass"]
    tokens = torch.tensor(spec["tokens"])
    assert (model(tokens, model.init_state(2))[0] - expected).abs().max() < TOLERANCE


def test_pytorch_model_bin_converts_like_safetensors(references, tmp_path):
    """pytorch_model.bin, its pickle parsed as data (never unpickled), gives the same model."""
    spec = references[("mamba2", 0)]
    source = copy_of(spec, tmp_path)
    torch.save(load_file(str(source / "model.safetensors")), source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    summary = convert(source, tmp_path / "ours")
    assert summary["weights_file"] == "pytorch_model.bin"
    assert_gives_the_references_one_pass(spec, tmp_path / "ours")


def test_sharded_pytorch_model_bin_converts_like_safetensors(references, tmp_path):
    """pytorch_model.bin.index.json and its shards (how larger checkpoints were saved before
    safetensors), each parsed as data; an index naming a file outside the directory is refused."""
    spec = references[("rwkv", 0)]
    source = copy_of(spec, tmp_path)
    tensors = load_file(str(source / "model.safetensors"))
    (source / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :]}
    for shard, held in shards.items():
        torch.save({name: tensors[name] for name in held}, source / shard)
    index = {"metadata": {}, "weight_map": {name: shard for shard, held in shards.items() for name in held}}
    (source / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    summary = convert(source, tmp_path / "ours")
    assert summary["weights_file"] == "pytorch_model.bin.index.json"
    assert_gives_the_references_one_pass(spec, tmp_path / "ours")

    index["weight_map"][names[0]] = "../elsewhere.bin"
    (source / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    refused(source, tmp_path / "escaping", r"names '\.\./elsewhere\.bin', not a file beside it")


def mamba_ssm_directory(spec: dict, out: Path, ssm_cfg: dict, **config) -> Path:
    """The reference's weights as state-spaces' own directory: mamba_ssm's config.json (no
    model_type) and a pytorch_model.bin under its names (backbone.embedding), a tied head saved
    twice as torch.save saves a tied state dict."""
    hf = json.loads((Path(spec["dir"]) / "hf" / "config.json").read_text())
    tensors = load_file(str(Path(spec["dir"]) / "hf" / "model.safetensors"))
    tensors = {("backbone.embedding.weight" if name == "backbone.embeddings.weight" else name): tensor
               for name, tensor in tensors.items()}
    if hf.get("tie_word_embeddings", True):
        tensors["lm_head.weight"] = tensors["backbone.embedding.weight"]
    out.mkdir()
    (out / "config.json").write_text(json.dumps({
        "d_model": hf["hidden_size"], "n_layer": hf["num_hidden_layers"], "vocab_size": hf["vocab_size"],
        "ssm_cfg": ssm_cfg, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": 1, "tie_embeddings": hf.get("tie_word_embeddings", True), **config}))
    torch.save(tensors, out / "pytorch_model.bin")
    return out


def test_state_spaces_own_format_converts_as_transformers_form(references, tmp_path):
    """state-spaces/mamba-* and mamba2-* as mamba_ssm saves them (config.json with d_model,
    n_layer, ssm_cfg; pytorch_model.bin; the embedding padded to pad_vocab_size_multiple) give the
    reference's log-probabilities; what would change the computation is refused, named."""
    cases = [
        (references[("mamba", 2)], {"d_state": 16, "d_conv": 2, "expand": 3, "dt_rank": 2},
         dict(vocab_size=61, pad_vocab_size_multiple=8)),  # 61 padded to 64 rows
        (references[("mamba2", 0)], {"layer": "Mamba2", "d_state": 8, "headdim": 8, "ngroups": 2, "d_conv": 4,
                                     "expand": 2, "chunk_size": 16}, {}),
    ]
    for number, (spec, ssm_cfg, config) in enumerate(cases):
        source = mamba_ssm_directory(spec, tmp_path / f"source-{number}", ssm_cfg, **config)
        summary = convert(source, tmp_path / f"ours-{number}")
        assert summary["architecture"] == spec["arch"] and summary["weights_file"] == "pytorch_model.bin"
        assert any("gpt-neox-20b" in note for note in summary["notes"]), summary["notes"]
        assert read_config(tmp_path / f"ours-{number}")["converted_from"]["format"] == "mamba_ssm"
        assert_gives_the_references_one_pass(spec, tmp_path / f"ours-{number}")

    spec, ssm_cfg, _ = cases[1]
    for name, change, match in [
        ("hybrid", {"attn_layer_idx": [1]}, "attn_layer_idx"),
        ("mlp", {"d_intermediate": 64}, "d_intermediate"),
        ("layernorm", {"rms_norm": False}, "rms_norm"),
        ("gate", {"ssm_cfg": {**ssm_cfg, "norm_before_gate": True}}, "norm_before_gate"),
        ("part", {"ssm_cfg": {**ssm_cfg, "d_ssm": 32}}, "d_ssm 32"),
        ("layer", {"ssm_cfg": {"layer": "Mamba3"}}, "layer 'Mamba3'"),
        # a value no field takes: named in one line, not a TypeError's traceback
        ("no-limit", {"ssm_cfg": {**ssm_cfg, "dt_limit": None}}, "dt_limit must be"),
        ("one-limit", {"ssm_cfg": {**ssm_cfg, "dt_limit": 0.5}}, "dt_limit must be"),
        ("text-expand", {"ssm_cfg": {**ssm_cfg, "expand": "2"}}, "expand"),
    ]:
        source = mamba_ssm_directory(spec, tmp_path / f"refused-{name}", ssm_cfg)
        written = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**written, **change}))
        refused(source, tmp_path / "out", match)


def test_an_rwkv_world_directory_converts_saying_its_tokenizer_is_not_read(references, tmp_path):
    """RWKV-4 World checkpoints (65,536 tokens) carry no tokenizer.json but their own vocabulary
    file read by remote code: the weights convert, and the notes say text needs a tokenizer.json
    rather than suggesting one exists to copy."""
    from xlserve.models.convert.rwkv import translate_config

    source = copy_of(references[("rwkv", 0)], tmp_path)
    config = json.loads((source / "config.json").read_text())
    _, notes = translate_config({**config, "vocab_size": 65536}, source / "config.json")
    assert any("RWKV World" in note and "tokenizer.json" in note for note in notes), notes
    assert translate_config(config, source / "config.json")[1] == []


def test_a_conversion_builds_no_random_model_and_keeps_ties(references, tmp_path):
    """Importers build their model as a skeleton (on the meta device, nothing allocated) and
    load_placed makes each parameter from its placed value: a conversion holds about one copy
    of the model, not a random one beside the placed weights. A tied embedding and head stay one
    parameter; a model that computes buffers when built is built as usual."""
    from xlserve.models.convert import SourceCheckpoint, SourceTensors, load_placed, read_source_tensors, skeleton
    from xlserve.models.convert.mamba import _place, translate_config
    from xlserve.models.mamba import Mamba
    from xlserve.models.reformer import Reformer, ReformerConfig

    spec = references[("mamba", 0)]  # tied
    source_dir = Path(spec["dir"]) / "hf"
    config, _ = translate_config(json.loads((source_dir / "config.json").read_text()), source_dir / "config.json")
    model = skeleton(Mamba, config)
    assert all(parameter.is_meta for parameter in model.parameters())
    tensors, weights_file = read_source_tensors(source_dir)
    source = SourceTensors(SourceCheckpoint(source_dir, {}, tensors, weights_file))
    model = load_placed(model, _place(model, source), source)
    assert not any(parameter.is_meta for parameter in model.parameters())
    assert model.head.weight is model.embedding.weight
    expected = load_file(str(Path(spec["dir"]) / "ref.safetensors"))["one_pass"]
    with torch.no_grad():
        tokens = torch.tensor(spec["tokens"])
        assert (model(tokens, model.init_state(2))[0] - expected).abs().max() < TOLERANCE
    assert not any(tensor.is_meta for tensor in skeleton(Reformer, ReformerConfig()).buffers())


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin", "model-00002-of-00002.safetensors"])
def test_a_git_lfs_pointer_in_place_of_the_weights_is_named_as_one(tmp_path, weights):
    """A `git clone` without git-lfs leaves a pointer of about 130 bytes where each weights file
    should be: named as such, with what to run, not as a damaged header or pickle."""
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"],
                                                    "vocab_size": 50280, "hidden_size": 768, "num_hidden_layers": 24}))
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 516993768\n"
    if weights.startswith("model-"):  # a sharded checkpoint whose second shard is the pointer
        save_file({"backbone.embeddings.weight": torch.zeros(2, 2)}, str(source / "model-00001-of-00002.safetensors"))
        (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "backbone.embeddings.weight": "model-00001-of-00002.safetensors", "lm_head.weight": weights}}))
    (source / weights).write_bytes(pointer)
    with pytest.raises(ConversionError) as refused:
        convert(source, tmp_path / "out")
    message = str(refused.value)
    assert message.startswith(f"{source / weights} is a Git LFS pointer ({len(pointer)} bytes)"), message
    assert "git lfs pull" in message and not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_the_embedding_under_its_older_name_converts_as_transformers_reads_it(references, tmp_path, arch):
    """Some Mamba and Mamba-2 directories on the hub save `backbone.embedding.weight`, which
    transformers' load hook renames to `backbone.embeddings.weight`: they convert to the same model."""
    spec = references[(arch, 0)]
    source = copy_of(spec, tmp_path)
    tensors = load_file(str(source / "model.safetensors"))
    tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
    save_file(tensors, str(source / "model.safetensors"))
    convert(source, tmp_path / "ours")
    assert_gives_the_references_one_pass(spec, tmp_path / "ours")


def test_a_source_read_into_memory_lets_each_tensor_go_once_it_is_taken(references, tmp_path):
    """A pytorch_model.bin is parsed into memory whole (a legacy torch.save's storages are copies,
    not views of a mapped file): each source tensor is let go once the importer has taken it, so
    the conversion does not hold the whole source beside the model it builds."""
    import weakref

    from xlserve.models.convert import SourceCheckpoint, SourceTensors

    spec = references[("mamba", 0)]
    tensors = load_file(str(Path(spec["dir"]) / "hf" / "model.safetensors"))
    name = next(iter(tensors))
    kept = weakref.ref(tensors[name])
    source = SourceTensors(SourceCheckpoint(Path(spec["dir"]) / "hf", {}, tensors, "pytorch_model.bin"))
    taken = source.take(name, tuple(tensors[name].shape))
    assert name in source.tensors and source.first_of(name) == name  # still known by name
    del taken
    assert kept() is None  # nothing holds it but what the importer placed
    with pytest.raises(ConversionError, match="taken twice"):
        source.take(name, (1,))
