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
