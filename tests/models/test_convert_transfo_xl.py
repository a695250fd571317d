"""`xlserve convert` of Hugging Face Transformer-XL checkpoints: parity with the reference
(transformers 4.37.2, the last release whose TransfoXL runs) and clear failures.

Reference models are built from configs with random weights (nothing is downloaded), saved with
save_pretrained, converted, and compared in float32. The reference always starts from EMPTY
memories (zero-length mems): its default `init_mems` fills mem_len zero vectors that take
attention mass, which the original Transformer-XL and xlserve do not have (design.md §3).

Weights are drawn with init_std 0.1 instead of 0.02 so that the output distributions are far
from uniform: greedy comparisons then test the model, not float noise between near-ties.
"""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers", reason="parity tests need transformers==4.37.2 (pip install -e '.[test]')")
from transformers import TransfoXLConfig, TransfoXLLMHeadModel  # noqa: E402

from xlserve.models.checkpoint import load_checkpoint  # noqa: E402
from xlserve.models.convert import ConversionError, convert  # noqa: E402
from xlserve.models.tokenizer import WordTokenizer, tokenizer_for_checkpoint  # noqa: E402
from xlserve.models.transformer_xl import TransformerXL  # noqa: E402
from xlserve.server.cli import main as cli  # noqa: E402
from tests.models.helpers import run_in_chunks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The output of TransfoXL will be updated:DeprecationWarning")

BASE = dict(
    vocab_size=500, d_model=32, d_embed=32, n_head=2, d_head=16, d_inner=64, n_layer=2, mem_len=16,
    cutoffs=[50, 200], div_val=4, clamp_len=-1, same_length=True, dropout=0.1,
    init_std=0.1, proj_init_std=0.1,
)

CONFIGS = {
    # adaptive softmax with cutoffs and div_val 4 (the WikiText-103 layout), post-norm
    "adaptive-div4-same-length": dict(),
    "adaptive-div4-clamp": dict(clamp_len=5),
    "adaptive-div4-no-same-length": dict(same_length=False, clamp_len=7),
    # no adaptive softmax: one table, one softmax, shared u/v, pre-norm without a final norm
    "plain-pre-norm-shared-r": dict(cutoffs=[], div_val=1, pre_lnorm=True, untie_r=False),
    # div_val 1 with cutoffs and d_embed != d_model: one table, a projection per cluster
    "adaptive-div1-projected": dict(div_val=1, d_embed=16, same_length=False),
    # nothing tied: output tables and projections of their own
    "untied": dict(div_val=4, tie_word_embeddings=False, proj_share_all_but_first=False, pre_lnorm=True),
}


def build_reference(**overrides) -> TransfoXLLMHeadModel:
    torch.manual_seed(0)
    return TransfoXLLMHeadModel(TransfoXLConfig(**{**BASE, **overrides})).eval()


def empty_mems(reference, batch_size: int) -> list[torch.Tensor]:
    c = reference.config
    return [torch.zeros(0, batch_size, c.d_model) for _ in range(c.n_layer)]


def reference_log_probs(reference, tokens, chunk):
    mems = empty_mems(reference, tokens.shape[0])
    outputs = []
    with torch.no_grad():
        for start in range(0, tokens.shape[1], chunk):
            out = reference(input_ids=tokens[:, start : start + chunk], mems=mems)
            outputs.append(out.prediction_scores)
            mems = out.mems
    return torch.cat(outputs, dim=1)


def our_log_probs(model, tokens, chunk):
    return run_in_chunks(model, tokens, chunk)[0]


