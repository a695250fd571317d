"""Adaptive input and adaptive softmax on their own, and the word-level tokenizer."""

import json

import pytest
import torch

from xlserve.models.tokenizer import WordTokenizer
from xlserve.models.transformer_xl import AdaptiveEmbedding, AdaptiveLogSoftmax, TransformerXL, TransformerXLConfig


def adaptive(div_val=4, d_embed=16, d_model=16, cutoffs=(10, 30), tie_weight=True, tie_projs=()):
    torch.manual_seed(0)
    embedding = AdaptiveEmbedding(50, d_embed, d_model, list(cutoffs), div_val)
    softmax = AdaptiveLogSoftmax(50, d_embed, d_model, list(cutoffs), div_val, embedding, tie_weight, list(tie_projs))
    return embedding, softmax


@pytest.mark.parametrize("div_val,d_embed,cutoffs", [(4, 16, (10, 30)), (1, 8, (10, 30)), (1, 16, ()), (2, 16, ())])
def test_log_softmax_is_a_distribution_over_the_whole_vocabulary(div_val, d_embed, cutoffs):
    _, softmax = adaptive(div_val=div_val, d_embed=d_embed, cutoffs=cutoffs)
    log_probs = softmax(torch.randn(3, 5, 16))
    assert log_probs.shape == (3, 5, 50)
    assert (log_probs.exp().sum(-1) - 1).abs().max().item() < 1e-5


def test_a_tail_word_is_its_cluster_probability_times_its_probability_in_the_cluster():
    _, softmax = adaptive()
    h = torch.randn(1, 16)
    log_probs = softmax(h)[0]
    in_second_cluster = log_probs[10:30].exp().sum()
    head = torch.log_softmax(
        torch.cat([h @ softmax.projections[0] @ softmax.tables[0].weight.T + softmax.bias[:10],
                   h @ softmax.projections[0] @ softmax.cluster_weight.T + softmax.cluster_bias], -1), -1)[0]
    assert torch.allclose(in_second_cluster.log(), head[10], atol=1e-5)


def test_embedding_uses_each_clusters_table_and_projection():
    embedding, _ = adaptive()
    tokens = torch.tensor([[0, 9, 10, 29, 30, 49]])
    out = embedding(tokens)
    assert out.shape == (1, 6, 16)
    for position, token in enumerate(tokens[0].tolist()):
        cluster = 0 if token < 10 else 1 if token < 30 else 2
        low = [0, 10, 30][cluster]
        expected = embedding.tables[cluster].weight[token - low] @ embedding.projections[cluster].T
        assert torch.allclose(out[0, position], expected, atol=1e-6)
    assert [t.weight.shape[1] for t in embedding.tables] == [16, 4, 1]


def test_tying_shares_tables_and_the_chosen_projections():
    embedding, softmax = adaptive(tie_projs=[False, True, True])
    assert softmax.tables[1].weight is embedding.tables[1].weight
    assert softmax.projections[0] is not embedding.projections[0]
    assert softmax.projections[2] is embedding.projections[2]
    embedding, softmax = adaptive(div_val=1, d_embed=8, tie_weight=False, tie_projs=[True, False, True])
    assert softmax.tables[0].weight is not embedding.tables[0].weight
    assert softmax.projections[0] is embedding.projections[0] and softmax.projections[2] is embedding.projections[0]
    with pytest.raises(ValueError, match="tie_projs"):
        adaptive(tie_projs=[True])


def test_bad_cutoffs_are_refused():
    with pytest.raises(ValueError, match="cutoffs"):
        adaptive(cutoffs=(30, 10))
    with pytest.raises(ValueError, match="width 0"):
        adaptive(div_val=4, d_embed=4, cutoffs=(10, 30))


def test_adaptive_transformer_xl_saves_and_loads_with_ties(tmp_path):
    from xlserve.models.checkpoint import load_checkpoint, save_checkpoint

    config = TransformerXLConfig(
        vocab_size=50, n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=8,
        adaptive=True, cutoffs=[10, 30], div_val=2, tie_projs=[False, True, True], pre_norm=True, final_norm=False,
    )
    torch.manual_seed(0)
    model = TransformerXL(config).eval()
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded.head.projections[1] is loaded.embedding.projections[1]
    tokens = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        a, _ = model(tokens, model.init_state(2))
        b, _ = loaded(tokens, loaded.init_state(2))
    assert torch.equal(a, b)


@pytest.mark.parametrize("div_val,d_embed,cutoffs", [(4, 16, (10, 30)), (1, 8, (10, 30)), (1, 16, ())])
def test_log_prob_of_a_target_is_its_whole_rows_entry(div_val, d_embed, cutoffs):
    """Scoring each row at its target alone (the head for every row, a tail cluster only for
    the rows whose target is in it) gives the whole row's entry, for targets of every cluster."""
    _, softmax = adaptive(div_val=div_val, d_embed=d_embed, cutoffs=cutoffs)
    hidden = torch.randn(40, 16)
    targets = torch.randperm(50)[:40]  # every cluster, in no order
    with torch.no_grad():
        expected = softmax(hidden).gather(1, targets[:, None])[:, 0]
        assert torch.allclose(softmax.log_prob_of(hidden, targets), expected, atol=1e-5)
        only_head = torch.arange(5)  # no row in any tail cluster
        assert torch.allclose(softmax.log_prob_of(hidden[:5], only_head), softmax(hidden[:5])[torch.arange(5), only_head],
                              atol=1e-5)
        for outside in (50, -1):  # an id the vocabulary does not have is refused, not clamped into the head
            with pytest.raises(ValueError, match="target ids"):
                softmax.log_prob_of(hidden[:2], torch.tensor([3, outside]))


