from dataclasses import replace

import torch

from xlserve.models.checkpoint import load_checkpoint
from xlserve.models.training.data import is_held_out, stdlib_corpus
from xlserve.models.training.evaluate import bits_per_byte
from xlserve.models.training.train import STANDARD_RECIPE, train


def test_split_rule_is_the_design_rule():
    corpus = stdlib_corpus()
    assert corpus.held_out and corpus.train
    assert all(is_held_out(p) for p in corpus.held_out)
    assert not any(is_held_out(p) for p in corpus.train)
    assert not any("site-packages" in p for p in corpus.train + corpus.held_out)


def test_training_resumes_where_it_stopped(tmp_path):
    recipe = replace(STANDARD_RECIPE, train_bytes=4 * 32 * 6, batch_size=4, segment_len=32,
                     eval_every=1000, save_every=3, quick_eval_bytes=2000, warmup_steps=2)
    train("transformer-xl", "tiny", tmp_path / "a", replace(recipe, train_bytes=4 * 32 * 3), log=lambda s: None)
    resumed = train("transformer-xl", "tiny", tmp_path / "a", recipe, log=lambda s: None)
    straight = train("transformer-xl", "tiny", tmp_path / "b", recipe, log=lambda s: None)
    # resuming restores weights, optimiser moments and memory: the same model as one run
    for a, b in zip(resumed.state_dict().values(), straight.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6)
    loaded = load_checkpoint(tmp_path / "a")
    docs = [b"def f(x):\n    return x + 1\n" * 4]
    assert abs(bits_per_byte(loaded, docs) - bits_per_byte(straight, docs)) < 1e-5
