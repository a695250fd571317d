"""`xlserve convert` for Hugging Face ReformerModelWithLMHead: parity with transformers 4.37.2 on
randomly initialised references saved with save_pretrained (nothing is downloaded), in one pass
and token by token against the reference's cache; greedy generation; the byte vocabulary; the
refusals and bad inputs.

Reference log-probabilities are over ids 2..257 renormalised (xlserve's bytes, docs/convert.md).
The reference's cached decoding is compared at batch 1: in transformers 4.37.2 its cached LSH
attention reads the first row's hidden states for every row of a batch (the batch offset in
`_get_relevant_hid_states_and_buckets` is always 0), which test_the_references_batched_cache_
mixes_rows shows; xlserve decodes each row as the reference decodes it alone."""

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from xlserve.models.checkpoint import load_checkpoint  # noqa: E402
from xlserve.models.convert import ConversionError, convert  # noqa: E402
from xlserve.models.reformer import LSHMemory  # noqa: E402
import xlserve.models.reformer as reformer_module  # noqa: E402
from xlserve.server.cli import main as cli  # noqa: E402

transformers.logging.set_verbosity_error()

BASE = dict(vocab_size=258, hidden_size=16, attention_head_size=4, num_attention_heads=2, feed_forward_size=32,
            is_decoder=True, hash_seed=3, hidden_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0,
            local_attention_probs_dropout_prob=0.0, initializer_range=0.5, axial_norm_std=0.5,
            max_position_embeddings=128, axial_pos_shape=[8, 16], axial_pos_embds_dim=[6, 10])
CONFIGS = {
    # LSH and local layers alternating, two hash rounds, chunks of 4 (shorter than every text)
    "mixed": dict(attn_layers=["local", "lsh", "local", "lsh"], lsh_attn_chunk_length=4, local_attn_chunk_length=4,
                  num_buckets=4, num_hashes=2),
    # three rounds, LSH chunks of 6 looking two back, local chunks of 4 (padding to 12), gelu
    "three-rounds": dict(attn_layers=["lsh", "local", "lsh"], lsh_attn_chunk_length=6, lsh_num_chunks_before=2,
                         local_attn_chunk_length=4, num_buckets=6, num_hashes=3, hidden_act="gelu",
                         axial_pos_shape=[4, 32]),
    # a factorised hash (2 x 4 buckets) over four rounds, chunks of 5 and 3 (padding to 15), local two back
    "factorised": dict(attn_layers=["local", "lsh", "lsh", "local"], lsh_attn_chunk_length=5,
                       local_attn_chunk_length=3, local_num_chunks_before=2, num_buckets=[2, 4], num_hashes=4,
                       hidden_act="gelu_new"),
    # learned absolute positions, one round of 8 buckets
    "learned-positions": dict(attn_layers=["lsh", "local"], axial_pos_embds=False, lsh_attn_chunk_length=8,
                              local_attn_chunk_length=4, num_buckets=8, num_hashes=1),
}
MEASURED: dict = {}  # max |difference| per configuration and path (printed with -s)


def reference_model(**overrides):
    torch.manual_seed(0)
    values = {**BASE, **overrides}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.ReformerModelWithLMHead(transformers.ReformerConfig(**values)).eval()


def save_reference(model, directory: Path, safe: bool = True) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory, safe_serialization=safe)
    return directory


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each configuration's reference and our conversion of it, built once."""
    out = {}
    for name, overrides in CONFIGS.items():
        root = tmp_path_factory.mktemp(name)
        reference = reference_model(**overrides)
        convert(save_reference(reference, root / "hf"), root / "xl")
        out[name] = (reference, load_checkpoint(root / "xl"))
    yield out
    for line in sorted(MEASURED.items()):
        print("reformer parity", *line)


def byte_ids(batch, length, seed):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference_log_probs(logits):
    """The reference's distribution over ids 2..257 (bytes 0..255), renormalised."""
    return torch.log_softmax(logits[..., 2:].float(), dim=-1)


@torch.no_grad()
def reference_cached(reference, ids, prompt):
    """The reference as generate() drives it: the prompt in one forward with use_cache, then one
    token per forward with past_buckets_states."""
    out = reference(ids[:, :prompt] + 2, use_cache=True)
    rows, past = [reference_log_probs(out.logits)], out.past_buckets_states
    for t in range(prompt, ids.shape[1]):
        out = reference(ids[:, t : t + 1] + 2, past_buckets_states=past, use_cache=True)
        rows.append(reference_log_probs(out.logits))
        past = out.past_buckets_states
    return torch.cat(rows, dim=1)