def test_whole_rows_train_as_the_rows_scored_at_their_targets():
    """With autograd the whole rows are written into one tensor in place (no log_softmax into its
    columns, which has no derivative): their loss at the targets gives log_prob_of's gradient."""
    _, softmax = adaptive(div_val=2, d_embed=16, cutoffs=(10, 30))
    hidden = torch.randn(40, 16)
    targets = torch.randperm(50)[:40]  # every cluster
    parameters = list(softmax.parameters())
    whole = torch.autograd.grad(-softmax(hidden).gather(1, targets[:, None]).sum(), parameters, allow_unused=True)
    scored = torch.autograd.grad(-softmax.log_prob_of(hidden, targets).sum(), parameters, allow_unused=True)
    for a, b in zip(whole, scored):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def adaptive_model(**overrides) -> TransformerXL:
    config = TransformerXLConfig(**{
        "vocab_size": 50, "n_layer": 2, "d_model": 16, "n_head": 2, "d_head": 8, "d_inner": 32, "mem_len": 8,
        "adaptive": True, "cutoffs": [10, 30], "div_val": 2, **overrides})
    torch.manual_seed(0)
    return TransformerXL(config).eval()


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("adaptive_head", [True, False])
def test_forward_scored_is_forward_without_the_whole_rows(adaptive_head, quantize):
    """Transformer-XL's forward_scored (the adaptive softmax's own, or the default through
    whole rows) gives each row's last row and each next token's log-probability as forward
    does, for right-padded rows of different lengths too, and the same memory."""
    from xlserve.models.interface import rows_and_scores
    from xlserve.models.quantize import quantize_model

    model = adaptive_model() if adaptive_head else adaptive_model(adaptive=False, cutoffs=[], div_val=1)
    model = quantize_model(model, quantize)
    assert bool(adaptive_head and quantize == "int8") == bool(getattr(model.head, "int8_products", None))
    tokens = torch.randint(0, 50, (3, 12))
    with torch.inference_mode():
        _, state = model(torch.randint(0, 50, (3, 5)), model.init_state(3))
        for lengths in (None, torch.tensor([12, 7, 1])):
            log_probs, memory = model(tokens, state) if lengths is None else model(tokens, state, lengths=lengths)
            rows, scores, scored_memory = model.forward_scored(tokens, state, lengths)
            expected_rows, expected_scores = rows_and_scores(log_probs, tokens, lengths)
            assert torch.allclose(rows, expected_rows, atol=1e-5)
            if lengths is None:
                assert torch.allclose(scores, expected_scores, atol=1e-5)
            else:  # scores past a row's length mean nothing
                for row, length in enumerate(lengths.tolist()):
                    assert torch.allclose(scores[row, : length - 1], expected_scores[row, : length - 1], atol=1e-5)
            assert all(torch.equal(a, b) for a, b in zip(memory.keys + memory.values + [memory.valid],
                                                         scored_memory.keys + scored_memory.values + [scored_memory.valid]))


def test_adaptive_fields_need_adaptive():
    with pytest.raises(ValueError, match="adaptive=True"):
        TransformerXL(TransformerXLConfig(n_layer=1, d_model=16, n_head=2, d_head=8, cutoffs=[100]))


def test_word_tokenizer_reads_text_and_json_and_streams_like_decode(tmp_path):
    (tmp_path / "v.txt").write_text("<eos> 99\n<unk> 5\nhello 3\nworld 2\n")
    (tmp_path / "v.json").write_text(json.dumps(["<eos>", "<unk>", "hello", "world"]))
    a, b = WordTokenizer.from_file(tmp_path / "v.txt"), WordTokenizer.from_file(tmp_path / "v.json")
    assert a.symbols == b.symbols == ["<eos>", "<unk>", "hello", "world"]
    ids = a.encode("hello  world\nhi world\n")
    assert ids == [2, 3, 0, 1, 3, 0]
    detokenizer = a.detokenizer()
    assert "".join(detokenizer.push(t) for t in ids) + detokenizer.flush() == a.decode(ids) == "hello world\n<unk> world\n"


def test_word_tokenizer_refuses_bad_symbol_lists(tmp_path):
    (tmp_path / "dup.json").write_text(json.dumps(["a", "b", "a"]))
    with pytest.raises(ValueError, match=r"'a' appears twice"):
        WordTokenizer.from_file(tmp_path / "dup.json")
    (tmp_path / "blank.txt").write_text("a\n\nb\n")
    with pytest.raises(ValueError, match=r"blank\.txt:2 is blank"):
        WordTokenizer.from_file(tmp_path / "blank.txt")
    with pytest.raises(ValueError, match="no <unk>"):
        WordTokenizer(["a", "b"]).encode("c")
