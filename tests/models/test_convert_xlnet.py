"""`xlserve convert` for Hugging Face XLNetLMHeadModel: parity with transformers 4.37.2 on randomly
initialised references (nothing is downloaded), and the spiece.model tokenizer."""

import io
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sentencepiece = pytest.importorskip("sentencepiece")

from xlserve.models.checkpoint import load_checkpoint, read_config  # noqa: E402
from xlserve.models.convert import ConversionError, convert  # noqa: E402
from xlserve.models.tokenizer import SentencePieceTokenizer, tokenizer_for_checkpoint  # noqa: E402
from xlserve.models.xlnet import permutation_masks  # noqa: E402

VOCAB = 120


@pytest.fixture(scope="module")
def spiece_model() -> bytes:
    """A tiny sentencepiece model trained here on a few stdlib sources (vocabulary = VOCAB)."""
    import inspect
    import json as json_module

    text = inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder)
    buffer = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in text.splitlines() if line.strip()]), model_writer=buffer,
        vocab_size=VOCAB, model_type="unigram", character_coverage=1.0, minloglevel=2,
        control_symbols=["<cls>", "<sep>", "<pad>", "<mask>", "<eod>", "<eop>"],
    )
    return buffer.getvalue()


def reference(tmp_path: Path, spiece: bytes | None = None, **overrides):
    """A random XLNetLMHeadModel saved with save_pretrained, and our conversion of it."""
    torch.manual_seed(0)
    values = dict(vocab_size=VOCAB, d_model=32, n_layer=3, n_head=2, d_inner=64, dropout=0.0, mem_len=None)
    values.update(overrides)
    model = transformers.XLNetLMHeadModel(transformers.XLNetConfig(**values)).eval()
    model.save_pretrained(tmp_path / "hf")
    if spiece is not None:
        (tmp_path / "hf" / "spiece.model").write_bytes(spiece)
    summary = convert(tmp_path / "hf", tmp_path / "ours")
    return model, load_checkpoint(tmp_path / "ours"), summary


def left_to_right(ids):
    """The reference's inputs for the left-to-right order: position i sees only j < i (its
    content stream also sees i), and every position is predicted."""
    B, T = ids.shape
    perm_mask = torch.triu(torch.ones(T, T), diagonal=0).expand(B, T, T)
    target_mapping = torch.eye(T).expand(B, T, T)
    return perm_mask, target_mapping


def text(batch, length, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [dict(mem_len=None), dict(mem_len=8), dict(mem_len=8, clamp_len=5, ff_activation="relu")])
def test_left_to_right_parity_over_segments_with_memory(tmp_path, overrides):
    """Reference position i predicts token i; ours at i - 1 predicts the same token. The last
    prediction of each of our calls is the reference's first of the next segment."""
    ref, ours, _ = reference(tmp_path, **overrides)
    ids = text(2, 26)
    ref_rows, our_rows, mems, state = [], [], None, ours.init_state(2)
    with torch.no_grad():
        for start in range(0, 26, 7):
            segment = ids[:, start : start + 7]
            perm_mask, target_mapping = left_to_right(segment)
            out = ref(segment, mems=mems, perm_mask=perm_mask, target_mapping=target_mapping, use_mems=True)
            ref_rows.append(torch.log_softmax(out.logits, dim=-1))
            mems = out.mems
            log_probs, state = ours(segment, state)
            our_rows.append(log_probs)
    expected, got = torch.cat(ref_rows, dim=1)[:, 1:], torch.cat(our_rows, dim=1)[:, :-1]
    assert (expected - got).abs().max().item() < 1e-4
    if overrides["mem_len"]:
        assert state.length == overrides["mem_len"] and mems[0].shape[0] == overrides["mem_len"]


def test_permutation_parity_with_partial_prediction_segments_and_memory(tmp_path):
    ref, ours, _ = reference(tmp_path, mem_len=10)
    ids = text(2, 21, 2)
    g = torch.Generator().manual_seed(3)
    mems, state = None, ours.init_state(2)
    with torch.no_grad():
        for start in range(0, 21, 7):
            segment = ids[:, start : start + 7]
            order = torch.stack([torch.randperm(7, generator=g) for _ in range(2)])
            segment_ids = torch.randint(0, 2, (2, 7), generator=g)
            _, query, predicted = permutation_masks(order, 3)
            target_mapping = torch.zeros(2, 3, 7).scatter_(2, predicted[..., None], 1.0)
            out = ref(segment, mems=mems, perm_mask=(~query).float(), target_mapping=target_mapping,
                      token_type_ids=segment_ids, use_mems=True)
            mems = out.mems
            log_probs, _, state = ours.permuted(segment, state, order, 3, segment_ids=segment_ids)
            assert (log_probs - torch.log_softmax(out.logits, dim=-1)).abs().max().item() < 1e-4