@torch.no_grad()
def ours_fed(model, ids, first, chunk):
    """Our model: the first `first` tokens in one call, the rest in calls of `chunk`."""
    log_probs, state = model(ids[:, :first], model.init_state(ids.shape[0]))
    rows = [log_probs]
    for s in range(first, ids.shape[1], chunk):
        log_probs, state = model(ids[:, s : s + chunk], state)
        rows.append(log_probs)
    return torch.cat(rows, dim=1), state


def record(name, path, value):
    MEASURED[(name, path)] = max(MEASURED.get((name, path), 0.0), value)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_pass_log_probs_match_the_reference(converted, name):
    """Whole texts longer than a chunk, padded by the reference (37) and not (60), batch 2."""
    reference, ours = converted[name]
    for length in (37, 60):
        ids = byte_ids(2, length, length)
        with torch.no_grad():
            expected = reference_log_probs(reference(ids + 2).logits)
            got, _ = ours(ids, ours.init_state(2))
        difference = (got - expected).abs().max().item()
        record(name, "one pass", difference)
        assert difference < 1e-4, (name, length)


@pytest.mark.parametrize("decode_path", ["dense", "gathered"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_token_by_token_matches_the_references_cache(converted, name, decode_path, monkeypatch):
    """Prompts of 1 token, exactly one LSH chunk, and longer ones (padded or not), then one token
    per call against the reference's past_buckets_states loop; our later tokens in calls of 5
    give the same. Both ways of computing a decoded token's LSH attention: scoring the whole
    (short) history at once, and gathering each query's windows (long histories)."""
    if decode_path == "gathered":
        monkeypatch.setattr(reformer_module, "DENSE_DECODE_HISTORY", 0)
    reference, ours = converted[name]
    chunk = reference.config.lsh_attn_chunk_length
    for prompt in sorted({1, chunk, 9, 21}):
        ids = byte_ids(1, 32, 100 + prompt)
        expected = reference_cached(reference, ids, prompt)
        by_token, _ = ours_fed(ours, ids, prompt, 1)
        by_five, _ = ours_fed(ours, ids, prompt, 5)
        difference = max((by_token - expected).abs().max().item(), (by_five - expected).abs().max().item())
        record(name, "token by token", difference)
        assert difference < 1e-4, (name, prompt)
        # the reference itself: one pass and cached decoding are different functions
        with torch.no_grad():
            one_pass = reference_log_probs(reference(ids + 2).logits)
        assert (one_pass - expected).abs().max().item() > 1e-3


def test_a_padded_first_call_whose_buckets_fool_the_references_offset_test(converted):
    """After a padded first call the reference stores buckets with offsets r·(n_b + 1) and hashes
    a new token with those offsets only if its stored buckets exceed R·n_b − 1; when no bucket of
    the last round is in the top R − 1 the test fails and new tokens sort one bucket lower per
    round. xlserve stores and tests the same way, so it agrees there too."""
    reference, ours = converted["mixed"]
    R, n_b = 2, 4
    for seed in range(400):
        ids = byte_ids(1, 30, seed)
        with torch.no_grad():
            _, state = ours(ids[:, :5], ours.init_state(1))  # 5 tokens: padded to 8
        if all(int(b.max()) <= R * n_b - 1 for b in state.buckets):
            break
    else:
        pytest.fail("no prompt among 400 fools the offset test")
    expected = reference_cached(reference, ids, 5)
    got, state = ours_fed(ours, ids, 5, 1)
    assert (got - expected).abs().max().item() < 1e-4
    assert int(state.buckets[0][0, 5:, :, 1].max()) < n_b + n_b  # decoded tokens took offset n_b in round 1


@pytest.mark.parametrize("name", ["mixed", "three-rounds", "factorised"])
def test_greedy_generation_gives_the_same_tokens(converted, name):
    """The reference's generate() (greedy, ids 0 and 1 suppressed, no end-of-text id) against
    ours: a prompt, then one incremental step per token."""
    reference, ours = converted[name]
    mine, theirs = [], []
    for seed in range(3):
        prompt = byte_ids(1, 10, 200 + seed)
        with torch.no_grad():
            out = reference.generate(prompt + 2, max_new_tokens=16, do_sample=False, num_beams=1, eos_token_id=None,
                                     pad_token_id=0, suppress_tokens=[0, 1])
            theirs += (out[0, 10:] - 2).tolist()
            log_probs, state = ours(prompt, ours.init_state(1))
            for _ in range(16):
                token = log_probs[:, -1].argmax(-1, keepdim=True)
                mine.append(int(token))
                log_probs, state = ours(token, state)
    assert mine == theirs
    assert len(set(mine)) > 4  # varied choices


def test_the_references_batched_cache_mixes_rows(converted):
    """Why token-by-token parity is checked one row at a time: the reference's batch-2 cached
    decoding gives row 1 other log-probs than row 1 alone; ours batched equals ours alone."""
    reference, ours = converted["mixed"]
    ids = byte_ids(2, 24, 7)
    batched = reference_cached(reference, ids, 6)
    alone = reference_cached(reference, ids[1:], 6)
    assert (batched[0] - reference_cached(reference, ids[:1], 6)[0]).abs().max().item() < 1e-4
    assert (batched[1] - alone[0]).abs().max().item() > 1e-2
    ours_batched, _ = ours_fed(ours, ids, 6, 1)
    assert (ours_batched[1] - alone[0]).abs().max().item() < 1e-4


def test_a_converted_state_round_trips_through_safetensors(converted, tmp_path):
    reference, ours = converted["mixed"]
    ids = byte_ids(1, 40, 8)
    _, state = ours_fed(ours, ids[:, :30], 17, 4)
    save_file(state.to_tensors(), str(tmp_path / "state.safetensors"))
    restored = LSHMemory.from_tensors(load_file(str(tmp_path / "state.safetensors")))
    ours.check_state(restored, 30)
    with torch.no_grad():
        a, _ = ours(ids[:, 30:], state)
        b, _ = ours(ids[:, 30:], restored)
    assert torch.equal(a, b)
    expected = reference_cached(reference, ids, 17)[:, 30:]
    assert (b - expected).abs().max().item() < 1e-4


def test_the_rotations_are_the_references(converted):
    reference, ours = converted["three-rounds"]
    vectors = torch.randn(1, 2, 9, 4)
    lsh = reference.reformer.encoder.layers[0].attention.self_attention
    with torch.no_grad():
        theirs = lsh._hash_vectors(vectors, 3, None).view(1, 2, 3, 9) - (torch.arange(3) * 6)[:, None]
    from xlserve.models.reformer import hash_buckets

    assert torch.equal(hash_buckets(vectors, ours.layers[0].attention.rotations, [6]), theirs)


def test_hash_seed_null_converts_with_seed_0_and_a_note(tmp_path):
    reference = reference_model(hash_seed=None, **CONFIGS["mixed"])
    summary = convert(save_reference(reference, tmp_path / "hf"), tmp_path / "xl")
    assert any("hash_seed is null" in note for note in summary["notes"])
    assert any("ids 2..257 are bytes" in note for note in summary["notes"])
    config = json.loads((tmp_path / "xl" / "config.json").read_text())
    assert config["converted_from"]["hash_seed"] == 0 and config["converted_from"]["byte_shift"] == 2
    assert config["tokenizer"] == "bytes" and config["config"]["vocab_size"] == 256
    for layer in reference.reformer.encoder.layers:  # the reference with hash_seed 0: the same log-probs
        if hasattr(layer.attention.self_attention, "hash_seed"):
            layer.attention.self_attention.hash_seed = 0
    ids = byte_ids(1, 37, 9)
    ours = load_checkpoint(tmp_path / "xl")
    with torch.no_grad():
        expected = reference_log_probs(reference(ids + 2).logits)
        assert (ours(ids, ours.init_state(1))[0] - expected).abs().max().item() < 1e-4


def test_pytorch_model_bin_converts_without_unpickling(tmp_path):
    reference = reference_model(**CONFIGS["mixed"])
    hf = save_reference(reference, tmp_path / "hf", safe=False)
    assert (hf / "pytorch_model.bin").is_file() and not (hf / "model.safetensors").exists()
    summary = convert(hf, tmp_path / "xl")
    assert summary["weights_file"] == "pytorch_model.bin" and summary["architecture"] == "reformer"
    ours = load_checkpoint(tmp_path / "xl")
    ids = byte_ids(1, 30, 10)
    with torch.no_grad():
        expected = reference_log_probs(reference(ids + 2).logits)
        assert (ours(ids, ours.init_state(1))[0] - expected).abs().max().item() < 1e-4


class _RunsCodeWhenUnpickled:
    marker = None

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # a plain unpickler would create this file


def test_a_pickle_that_needs_more_than_tensors_is_refused_and_runs_nothing(tmp_path):
    hf = save_reference(reference_model(**CONFIGS["mixed"]), tmp_path / "hf")
    (hf / "model.safetensors").unlink()
    _RunsCodeWhenUnpickled.marker = tmp_path / "pwned"
    torch.save({"lm_head.bias": _RunsCodeWhenUnpickled()}, hf / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=r"pytorch_model\.bin.*imports (io|builtins)\.open.*never run"):
        convert(hf, tmp_path / "xl")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "xl").exists()


def _edited(tmp_path, **changes) -> Path:
    hf = tmp_path / "hf"
    if not hf.exists():
        save_reference(reference_model(**CONFIGS["mixed"]), hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "edited").mkdir(exist_ok=True)
    for name in ("model.safetensors",):
        target = hf / "edited" / name
        if not target.exists():
            target.symlink_to(hf / name)
    config.update(changes)
    (hf / "edited" / "config.json").write_text(json.dumps(config))
    return hf / "edited"


@pytest.mark.parametrize("changes, message", [
    (dict(is_decoder=False), "is_decoder is false"),
    (dict(lsh_num_chunks_after=1), "lsh_num_chunks_after is 1"),
    (dict(local_num_chunks_after=1), "local_num_chunks_after is 1"),
    (dict(num_buckets=None), "num_buckets is null"),
    (dict(num_buckets=5), "even"),
    (dict(vocab_size=320), "vocab_size 320 is not a byte vocabulary"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(attn_layers=["local", "full"]), "attn_layers"),
    (dict(hidden_act="tanhshrink"), "hidden_act"),
    (dict(architectures=["ReformerModel"]), "only ReformerModelWithLMHead"),
    (dict(model_type="bert"), "type 'bert'"),
])
def test_configurations_the_reference_cannot_decode_are_refused(tmp_path, changes, message):
    source = _edited(tmp_path, **changes)
    with pytest.raises(ConversionError, match=message):
        convert(source, tmp_path / "xl")
    assert not (tmp_path / "xl").exists()


def test_bad_tensors_are_named_and_nothing_is_written(tmp_path):
    hf = save_reference(reference_model(**CONFIGS["mixed"]), tmp_path / "hf")
    tensors = load_file(str(hf / "model.safetensors"))
    name = "reformer.encoder.layers.1.attention.self_attention.query_key.weight"
    cases = [
        ({**tensors, name: torch.zeros(8, 15)}, rf"'{name}' has shape \(8, 15\), expected \(8, 16\)"),
        ({**tensors, name: tensors[name].clone().index_fill_(0, torch.tensor([0]), float("nan"))},
         rf"'{name}' contains NaN or infinity"),
        ({k: v for k, v in tensors.items() if k != name}, rf"'{name}' is missing"),
        ({**tensors, "reformer.extra": torch.zeros(2)}, r"cannot place tensor 'reformer.extra'"),
        ({**tensors, "lm_head.decoder.bias": tensors["lm_head.bias"] + 1}, "differ"),
    ]
    for changed, message in cases:
        save_file(changed, str(hf / "model.safetensors"))
        with pytest.raises(ConversionError, match=message):
            convert(hf, tmp_path / "xl")
        assert not (tmp_path / "xl").exists()
    save_file({**tensors, "lm_head.decoder.bias": tensors["lm_head.bias"].clone()}, str(hf / "model.safetensors"))
    convert(hf, tmp_path / "xl")  # the tied bias under both names is one tensor


def test_cli_converts_and_prints_a_summary(tmp_path, capsys):
    hf = save_reference(reference_model(**CONFIGS["mixed"]), tmp_path / "hf")
    cli(["convert", str(hf), str(tmp_path / "xl")])
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["architecture"] == "reformer" and summary["tokenizer"] == "bytes"
    assert "note: vocabulary: ids 2..257" in captured.err
    with pytest.raises(SystemExit, match="is_decoder is false"):
        cli(["convert", str(_edited(tmp_path, is_decoder=False)), str(tmp_path / "xl2")])


@pytest.mark.slow
def test_a_served_converted_reformer_echoes_the_references_log_probs(tmp_path):
    from fastapi.testclient import TestClient

    from xlserve.server.app import build_app
    from xlserve.server.settings import Settings

    reference = reference_model(**CONFIGS["mixed"])
    convert(save_reference(reference, tmp_path / "hf"), tmp_path / "reformer-tiny")
    text = "def f(x):\n    return x + 1\n"
    ids = torch.tensor([list(text.encode())])
    with torch.no_grad():
        expected = reference_log_probs(reference(ids + 2).logits)[0]  # the prompt is one prefill chunk
    expected = [float(expected[t - 1, ids[0, t]]) for t in range(1, ids.shape[1])]
    settings = Settings(models=str(tmp_path / "reformer-tiny"), device="cpu", state_dir=tmp_path / "state",
                        torch_threads=1)
    with TestClient(build_app(settings)) as client:
        body = {"model": "reformer-tiny", "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        served = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert served[0] is None and len(served) == len(expected) + 1
    assert max(abs(a - b) for a, b in zip(served[1:], expected)) < 1e-4