def random_tokens(shape, seed=1, vocab=BASE["vocab_size"]):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def save_reference(reference, directory, safe=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference.save_pretrained(directory, safe_serialization=safe)
    return directory


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (reference, our converted model), built once for the module."""
    pairs = {}
    for name, overrides in CONFIGS.items():
        root = tmp_path_factory.mktemp(name)
        reference = build_reference(**overrides)
        convert(save_reference(reference, root / "hf"), root / "xl")
        pairs[name] = (reference, load_checkpoint(root / "xl"))
    return pairs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_log_probs_match_the_reference_over_segments_with_memory(converted, name):
    reference, model = converted[name]
    assert isinstance(model, TransformerXL) and model.config.adaptive
    tokens = random_tokens((2, 60))  # 5 segments of 12 against a memory of 16
    expected = reference_log_probs(reference, tokens, chunk=12)
    actual = our_log_probs(model, tokens, chunk=12)
    assert actual.shape == expected.shape == (2, 60, BASE["vocab_size"])
    assert (actual - expected).abs().max().item() <= 1e-4
    assert actual.exp().sum(-1).sub(1).abs().max().item() < 1e-4  # a distribution over the whole vocabulary
    if reference.config.same_length:
        # with same_length, our token-by-token decoding also matches the reference's segments
        by_token = our_log_probs(model, tokens, chunk=1)
        assert (by_token - expected).abs().max().item() <= 1e-4


def test_the_reference_default_memory_is_not_empty(converted):
    """Why the parity tests pass empty mems: mems=None makes the reference attend to zeros."""
    reference, model = converted["adaptive-div4-same-length"]
    tokens = random_tokens((1, 12))
    with torch.no_grad():
        default = reference(input_ids=tokens).prediction_scores
    assert (default - our_log_probs(model, tokens, 12)).abs().max().item() > 1e-3


def greedy(step, first_log_probs, n):
    """Greedy tokens (B, n) from the log-probs after the prompt; step(tokens (B, 1)) -> log-probs."""
    generated = []
    log_probs = first_log_probs
    for _ in range(n):
        token = log_probs[:, -1].argmax(-1, keepdim=True)
        generated.append(token)
        log_probs = step(token)
    return torch.cat(generated, dim=1)


@pytest.mark.parametrize("name", ["adaptive-div4-clamp", "adaptive-div4-no-same-length", "adaptive-div1-projected", "untied"])
def test_greedy_generation_gives_the_same_tokens(converted, name):
    reference, model = converted[name]
    prompt = random_tokens((2, 20), seed=5)
    with torch.no_grad():
        out = reference(input_ids=prompt, mems=empty_mems(reference, 2))
        ref_mems = [out.mems]

        def reference_step(token):
            result = reference(input_ids=token, mems=ref_mems[0])
            ref_mems[0] = result.mems
            return result.prediction_scores

        ref_tokens = greedy(reference_step, out.prediction_scores, 30)

        log_probs, state = model(prompt, model.init_state(2))
        our_state = [state]

        def our_step(token):
            result, our_state[0] = model(token, our_state[0])
            return result

        our_tokens = greedy(our_step, log_probs, 30)
    assert torch.equal(our_tokens, ref_tokens)
    assert len(set(our_tokens[0].tolist())) > 1  # not a degenerate constant output


def test_pytorch_model_bin_converts_without_unpickling(tmp_path):
    reference = build_reference()
    save_reference(reference, tmp_path / "hf", safe=False)
    assert (tmp_path / "hf" / "pytorch_model.bin").is_file()
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    summary = convert(tmp_path / "hf", tmp_path / "xl")
    assert summary["weights_file"] == "pytorch_model.bin"
    tokens = random_tokens((1, 30))
    model = load_checkpoint(tmp_path / "xl")
    assert (our_log_probs(model, tokens, 10) - reference_log_probs(reference, tokens, 10)).abs().max() <= 1e-4


class _RunsCodeWhenUnpickled:
    marker = None

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # a plain unpickler would create this file


def test_a_pickle_that_needs_more_than_tensors_is_refused_and_runs_nothing(tmp_path):
    hf = save_reference(build_reference(), tmp_path / "hf")
    (hf / "model.safetensors").unlink()
    _RunsCodeWhenUnpickled.marker = tmp_path / "pwned"
    torch.save({"transformer.word_emb.emb_layers.0.weight": _RunsCodeWhenUnpickled()}, hf / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=r"pytorch_model\.bin.*imports (io|builtins)\.open.*never run"):
        convert(hf, tmp_path / "xl")
    assert not (tmp_path / "pwned").exists()
    assert not (tmp_path / "xl").exists()


def test_a_directory_without_weights_names_what_it_looked_for(tmp_path):
    hf = save_reference(build_reference(), tmp_path / "hf")
    (hf / "model.safetensors").rename(hf / "weights.h5")
    with pytest.raises(ConversionError, match=r"model\.safetensors.*pytorch_model\.bin.*weights\.h5"):
        convert(hf, tmp_path / "xl")


def test_a_config_of_another_architecture_fails_clearly(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConversionError, match=r"'gpt2'.*GPT2LMHeadModel.*imports: \[.*'transfo-xl'"):
        convert(hf, tmp_path / "xl")
    (hf / "config.json").write_text(json.dumps({"model_type": "transfo-xl", "architectures": ["TransfoXLModel"]}))
    with pytest.raises(ConversionError, match=r"TransfoXLModel.*only TransfoXLLMHeadModel"):
        convert(hf, tmp_path / "xl")
    assert not (tmp_path / "xl").exists()


def _rewrite_tensors(hf, change):
    tensors = load_file(str(hf / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(hf / "model.safetensors"))


def _nothing_left_behind(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_tensor_of_the_wrong_shape_is_named_and_nothing_is_written(tmp_path):
    hf = save_reference(build_reference(), tmp_path / "hf")
    _rewrite_tensors(hf, lambda t: t.__setitem__("transformer.layers.1.dec_attn.r_net.weight", torch.zeros(3, 3)))
    with pytest.raises(ConversionError, match=r"'transformer\.layers\.1\.dec_attn\.r_net\.weight' has shape \(3, 3\), expected \(32, 32\)"):
        convert(hf, tmp_path / "xl")
    assert _nothing_left_behind(tmp_path)


def test_missing_unplaceable_and_non_finite_tensors_are_named(tmp_path):
    hf = save_reference(build_reference(), tmp_path / "hf")
    original = load_file(str(hf / "model.safetensors"))

    _rewrite_tensors(hf, lambda t: t.pop("crit.cluster_weight"))
    with pytest.raises(ConversionError, match=r"'crit\.cluster_weight' is missing"):
        convert(hf, tmp_path / "xl")

    save_file({**original, "transformer.extra.weight": torch.zeros(2)}, str(hf / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"cannot place tensor 'transformer\.extra\.weight'"):
        convert(hf, tmp_path / "xl")

    bad = dict(original)
    bad["crit.out_layers.1.bias"] = torch.full_like(original["crit.out_layers.1.bias"], float("nan"))
    save_file(bad, str(hf / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"'crit\.out_layers\.1\.bias' contains NaN"):
        convert(hf, tmp_path / "xl")
    assert _nothing_left_behind(tmp_path)


def test_an_existing_output_directory_is_never_overwritten(tmp_path):
    hf = save_reference(build_reference(), tmp_path / "hf")
    (tmp_path / "xl").mkdir()
    (tmp_path / "xl" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not an empty directory"):
        convert(hf, tmp_path / "xl")
    assert (tmp_path / "xl" / "keep.txt").read_text() == "mine"
    (tmp_path / "xl" / "keep.txt").unlink()
    convert(hf, tmp_path / "xl")  # an empty directory is fine
    assert (tmp_path / "xl" / "model.safetensors").is_file()


def _symbols(n):
    return ["<eos>", "<unk>", "the", ",", "."] + [f"w{i}" for i in range(n - 5)]


def test_cli_converts_with_a_symbol_list_and_the_checkpoint_serves_words(tmp_path, capsys):
    reference = build_reference()
    hf = save_reference(reference, tmp_path / "hf")
    symbols = tmp_path / "vocab.txt"
    symbols.write_text("\n".join(_symbols(BASE["vocab_size"])) + "\n")
    cli(["convert", str(hf), str(tmp_path / "xl"), "--symbols", str(symbols)])
    summary = json.loads(capsys.readouterr().out)
    assert summary["architecture"] == "transformer-xl" and summary["tokenizer"] == "words"
    assert "symbols.json" in summary["files"]

    config = json.loads((tmp_path / "xl" / "config.json").read_text())
    assert config["converted_from"]["architecture"] == "TransfoXLLMHeadModel"
    tokenizer = tokenizer_for_checkpoint(config, tmp_path / "xl")
    assert isinstance(tokenizer, WordTokenizer) and tokenizer.vocab_size == BASE["vocab_size"]
    ids = tokenizer.encode("the w3 , nope .\nthe")
    assert ids == [2, 8, 3, 1, 4, 0, 2]
    assert tokenizer.decode(ids) == "the w3 , <unk> .\nthe"

    model = load_checkpoint(tmp_path / "xl")
    tokens = torch.tensor([ids * 3])
    assert (our_log_probs(model, tokens, 7) - reference_log_probs(reference, tokens, 7)).abs().max() <= 1e-4


def test_cli_failures_exit_with_the_message(tmp_path):
    hf = save_reference(build_reference(), tmp_path / "hf")
    wrong = tmp_path / "symbols.json"
    wrong.write_text(json.dumps(_symbols(10)))
    with pytest.raises(SystemExit, match=r"lists 10 symbols, the model's vocab_size is 500"):
        cli(["convert", str(hf), str(tmp_path / "xl"), "--symbols", str(wrong)])
    assert not (tmp_path / "xl").exists()


def test_without_a_symbol_list_the_weights_convert_and_serving_says_what_is_missing(tmp_path):
    hf = save_reference(build_reference(), tmp_path / "hf")
    summary = convert(hf, tmp_path / "xl")
    assert any("symbols.json" in note for note in summary["notes"])
    config = json.loads((tmp_path / "xl" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"symbols\.json does not exist.*--symbols"):
        tokenizer_for_checkpoint(config, tmp_path / "xl")
    # a symbols.json placed in the source directory is picked up without --symbols
    (hf / "symbols.json").write_text(json.dumps(_symbols(BASE["vocab_size"])))
    convert(hf, tmp_path / "xl2")
    config = json.loads((tmp_path / "xl2" / "config.json").read_text())
    assert tokenizer_for_checkpoint(config, tmp_path / "xl2").token_text(2) == "the"


def test_the_server_serves_a_converted_word_level_model(tmp_path):
    from fastapi.testclient import TestClient

    from xlserve.server.app import build_app
    from xlserve.server.settings import Settings

    hf = save_reference(build_reference(), tmp_path / "hf")
    (hf / "symbols.json").write_text(json.dumps(_symbols(BASE["vocab_size"])))
    convert(hf, tmp_path / "wt-tiny")
    settings = Settings(models=str(tmp_path / "wt-tiny"), device="cpu", state_dir=tmp_path / "state", torch_threads=1)
    with TestClient(build_app(settings)) as client:
        body = {"model": "wt-tiny", "prompt": "the w3 , w10 .", "max_tokens": 6, "temperature": 0}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["text"]
    words = text.split()
    assert words and all(w in _symbols(BASE["vocab_size"]) for w in words)


@pytest.mark.parametrize("failure", ["disk full", "parent is a file"])
def test_a_conversion_that_cannot_write_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, failure):
    """A full disk (a 2.8B-parameter model writes 11 GB of float32) or an output whose parent is a
    file ends `xlserve convert` in one line naming the output, with no staging directory left."""
    import errno

    from safetensors import SafetensorError

    from xlserve.models import checkpoint

    save_reference(build_reference(), tmp_path / "hf")
    out = tmp_path / "xl"
    if failure == "disk full":
        def full_disk(*args, **kwargs):
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

        monkeypatch.setattr(checkpoint, "save_checkpoint", full_disk)  # convert imports it when it runs
        expected = f"xlserve convert: cannot write {out}: Error while serializing"
    else:
        (tmp_path / "file").write_text("not a directory")
        out = tmp_path / "file" / "xl"
        expected = f"xlserve convert: cannot write {out}: [Errno {errno.EEXIST}]"
    with pytest.raises(SystemExit) as stopped:
        cli(["convert", str(tmp_path / "hf"), str(out)])
    assert str(stopped.value).startswith(expected), stopped.value
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(["hf"] + (["file"] if failure != "disk full" else []))


@pytest.mark.parametrize("field, value, named", [("n_layer", 2.5, "n_layer"), ("n_layer", 0, "n_layer"),
                                                 ("mem_len", 8.0, "mem_len"), ("d_inner", "64", "d_inner")])
def test_a_config_value_the_model_cannot_take_is_named_and_nothing_is_written(tmp_path, field, value, named):
    """A value of the wrong type or range is refused as a served checkpoint's config is
    (ArchConfig.from_dict): "n_layer": 2.5 had failed in the model's constructor with a
    traceback, and "mem_len": 8.0 converted into a checkpoint the server then refused."""
    hf = save_reference(build_reference(), tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ConversionError, match=named):
        convert(hf, tmp_path / "xl")
    assert _nothing_left_behind(tmp_path)


def test_a_config_that_is_not_utf8_json_is_refused_in_a_line(tmp_path):
    hf = save_reference(build_reference(), tmp_path / "hf")
    (hf / "config.json").write_bytes(b'{"model_type": "transfo-xl\xff"}')
    with pytest.raises(ConversionError, match="not valid JSON"):
        convert(hf, tmp_path / "xl")
    (hf / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConversionError, match="config.json"):
        convert(hf, tmp_path / "xl")
    assert _nothing_left_behind(tmp_path)