def test_greedy_generation_gives_the_same_tokens(tmp_path):
    """Ours: one incremental step per token. Reference: the whole text + a dummy position to
    predict, under a left-to-right permutation mask, recomputed every step. (A large init
    scale, so that a random model's greedy choices vary instead of repeating one token.)"""
    ref, ours, _ = reference(tmp_path, initializer_range=0.5)
    mine, theirs, gaps = [], [], []
    with torch.no_grad():
        for seed in range(4):
            prompt = text(1, 6, seed)
            log_probs, state = ours(prompt, ours.init_state(1))
            for _ in range(6):
                token = log_probs[:, -1].argmax(-1, keepdim=True)
                mine.append(token.item())
                log_probs, state = ours(token, state)

            sequence = prompt
            for _ in range(6):
                ids = torch.cat([sequence, torch.zeros(1, 1, dtype=torch.long)], dim=1)
                perm_mask, _ = left_to_right(ids)
                target_mapping = torch.zeros(1, 1, ids.shape[1])
                target_mapping[0, 0, -1] = 1.0
                logits = ref(ids, perm_mask=perm_mask, target_mapping=target_mapping).logits[0, -1]
                top2 = logits.topk(2).values
                gaps.append((top2[0] - top2[1]).item())
                theirs.append(logits.argmax().item())
                sequence = torch.cat([sequence, torch.tensor([[theirs[-1]]])], dim=1)
    assert mine == theirs
    assert len(set(mine)) > 4 and min(gaps) > 1e-3  # varied choices, none decided by float noise


def test_converted_directory_carries_the_tokenizer(tmp_path, spiece_model):
    _, ours, summary = reference(tmp_path, spiece=spiece_model)
    assert summary["architecture"] == "xlnet" and "spiece.model" in summary["files"]
    config = read_config(tmp_path / "ours")
    assert config["tokenizer"] == "sentencepiece" and config["config"]["same_length"] is False
    tokenizer = tokenizer_for_checkpoint(config, tmp_path / "ours")
    assert isinstance(tokenizer, SentencePieceTokenizer) and tokenizer.vocab_size == VOCAB
    reference_tokenizer = transformers.XLNetTokenizer(vocab_file=str(tmp_path / "hf" / "spiece.model"))
    for sample in ["Hello,  world 1990, and   ``quoted''  café\n next", "def decode(self, s):\n    return s", "x = 12,345, 7,"]:
        ids = tokenizer.encode(sample)
        assert ids == reference_tokenizer.encode(sample, add_special_tokens=False)
        detokenizer = tokenizer.detokenizer()
        assert "".join(detokenizer.push(t) for t in ids) + detokenizer.flush() == tokenizer.decode(ids)


def test_missing_spiece_model_is_a_note_not_an_error(tmp_path):
    _, _, summary = reference(tmp_path)
    assert any("spiece.model" in note for note in summary["notes"])


def test_refusals_name_the_reason(tmp_path, spiece_model):
    with pytest.raises(ConversionError, match="bi_data"):
        reference(tmp_path / "a", bi_data=True)
    with pytest.raises(ConversionError, match="same_length"):
        reference(tmp_path / "b", attn_type="uni", same_length=True)
    with pytest.raises(ConversionError, match="pieces"):
        reference(tmp_path / "c", spiece=spiece_model, vocab_size=VOCAB + 1)

    reference(tmp_path / "d")
    source = tmp_path / "d" / "hf"
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "architectures": ["XLNetModel"]}))
    with pytest.raises(ConversionError, match="XLNetLMHeadModel"):
        convert(source, tmp_path / "d" / "out")
    (source / "config.json").write_text(json.dumps(config))

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "transformer.layer.1.rel_attn.r"}, str(source / "model.safetensors"))
    with pytest.raises(ConversionError, match="transformer.layer.1.rel_attn.r' is missing"):
        convert(source, tmp_path / "d" / "out")
    save_file({**tensors, "transformer.extra": torch.zeros(2)}, str(source / "model.safetensors"))
    with pytest.raises(ConversionError, match="transformer.extra"):
        convert(source, tmp_path / "d" / "out")
    assert not (tmp_path / "d" / "out").exists()  # nothing half-written
